"""Single-process multi-GPU reduction with NCCL, enqueued on each device's comm stream.

One process drives every local GPU: ``torch.cuda.nccl.all_reduce`` launches
one NCCL kernel per device inside one NCCL group, each on that device's comm
stream from a :class:`~gsync._core.streams.CudaStreamSync`. Nothing here waits for
the GPU.

Completion is *stream-ordered*: when a method returns, the operation is
enqueued on every device's comm stream, and the calling thread's current
stream on each device has been made to wait for it (an event wait, skipped
when the current stream already is the comm stream). Work queued afterwards on
either stream sees the result; the host does not, until it synchronizes.
(CPU collectives complete on return; the two contracts agree for any code that
touches the tensors through streams, which on CUDA is all code.) Symmetrically,
each operation first makes the comm stream wait for the caller's current
stream, so inputs the caller wrote on its own stream are visible to it.

NCCL has no complex types: a complex tensor is reduced and broadcast as
its real view (``torch.view_as_real``, a float tensor of twice the
elements), which a sum with real weights treats exactly as the complex sum.

The first reduction over a set of devices builds NCCL communicators
(``ncclCommInitAll``), which blocks the host once; torch caches them per device
set for the life of the process, so :meth:`NcclCollective.close` has nothing to
free.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
import torch.cuda.nccl

from ...errors import ConfigError, GsyncError
from ..streams.cuda import CudaStreamSync, cuda_devices, on_device
from ...comm._shards import shard_bounds

__all__ = ("NcclCollective", "gather_shards", "prepare_for_nccl", "scatter_reduced")

# The calls torch.cuda.nccl makes, as these helpers take them: ``launch(inputs, outputs)`` with one tensor
# of each per device, NCCL's equal-chunk layout (reduce-scatter: output numel x devices == input numel;
# all-gather: output numel == input numel x devices).
Launch = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None]


def prepare_for_nccl(tensor: torch.Tensor, weight: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, wire)``: ``target`` a dense tensor that holds ``tensor`` times ``weight`` (in place when
    ``tensor`` is dense already), ``wire`` the tensor NCCL moves, which shares ``target``'s memory.

    ``wire`` is ``target`` itself, or for a complex tensor its real view (NCCL
    has no complex types, "Unconvertible NCCL type ComplexFloat"). A weight of
    zero gives zeros, never ``inf * 0``; ``None`` (a broadcast) leaves the
    values alone. A strided tensor is copied once, the weight folded into
    the copy. Runs on the current stream; the caller copies ``target`` back
    into a strided ``tensor`` afterwards.
    """
    if tensor.is_contiguous():
        target = tensor
        if weight == 0:
            target.zero_()
        elif weight is not None and weight != 1:
            target.mul_(weight)
    elif weight == 0:
        target = torch.zeros_like(tensor, memory_format=torch.contiguous_format)
    elif weight is None or weight == 1:
        target = tensor.contiguous()
    else:
        target = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        torch.mul(tensor, weight, out=target)
    wire = torch.view_as_real(target) if target.is_complex() else target
    return target, wire


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def scatter_reduced(
    targets: Sequence[torch.Tensor], launch: Launch, place: Callable[[int], AbstractContextManager[object]]
) -> None:
    """NCCL's reduce-scatter over gsync's shards: afterwards device ``i``'s shard of ``targets[i]`` (dense
    buffers, already weighted) holds the sum of that shard over every device.

    NCCL splits into equal chunks; gsync's split may be uneven (:func:`~gsync.comm._shards.shard_bounds`),
    so an uneven buffer is first laid out padded, chunk ``j`` holding shard ``j`` (one copy of the buffer
    per device). ``place(i)`` enters device ``i``'s comm stream, where each device's copies run.
    """
    count = len(targets)
    bounds = shard_bounds(targets[0].numel(), count)
    longest = max(stop - start for start, stop in bounds)
    even = all(stop - start == longest for start, stop in bounds)
    inputs, outputs = [], []
    for i, target in enumerate(targets):
        with place(i):
            flat = target.view(-1)
            if even:
                source = flat
            else:
                source = flat.new_zeros(longest * count)
                for chunk, (start, stop) in zip(source.split(longest), bounds):
                    chunk[: stop - start].copy_(flat[start:stop])
            inputs.append(_wire(source))
            outputs.append(_wire(flat.new_empty(longest)))
    launch(inputs, outputs)
    for i, (target, output) in enumerate(zip(targets, outputs)):
        start, stop = bounds[i]
        with place(i):
            received = torch.view_as_complex(output) if target.is_complex() else output
            target.view(-1)[start:stop].copy_(received[: stop - start])


