"""Gradient compression: a wrapper that every transport goes through the same way.

:class:`CompressedCollective` wraps any :class:`~gsync.Collective` (in-process
CPU, NCCL, a ``torch.distributed`` group). A bucket's reduction becomes, per
local device ``i`` in device order:

1. weight, in the bucket's own dtype (fp32): ``tensor_i *= weight_i`` (a
   device with weight 0 is zeroed instead, and left out of the sum);
2. compress: ``payload_i = hook.compress(bucket, i, tensor_i)`` (for
   :class:`LowPrecision`, a cast to bf16 or fp16, rounding to nearest even);
3. reduce: ``hook.reduce(bucket, payloads, all_reduce)``, by default one
   ``all_reduce(payloads)``: the *unweighted* sum of the payloads of every
   device of every process, done by the wrapped collective in the payload
   dtype (in process: in device order, one rounding per addition; across
   processes: that sum per process, then the group's own all-reduce);
4. decompress: ``hook.decompress(bucket, i, payload_i, tensor_i)`` writes the
   sum back into the bucket (a cast back to fp32).

Weighting before the cast is what keeps fp16 from overflowing: every term is
already a share of the mean, so no partial sum exceeds the largest gradient.
Because the in-process and process-group paths run exactly these steps, with
two devices the result is the same to the bit whether they are two devices of
one process or one device in each of two processes (``a + b`` rounds the same
either way). With more devices the payload sum's order is the transport's
(device order in a process, e.g. gloo's ring across processes), so results
agree to the payload's rounding, not to the bit.

Every device ends with the same payload, and ``decompress`` is a function of
it, so every replica applies the same decompressed gradient.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from ..errors import ConfigError, GsyncError
from .._core.transports.capabilities import PER_BUCKET
from .base import Collective

__all__ = ("AllReduce", "CompressionHook", "LowPrecision")

AllReduce = Callable[[Sequence[torch.Tensor]], None]
"""Sums one tensor per local device over every device of every process, in place."""


class CompressionHook(abc.ABC):
    """How a gradient bucket crosses devices: ``compress``, ``reduce``, ``decompress``.

    gsync's counterpart of a DDP communication hook
    (``register_comm_hook(state, hook)``): the hook object is its own state
    (as ``PowerSGDState`` is), and instead of one function that compresses,
    launches the all-reduce and decompresses in a future's callback, the three
    stages are three methods, called in gsync's communication thread for each
    bucket of each step, one bucket at a time, in the same order on every
    process. Pass an instance as ``Engine(compression=hook)``.

    ``bucket`` is the bucket's index in the current plan (the plan is rebuilt
    once after the first step, as DDP's is, so per-bucket state must check the
    size it was made for), or ``-1`` for a reduction outside any plan.
    ``device`` is the local device's index. gsync has already multiplied the
    device's gradient by its weight (its share of the global batch), in the
    bucket's dtype, so the payloads need only be summed.

    Only :meth:`compress` and :meth:`decompress` are required. Override
    :meth:`reduce` for schemes that need more than one collective per bucket
    (PowerSGD's two rounds, a shared quantization scale).

    Every device must end :meth:`reduce` holding the same payload, and
    :meth:`decompress` must be a function of that payload alone (no state that
    differs between devices or processes), so that every replica applies the
    same gradient. ``Engine(check_replicas_every=N)`` catches a hook that breaks
    this within a process.
    """

    @abc.abstractmethod
    def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
        """The payload to sum for this device's bucket.

        ``tensor`` is the flat bucket, already weighted; it is overwritten by
        :meth:`decompress` afterwards, so it may be modified or reused. Every
        device (of every process) must return a tensor of the same dtype and
        number of elements, on ``tensor``'s device.
        """

    def reduce(self, bucket: int, payloads: list[torch.Tensor], all_reduce: AllReduce) -> None:
        """Sum the payloads (one per local device) over every device of every process, in place.

        ``all_reduce(tensors)`` is that sum, for any one tensor per local
        device (same dtype and size across devices); it may be called several
        times, with every process calling it the same number of times. Every
        byte it moves is counted in ``FitStats.reduced_bytes``.
        """
        all_reduce(payloads)

    @abc.abstractmethod
    def decompress(self, bucket: int, device: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced gradient, recovered from the summed ``payload``, into ``out`` (the bucket), in place."""


class LowPrecision(CompressionHook):
    """Reduce in bf16 or fp16: ``Engine(compression="bf16")`` or ``"fp16"``.

    Each device's weighted gradient is cast (round to nearest even), the
    casts are summed in that dtype, and the sum is cast back into the bucket:
    half the bytes of fp32, like DDP's ``bf16_compress_hook`` and
    ``fp16_compress_hook`` (which divide by the world size before the cast,
    as the weights do here). Stateless.

    :raises ~gsync.ConfigError: for a dtype other than ``torch.bfloat16`` or ``torch.float16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"LowPrecision compresses to torch.bfloat16 or torch.float16, got {dtype!r}")
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"LowPrecision({self.dtype})"

    def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
        # A complex gradient is cast as its real and imaginary parts: a cast to a real dtype would drop the latter.
        return (torch.view_as_real(tensor) if tensor.is_complex() else tensor).to(self.dtype)

    def decompress(self, bucket: int, device: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        (torch.view_as_real(out) if out.is_complex() else out).copy_(payload)


_NAMED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_compression(compression: object) -> CompressionHook | None:
    """``Engine(compression=...)``'s value as a hook: ``"bf16"``, ``"fp16"``, ``None`` or a :class:`CompressionHook`.

    :raises ~gsync.ConfigError: for anything else, saying what to write instead.
    """
    expected = "compression must be 'bf16', 'fp16', None or a gsync.CompressionHook instance"
    if compression is None or isinstance(compression, CompressionHook):
        return compression
    if isinstance(compression, str):
        if compression in _NAMED:
            return LowPrecision(_NAMED[compression])
        raise ConfigError(f"{expected}, got {compression!r}")
    if isinstance(compression, torch.dtype):
        names = {dtype: name for name, dtype in _NAMED.items()}
        hint = f"write compression={names[compression]!r}" if compression in names else "gsync compresses to bf16 or fp16"
        raise ConfigError(f"{expected}, got the dtype {compression}: {hint}")
    if isinstance(compression, type) and issubclass(compression, CompressionHook):
        raise ConfigError(f"{expected}, got the class {compression.__name__}: pass an instance, {compression.__name__}(...)")
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        raise ConfigError(
            f"{expected}, got {type(compression).__name__}, which has compress and decompress but does not subclass "
            "gsync.CompressionHook: subclass it (it supplies the default reduce)"
        )
    raise ConfigError(f"{expected}, got {type(compression).__name__} {compression!r}")


class CompressedCollective:
    """A :class:`~gsync.Collective` that reduces through ``hook``, over ``inner``'s transport.

    ``all_reduce`` runs the four steps of this module's docstring;
    ``broadcast`` (BatchNorm buffers) is passed through uncompressed, so it
    stays exact. :meth:`reduce_bucket` is the same reduction naming its
    bucket, which the sync server uses.
    """

    def __init__(self, inner: Collective, hook: CompressionHook) -> None:
        if not isinstance(hook, CompressionHook):
            raise ConfigError(f"CompressedCollective needs a gsync.CompressionHook, got {type(hook).__name__}")
        self.inner = inner
        self.hook = hook

    @property
    def world_devices(self) -> int:
        return self.inner.world_devices

    @property
    def capabilities(self) -> frozenset[str]:
        # Its payloads are the hook's, formed in the bucket buffers: never in place.
        return frozenset({PER_BUCKET})

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Replace every tensor with the weighted sum over all devices, compressed on the way, in place.

        :raises TypeError: when the hook's ``compress`` returns something that is not a tensor.
        :raises ValueError: when the payloads of the devices differ in dtype or size.
        :raises ~gsync.GsyncError: when the tensors and weights differ in number.
        """
        self.reduce_bucket(-1, tensors, weights)

    def reduce_bucket(self, bucket: int, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> int:
        """:meth:`all_reduce` of bucket ``bucket``; returns the bytes per device that crossed the transport.

        :raises TypeError: or :class:`ValueError` or :class:`~gsync.GsyncError`, as :meth:`all_reduce`
            (the sync server reports the first two as :class:`~gsync.SyncFailed`, the hook's error chained).
        """
        if len(tensors) != len(weights):
            raise GsyncError(f"expected one weight per tensor, got {len(tensors)} tensors and {len(weights)} weights")
        hook = self.hook
        payloads = []
        for device, (tensor, weight) in enumerate(zip(tensors, weights)):
            # Weighted in the bucket's dtype, before any rounding to the payload's.
            if weight == 0:
                tensor.zero_()  # an empty shard's buffer may hold anything, even inf
            elif weight != 1:
                tensor.mul_(weight)
            payload = hook.compress(bucket, device, tensor)
            if not isinstance(payload, torch.Tensor):
                raise TypeError(
                    f"{type(hook).__name__}.compress returned {type(payload).__name__}, not a tensor "
                    f"(bucket {bucket}, device {device})"
                )
            payloads.append(payload)
        _check_payloads(hook, bucket, payloads)
        # The weights are in the payloads; the transport sums them as they are, leaving out empty shards.
        unit = [0.0 if weight == 0 else 1.0 for weight in weights]
        moved = 0

        def all_reduce(parts: Sequence[torch.Tensor]) -> None:
            nonlocal moved
            _check_payloads(hook, bucket, parts)
            self.inner.all_reduce(parts, unit)
            moved += parts[0].numel() * parts[0].element_size()

        hook.reduce(bucket, payloads, all_reduce)
        for device, (payload, tensor) in enumerate(zip(payloads, tensors)):
            hook.decompress(bucket, device, payload, tensor)
        return moved

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        self.inner.broadcast(tensors)

    def close(self) -> None:
        self.inner.close()


def _check_payloads(hook: CompressionHook, bucket: int, payloads: Sequence[torch.Tensor]) -> None:
    first = payloads[0]
    for device, payload in enumerate(payloads):
        if payload.dtype != first.dtype or payload.numel() != first.numel():
            raise ValueError(
                f"{type(hook).__name__} gave device {device} a {payload.dtype} payload of {payload.numel()} elements "
                f"and device 0 a {first.dtype} one of {first.numel()} (bucket {bucket}): every device must bring "
                "the same payload layout"
            )
