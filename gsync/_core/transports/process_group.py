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
from ...comm._shards import process_bounds, shard_bounds

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
        # Every rank's first global device, learned by the first reduce_scatter or all_gather (a collective,
        # which every rank reaches in the same order), since a topology knows only its own rank's place.
        self._offsets: tuple[int, ...] | None = None
        self._send: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._gather_into_tensor = True
        # Gloo's reduce-scatter is missing from some torch versions gsync supports, and where it exists (2.13)
        # its async work cannot be waited on in slices: is_completed() stays False, and wait(timeout) returns
        # True before a late peer has even sent (measured), so only a wait no abort can end would be right:
        # over gloo an all-reduce sliced afterwards, which is right everywhere (see reduce_scatter for its
        # cost). Another backend's is tried, and where it refuses (before sending anything, on every rank
        # alike), the same all-reduce.
        self._scatter_by_all_reduce = not _uses_nccl(group)

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
        _weighted_local_sum(target, tensors, weights)
        work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        wait_work(work, self._abort, blocking=not target.is_cuda)
        self._write_back(tensors, target)

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Each local device's shard of its buffer becomes the weighted sum of that shard over every device.

        The local devices are summed in process first, as in :meth:`all_reduce`; then each process needs
        only its own devices' shards, a contiguous range: a reduce-scatter over the processes, the buffer
        padded to equal chunks where the split is uneven (NCCL). Over gloo, and a backend that has none, the
        range is cut from one all-reduce of the whole buffer instead: twice the bytes per rank (about
        ``2 (P-1)/P`` buffers against ``(P-1)/P`` for ``P`` processes), as unsharded.

        :raises ~gsync.GsyncError: as :meth:`all_reduce`. :raises RuntimeError: as :meth:`all_reduce`.
        """
        self._check(tensors, weights, contiguous=True)
        target = tensors[0]
        numel = target.numel()
        if numel == 0:
            return
        _weighted_local_sum(target, tensors, weights)
        flat = target.view(-1)
        topology = self._topology
        if topology.world_size > 1:
            ranges = process_bounds(numel, topology.world_devices, self._rank_offsets(target))
            if not self._scatter_by_all_reduce:
                try:
                    self._reduce_scatter_ranges(flat, ranges)
                except (RuntimeError, NotImplementedError) as error:
                    if not _unsupported(error):
                        raise
                    self._scatter_by_all_reduce = True
            if self._scatter_by_all_reduce:
                work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
                wait_work(work, self._abort, blocking=not target.is_cuda)
        bounds = shard_bounds(numel, topology.world_devices)
        for position, tensor in enumerate(tensors[1:], start=1):
            start, stop = bounds[topology.device_offset + position]
            tensor.view(-1)[start:stop].copy_(flat[start:stop], non_blocking=True)

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every local buffer gets every device's shard: the local shards gathered in process, then each
        process's range sent to every other (padded to the longest range where the split is uneven).

        :raises ~gsync.GsyncError: as :meth:`broadcast`. :raises RuntimeError: as :meth:`broadcast`.
        """
        self._check(tensors, None, contiguous=True)
        target = tensors[0]
        numel = target.numel()
        if numel == 0:
            return
        flat = target.view(-1)
        topology = self._topology
        bounds = shard_bounds(numel, topology.world_devices)
        for position, tensor in enumerate(tensors[1:], start=1):
            start, stop = bounds[topology.device_offset + position]
            flat[start:stop].copy_(tensor.view(-1)[start:stop], non_blocking=True)
        if topology.world_size > 1:
            ranges = process_bounds(numel, topology.world_devices, self._rank_offsets(target))
            longest = max(stop - start for start, stop in ranges)
            start, stop = ranges[topology.rank]
            direct = all(stop - start == longest for start, stop in ranges)
            # Sent from a buffer kept for the session (a shard's size), never from the range it lands in.
            mine = self._send_buffer(flat, longest)
            if not direct:
                mine.zero_()
            mine[: stop - start].copy_(flat[start:stop])
            # Equal ranges: gathered straight into the buffer; uneven ones padded, then cut back.
            gathered = flat if direct else flat.new_empty(longest * len(ranges))
            self._all_gather_into(gathered, mine)
            if not direct:
                outputs = gathered.split(longest)
                for rank, ((a, b), output) in enumerate(zip(ranges, outputs)):
                    if rank != topology.rank:
                        flat[a:b].copy_(output[: b - a])
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

    def _check(self, tensors: Sequence[torch.Tensor], weights: Sequence[float] | None, contiguous: bool = False) -> None:
        if self._closed:
            raise GsyncError("this ProcessGroupCollective is closed; build a new one for another fit")
        expected = self._topology.local_devices
        if len(tensors) != expected or (weights is not None and len(weights) != expected):
            got = f"{len(tensors)} tensors" + ("" if weights is None else f" and {len(weights)} weights")
            raise GsyncError(f"expected one tensor (and weight) per local device ({expected}), got {got}")
        if contiguous and not all(tensor.is_contiguous() for tensor in tensors):
            # A shard is a range of the buffer's elements, which a strided tensor does not have.
            raise GsyncError("reduce_scatter and all_gather take contiguous buffers (bucket buffers), not strided views")

    def _reduce_scatter_ranges(self, flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
        """Sum ``flat`` over the ranks, each rank keeping its own range of it (a backend with a reduce-scatter)."""
        longest = max(stop - start for start, stop in ranges)
        if all(stop - start == longest for start, stop in ranges):
            source = flat
        else:
            source = flat.new_zeros(longest * len(ranges))
            for chunk, (start, stop) in zip(source.split(longest), ranges):
                chunk[: stop - start].copy_(flat[start:stop])
        output = flat.new_empty(longest)
        work = dist.reduce_scatter_tensor(output, source, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        wait_work(work, self._abort, blocking=not flat.is_cuda)
        start, stop = ranges[self._topology.rank]
        flat[start:stop].copy_(output[: stop - start])

    def _send_buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements like ``like``'s, kept across calls: no allocation per bucket
        and step, which on the CPU fragments the heap a step at a time."""
        key = (like.dtype, like.device)
        buffer = self._send.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._send[key] = like.new_empty(numel)
        return buffer[:numel]

    def _all_gather_into(self, output: torch.Tensor, mine: torch.Tensor) -> None:
        """``output`` (contiguous, ranks x ``mine``) gets every rank's ``mine``, in rank order."""
        if self._gather_into_tensor:
            try:
                work = dist.all_gather_into_tensor(output, mine, group=self._group, async_op=True)
            except (RuntimeError, NotImplementedError) as error:
                if not _unsupported(error):
                    raise
                # A backend without it refuses before sending anything, on every rank alike: the list form.
                self._gather_into_tensor = False
            else:
                wait_work(work, self._abort, blocking=not output.is_cuda)
                return
        work = dist.all_gather(list(output.split(mine.numel())), mine, group=self._group, async_op=True)
        wait_work(work, self._abort, blocking=not output.is_cuda)

    def _rank_offsets(self, like: torch.Tensor) -> tuple[int, ...]:
        """Each rank's first global device: gathered once, on the device the group's collectives use."""
        if self._offsets is None:
            counts = [torch.zeros(1, dtype=torch.int64, device=like.device) for _ in range(self._topology.world_size)]
            mine = torch.tensor([self._topology.local_devices], dtype=torch.int64, device=like.device)
            wait_work(dist.all_gather(counts, mine, group=self._group, async_op=True), self._abort, blocking=not like.is_cuda)
            offsets, cursor = [], 0
            for count in counts:
                offsets.append(cursor)
                cursor += int(count.item())
            self._offsets = tuple(offsets)
        return self._offsets

    @staticmethod
    def _write_back(tensors: Sequence[torch.Tensor], result: torch.Tensor) -> None:
        if result is not tensors[0]:
            tensors[0].copy_(result)
        for tensor in tensors[1:]:
            tensor.copy_(result, non_blocking=True)


def _unsupported(error: BaseException) -> bool:
    """Whether ``error`` is a backend refusing an operation it does not have (raised before any byte is sent,
    alike on every rank), rather than a collective that failed."""
    text = str(error).lower()
    return isinstance(error, NotImplementedError) or any(
        words in text for words in ("not supported", "does not support", "unsupported", "not implemented")
    )


def _weighted_local_sum(target: torch.Tensor, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    """``target`` (device 0's buffer or its dense copy) becomes the weighted sum of this process's devices."""
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


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # Collectives need dense memory; bucket buffers already are, so this copies
    # only for a caller's strided tensor, and the result is copied back.
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _uses_nccl(group: dist.ProcessGroup) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        # An elastic generation's group, made directly and never registered with torch.distributed: its class
        # says (by name: a CPU build of torch has no ProcessGroupNCCL to compare with).
        return type(group).__name__ == "ProcessGroupNCCL"