def gather_shards(
    targets: Sequence[torch.Tensor], launch: Launch, place: Callable[[int], AbstractContextManager[object]]
) -> None:
    """NCCL's all-gather over gsync's shards: afterwards every ``targets[i]`` holds each device's shard from
    that device. Each device sends a copy of its shard (padded to the longest where the split is uneven),
    so no input aliases an output."""
    count = len(targets)
    bounds = shard_bounds(targets[0].numel(), count)
    longest = max(stop - start for start, stop in bounds)
    even = all(stop - start == longest for start, stop in bounds)
    inputs, outputs = [], []
    for i, target in enumerate(targets):
        start, stop = bounds[i]
        with place(i):
            flat = target.view(-1)
            mine = flat.new_zeros(longest)
            mine[: stop - start].copy_(flat[start:stop])
            inputs.append(_wire(mine))
            outputs.append(_wire(flat if even else flat.new_empty(longest * count)))
    launch(inputs, outputs)
    if even:
        return
    for i, (target, output) in enumerate(zip(targets, outputs)):
        with place(i):
            flat = target.view(-1)
            gathered = torch.view_as_complex(output.view(-1, 2)) if target.is_complex() else output
            for chunk, (start, stop) in zip(gathered.split(longest), bounds):
                flat[start:stop].copy_(chunk[: stop - start])


