"""Reduction across processes over a ``torch.distributed`` process group.

Each process owns some devices (its :class:`~gsync._core.topology.Topology`). One
call reduces in two stages: first across this process's devices, in process
and weighted (as :class:`~gsync.comm.local.LocalCollective` does), into the
first local buffer; then one cross-process ``all_reduce(SUM)`` of that buffer
on the group. The weights are already each device's share of the *global*
batch, so the sum over processes of the weighted local sums is the answer.
The result is then copied back to every other local buffer.

The same code serves gloo on CPU tensors and NCCL on CUDA tensors: the
collective is launched with ``async_op=True`` and waited with
``work.wait()``. With gloo that blocks the calling thread until the data is
there. With NCCL it makes the caller's *current stream* wait for NCCL's
stream and returns, so completion is stream-ordered exactly as for
:class:`~gsync._core.transports.nccl.NcclCollective`: the sync server calls collectives
inside ``streams.comm_streams()``, so the local reduction, the NCCL launch
(which waits for the current stream) and the write-back are all queued on
the devices' comm streams, and nothing here synchronizes the host with the
GPU. Calls run in gsync's communication thread, never on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..distributed.waiting import GROUP_TYPES, broadcast_from, wait_work
from ...errors import ConfigError, GsyncError
from ..topology import Topology

__all__ = ("ProcessGroupCollective",)


class ProcessGroupCollective:
    """A :class:`~gsync.Collective` for the local devices of one rank of ``group``.

    ``topology.rank`` and ``topology.world_size`` are this process's rank in
    ``group`` and the group's size (group ranks, not global ranks: a subgroup
    works too). Global device 0, the broadcast source, is the first local
    device of group rank 0.

    The collective never creates or destroys the group: :meth:`close` only
    stops further use, so a user's group stays up.

    ``abort`` is the run's abort flag: once it is set, a call blocked in a
    gloo wait leaves within a fraction of a second with
    :class:`~gsync._core.threads.FitAborted` (see :mod:`gsync._core.distributed.waiting`),
    so no thread is left inside a collective a failed peer never completes.

    :raises ~gsync.ConfigError: when ``topology`` does not describe this
        process's place in ``group``.
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, abort: threading.Event | None = None) -> None:
        if group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(group, GROUP_TYPES):
            raise ConfigError(
                "ProcessGroupCollective needs a torch.distributed.ProcessGroup this process belongs to; "
                f"got {group!r}"
            )
        rank, size = group.rank(), group.size()
        if topology.world_size != size or topology.rank != rank:
            raise ConfigError(
                f"topology says rank {topology.rank} of {topology.world_size}, but this process is rank {rank} "
                f"of {size} in the process group; build the topology with gsync._core.distributed.gather_topology"
            )
        if topology.local_devices < 1:
            raise ConfigError(f"a process needs at least one local device, topology has {topology.local_devices}")
        self._group = group
        self._topology = topology
        self._abort = abort
        self._closed = False

    @property
    def world_devices(self) -> int:
        return self._topology.world_devices

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset()

    @property
    def topology(self) -> Topology:
        return self._topology

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Replace every local tensor with the weighted sum over all devices of all ranks, in place.

        Blocks the calling thread until the cross-process reduction finished
        (gloo) or is ordered before later work on the current stream (NCCL).
        Every rank must call it, in the same order, with buffers of the same
        size and dtype.

        :raises ~gsync.GsyncError: after :meth:`close`, or when the number of
            tensors or weights is not the number of local devices.
        :raises RuntimeError: (from torch.distributed) when the cross-process
            collective fails, e.g. because a peer died or the group timed out.
        :raises ~gsync._core.threads.FitAborted: when the abort flag is set while waiting.
        """
        self._check(tensors, weights)
        target = _contiguous(tensors[0])
        if target.numel() == 0:
            # Every rank has the same (empty) layout, so every rank skips alike.
            return
        # Scale each term before summing so fp16/bf16 buffers do not overflow.
        # A zero weight (a device with an empty shard) is skipped rather than
        # multiplied, so whatever its buffer holds cannot leak in as inf * 0.
        if weights[0] == 0:
            target.zero_()
        else:
            target.mul_(weights[0])
        for tensor, weight in zip(tensors[1:], weights[1:]):
            if weight != 0:
                target.add_(tensor.to(target.device, non_blocking=True), alpha=weight)
        work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        wait_work(work, self._abort, blocking=not target.is_cuda)
        self._write_back(tensors, target)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite every local tensor with global device 0's, in place.

        Blocks like :meth:`all_reduce`; every rank must call it in the same order.

        :raises ~gsync.GsyncError: after :meth:`close`, or when the number of
            tensors is not the number of local devices.
        :raises RuntimeError: (from torch.distributed) when the collective fails.
        """
        self._check(tensors, None)
        target = _contiguous(tensors[0])
        if target.numel() != 0:
            work = broadcast_from(target, self._group)
            wait_work(work, self._abort, blocking=not target.is_cuda)
        self._write_back(tensors, target)

    def close(self) -> None:
        """Refuse further calls. Idempotent; the group is left as it is (this class never owns it)."""
        self._closed = True

    def _check(self, tensors: Sequence[torch.Tensor], weights: Sequence[float] | None) -> None:
        if self._closed:
            raise GsyncError("this ProcessGroupCollective is closed; build a new one for another fit")
        expected = self._topology.local_devices
        if len(tensors) != expected or (weights is not None and len(weights) != expected):
            got = f"{len(tensors)} tensors" + ("" if weights is None else f" and {len(weights)} weights")
            raise GsyncError(f"expected one tensor (and weight) per local device ({expected}), got {got}")

    @staticmethod
    def _write_back(tensors: Sequence[torch.Tensor], result: torch.Tensor) -> None:
        if result is not tensors[0]:
            tensors[0].copy_(result)
        for tensor in tensors[1:]:
            tensor.copy_(result, non_blocking=True)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # Collectives need dense memory; bucket buffers already are, so this copies
    # only for a caller's strided tensor, and the result is copied back.
    return tensor if tensor.is_contiguous() else tensor.contiguous()
