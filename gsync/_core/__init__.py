"""gsync's private core, grouped by role; nothing here is public API (the public surface is re-exported from ``gsync``).

- ``session``: a session's life (the core, the task that owns it, fit's loop, assembly, progress, outcomes)
- ``step``: one step's actors and sync server, their messages and mailboxes, the per-step agreement, the readout
- ``gradients``: buckets, module buffers, the plan rebuilt from the first step
- ``data``: batches split into shards, and the data reader
- ``transports``: the collectives that are not public (NCCL, torch.distributed process groups)
- ``streams``: CUDA and host stream ordering
- ``distributed``: joining a process group, failure reports, heartbeats, start-up agreement
- ``state``: replicas, recovery after a failure, random generators, checkpoint files
- ``threads``, ``devices``, ``topology``: the loop-to-thread bridge, device names, where devices sit
"""