class NcclCollective:
    """A :class:`~gsync.Collective` over the CUDA devices of one process.

    ``tensors[i]`` must live on ``devices[i]``; ``streams`` must order the same
    devices in the same order (its comm streams carry every operation). With
    one device no NCCL call is made: an all-reduce only scales by the weight.

    :raises ~gsync.ConfigError: when CUDA is unavailable, the devices are not
        distinct CUDA devices, ``streams`` orders other devices, or (two or
        more devices) this torch build has no NCCL.
    """

    def __init__(self, devices: Sequence[torch.device | str], streams: CudaStreamSync) -> None:
        self._devices = cuda_devices(devices, "NcclCollective")
        if not isinstance(streams, CudaStreamSync):
            raise ConfigError(f"NcclCollective needs a gsync._core.streams.CudaStreamSync, got {type(streams).__name__}")
        if tuple(streams.devices) != self._devices:
            raise ConfigError(
                f"NcclCollective devices {[str(d) for d in self._devices]} differ from the stream sync's "
                f"{[str(d) for d in streams.devices]}; build both from the same device list"
            )
        if len(self._devices) > 1:
            _require_nccl(self._devices)
        self._comm = [streams.comm_cuda_stream(i) for i in range(len(self._devices))]
        # Reused every call: each is recorded and waited on within one call, in this thread.
        self._before = [torch.cuda.Event() for _ in self._devices]
        self._after = [torch.cuda.Event() for _ in self._devices]
        self._closed = False

    @property
    def world_devices(self) -> int:
        return len(self._devices)

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset()

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Replace every tensor with ``sum(weights[i] * tensors[i])``, in place, stream-ordered.

        Each device scales its own tensor on its comm stream before the NCCL
        sum, so fp16/bf16 buffers hold partial sums no larger than the result
        and do not overflow. A zero weight zeroes the tensor instead of
        multiplying, so an inf or NaN in a device that contributes nothing
        cannot leak in as ``inf * 0``. Does not wait for the GPU.

        :raises ~gsync.GsyncError: after :meth:`close`, or for tensors or
            weights that do not match the devices (count, device, dtype, size).
        :raises RuntimeError: (from torch/NCCL) when the collective cannot be launched.
        """
        self._check(tensors, weights)
        if tensors[0].numel() == 0:
            return
        self._wait_for_callers()
        targets, wires = [], []
        for i, (tensor, weight) in enumerate(zip(tensors, weights)):
            with on_device(self._comm[i]):
                # A strided caller tensor gets a dense copy made on the comm
                # stream; its memory returns to the comm stream's pool, so
                # freeing it after this call needs no record_stream.
                target, wire = prepare_for_nccl(tensor, weight)
            targets.append(target)
            wires.append(wire)
        if len(wires) > 1:
            torch.cuda.nccl.all_reduce(wires, streams=self._comm)
        self._write_back(tensors, targets)
        self._order_callers()

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite every tensor with the first device's, in place, stream-ordered. Does not wait for the GPU.

        :raises ~gsync.GsyncError: after :meth:`close`, or for tensors that do
            not match the devices.
        :raises RuntimeError: (from torch/NCCL) when the collective cannot be launched.
        """
        self._check(tensors, None)
        if len(tensors) == 1 or tensors[0].numel() == 0:
            return
        self._wait_for_callers()
        targets, wires = [], []
        for i, tensor in enumerate(tensors):
            with on_device(self._comm[i]):
                target, wire = prepare_for_nccl(tensor)
            targets.append(target)
            wires.append(wire)
        torch.cuda.nccl.broadcast(wires, root=0, streams=self._comm)
        self._write_back(tensors, targets)
        self._order_callers()

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Each device's shard of its buffer becomes the weighted sum of that shard, stream-ordered (see
        :func:`scatter_reduced`); the rest of each buffer holds its own weighted term. Does not wait for the GPU.

        :raises ~gsync.GsyncError: as :meth:`all_reduce`, and for a strided buffer.
        :raises RuntimeError: (from torch/NCCL) when the collective cannot be launched.
        """
        self._check(tensors, weights, contiguous=True)
        if tensors[0].numel() == 0:
            return
        self._wait_for_callers()
        for i, (tensor, weight) in enumerate(zip(tensors, weights)):
            with on_device(self._comm[i]):
                prepare_for_nccl(tensor, weight)  # dense already: weighted in place
        if len(tensors) > 1:
            scatter_reduced(tensors, self._launch(torch.cuda.nccl.reduce_scatter), self._on_comm)
        self._order_callers()

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every device's buffer gets every device's shard, stream-ordered (see :func:`gather_shards`). Does
        not wait for the GPU.

        :raises ~gsync.GsyncError: as :meth:`broadcast`, and for a strided buffer.
        :raises RuntimeError: (from torch/NCCL) when the collective cannot be launched.
        """
        self._check(tensors, None, contiguous=True)
        if len(tensors) == 1 or tensors[0].numel() == 0:
            return
        self._wait_for_callers()
        gather_shards(tensors, self._launch(torch.cuda.nccl.all_gather), self._on_comm)
        self._order_callers()

    def _on_comm(self, index: int) -> AbstractContextManager[object]:
        return on_device(self._comm[index])

    def _launch(self, operation: Callable[..., None]) -> Launch:
        def launch(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
            operation(inputs, outputs, streams=self._comm)

        return launch

    def close(self) -> None:
        """Refuse further calls. Idempotent; the streams belong to the stream sync, the communicators to torch."""
        self._closed = True

    def _wait_for_callers(self) -> None:
        for device, comm, event in zip(self._devices, self._comm, self._before):
            caller = torch.cuda.current_stream(device)
            if caller.cuda_stream != comm.cuda_stream:
                event.record(caller)
                comm.wait_event(event)

    def _order_callers(self) -> None:
        for device, comm, event in zip(self._devices, self._comm, self._after):
            caller = torch.cuda.current_stream(device)
            if caller.cuda_stream != comm.cuda_stream:
                event.record(comm)
                caller.wait_event(event)

    def _write_back(self, tensors: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
        for i, (tensor, target) in enumerate(zip(tensors, targets)):
            if target is not tensor:
                with on_device(self._comm[i]):
                    tensor.copy_(target)

    def _check(self, tensors: Sequence[torch.Tensor], weights: Sequence[float] | None, contiguous: bool = False) -> None:
        if self._closed:
            raise GsyncError("this NcclCollective is closed; build a new one for another fit")
        if contiguous and not all(tensor.is_contiguous() for tensor in tensors):
            # A shard is a range of the buffer's elements, which a strided tensor does not have.
            raise GsyncError("reduce_scatter and all_gather take contiguous buffers (bucket buffers), not strided views")
        expected = len(self._devices)
        if len(tensors) != expected or (weights is not None and len(weights) != expected):
            got = f"{len(tensors)} tensors" + ("" if weights is None else f" and {len(weights)} weights")
            raise GsyncError(f"expected one tensor (and weight) per device ({expected}), got {got}")
        first = tensors[0]
        for i, (tensor, device) in enumerate(zip(tensors, self._devices)):
            if tensor.device != device:
                raise GsyncError(f"tensor {i} is on {tensor.device}, expected {device}")
            if tensor.dtype != first.dtype or tensor.numel() != first.numel():
                raise GsyncError(
                    f"tensor {i} is {tensor.dtype} with {tensor.numel()} elements, tensor 0 is {first.dtype} with "
                    f"{first.numel()}: every device must bring the same buffer layout"
                )


def _require_nccl(devices: Sequence[torch.device]) -> None:
    probes = [torch.empty(1, device=device) for device in devices]
    with warnings.catch_warnings():
        # is_available warns (and returns False) on a build without NCCL; the error below says it better.
        warnings.simplefilter("ignore")
        available = torch.cuda.nccl.is_available(probes)
    if not available:
        raise ConfigError(
            f"NcclCollective over {[str(d) for d in devices]} needs NCCL, but this torch build has none "
            "(torch.cuda.nccl.is_available is False); install a CUDA build of torch with NCCL, or train on one device"
        )
