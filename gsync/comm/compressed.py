"""Gradient compression: a hook that every transport goes through the same way.

With ``Engine(compression=...)``, gsync wraps whichever :class:`~gsync.Collective`
the run uses (in-process CPU, NCCL, a ``torch.distributed`` group) so that a
bucket's reduction becomes, per local device ``i`` in device order:

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

from ..errors import ConfigError

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
