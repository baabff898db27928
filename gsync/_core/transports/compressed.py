"""Compression over a transport: ``Engine(compression=...)`` parsed into a hook, and the collective that reduces
through it (see :mod:`gsync.comm.compressed` for the hook's four steps)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...comm.base import Collective
from ...comm.compressed import CompressionHook, LowPrecision
from ...errors import ConfigError, GsyncError
from ...comm._capabilities import PER_BUCKET

__all__ = ("CompressedCollective", "resolve_compression")


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

    ``all_reduce`` runs the four steps of :mod:`gsync.comm.compressed`'s docstring;
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

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """The compressed :meth:`all_reduce`, which leaves every shard reduced, the own one included.

        A hook sees and keeps state for whole buckets (its error feedback, its payload layout), so the
        shards are not compressed apart: the bytes moved are an all-reduce's, as unsharded, and the
        sharded optimizer reads its own shard of the result.
        """
        self.reduce_bucket(-1, tensors, weights)

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        """Passed through uncompressed: the updated parameters travel exactly, as :meth:`broadcast`'s buffers do."""
        self.inner.all_gather(tensors)

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
