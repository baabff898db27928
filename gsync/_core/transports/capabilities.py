"""What a :class:`~gsync.Collective` can do beyond the protocol, asked of it rather than read off its class.

The server and the assembly choose a path by capability: a transport that
reduces tensors where they lie (no bucket copy) or that reports the bytes it
moved for a bucket says so by having the method, whichever class it is; a
user's own collective gets the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ("ReducesBuckets", "ReducesInPlace")


@runtime_checkable
class ReducesInPlace(Protocol):
    """Reduces several tensors per device where they are: ``tensors[i][k]`` is device ``i``'s ``k``-th tensor."""

    def all_reduce_each(self, tensors: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> None: ...


@runtime_checkable
class ReducesBuckets(Protocol):
    """Reduces a bucket by its index (compression keeps state per bucket) and returns the bytes it moved per device."""

    def reduce_bucket(self, bucket: int, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> int: ...
