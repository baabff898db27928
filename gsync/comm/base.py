"""The one protocol every gradient transport implements.

Keeping it to a few operations is deliberate: each implementation (in-process
CPU, NCCL, torch.distributed) implements all of it and passes the same
conformance cases (``tests/unit/comm/test_conformance.py``, run in-process, on
CUDA devices and across processes), so no backend can leave an operation out.
What a transport can do beyond them it says in :attr:`Collective.capabilities`,
so that gsync picks a path by asking, not by its class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ("Collective",)


@runtime_checkable
class Collective(Protocol):
    """Moves gradient bytes between the local devices (and, for some, other processes).

    Methods are called from gsync's communication thread, never from the
    event loop, one call at a time, in the same order on every process.
    ``tensors[i]`` always belongs to local device ``i``. On CPU a call's
    result is in place when it returns; on CUDA it is ordered on each
    device's communication stream when it returns (see :mod:`gsync._core.streams`).
    A device whose weight is zero is left out of the sum, whatever its
    tensor holds.
    """

    @property
    def world_devices(self) -> int:
        """The number of devices across all processes."""
        ...

    @property
    def capabilities(self) -> frozenset[str]:
        """What it can do beyond this protocol's operations; empty for a transport that only all-reduces and
        broadcasts flat tensors.

        - ``"in_place"``: ``all_reduce_each(tensors, weights)`` reduces several tensors per device where they lie
          (``tensors[i][k]`` is device ``i``'s ``k``-th tensor), so gradients need no copy into a bucket first.
        - ``"per_bucket"``: ``reduce_bucket(bucket, tensors, weights)`` is :meth:`all_reduce` of bucket
          ``bucket`` (a compression hook keeps state per bucket) and returns the bytes per device that crossed
          the transport.
        """
        ...

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Replace every tensor with the weighted sum over all devices, in place.

        ``weights[i]`` is local device ``i``'s weight; devices of other
        processes bring their own. Each term is scaled before summing, so
        low-precision buffers do not overflow.
        """
        ...

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite every tensor with the first device's (global device 0), in place."""
        ...

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Give each device the weighted sum of its own shard of the buffer, in place (``shard_optimizer=True``).

        ``tensors[i]`` is local device ``i``'s whole buffer; its shard is range ``shard_bounds(numel,
        world_devices)[g]`` of it, ``g`` its global device index (one split for every transport: see
        :mod:`gsync.comm._shards`). Afterwards that range holds the weighted sum over all
        devices of the same range, weighted and with zero-weight devices left out as in :meth:`all_reduce`;
        the rest of the buffer is unspecified (a transport may leave it or reduce it too).
        """
        ...

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give every device every shard, in place: afterwards each buffer holds, in each device's shard range
        (as :meth:`reduce_scatter` splits it), that device's values, so all buffers are equal."""
        ...

    def close(self) -> None:
        """Release what this collective created. Idempotent."""
        ...
