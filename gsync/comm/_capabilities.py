"""The operations behind a :class:`~gsync.Collective`'s capabilities, for the type checker.

A transport says what it can do in ``Collective.capabilities``
(:data:`IN_PLACE`, :data:`PER_BUCKET`);
the server and the assembly choose a path by asking, then call the
operation through these protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ("IN_PLACE", "PER_BUCKET", "ReducesBuckets", "ReducesInPlace")

IN_PLACE = "in_place"
"""Capability: ``all_reduce_each(tensors, weights)`` reduces several tensors per device where they lie
(``tensors[i][k]`` is device ``i``'s ``k``-th tensor), so gradients need no copy into a bucket buffer first."""
PER_BUCKET = "per_bucket"
"""Capability: ``reduce_bucket(bucket, tensors, weights)`` is :meth:`Collective.all_reduce` of bucket ``bucket``
(a compression hook keeps state per bucket), returning the bytes per device that crossed the transport."""


class ReducesInPlace(Protocol):
    """Reduces several tensors per device where they are: ``tensors[i][k]`` is device ``i``'s ``k``-th tensor."""

    def all_reduce_each(self, tensors: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> None: ...


class ReducesBuckets(Protocol):
    """Reduces a bucket by its index (compression keeps state per bucket) and returns the bytes it moved per device."""

    def reduce_bucket(self, bucket: int, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> int: ...
