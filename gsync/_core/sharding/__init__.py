"""``shard_optimizer=True``: each device steps its shard of every bucket (ZeRO-1), and checkpoints gather the
shards. A feature over the step: the step path reaches it only through :mod:`gsync._core.step.features`."""
