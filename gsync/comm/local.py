"""In-process reduction across the devices of one process.

On CPU, "devices" share one address space, so an all-reduce is arithmetic:
the weighted sum formed in the first device's tensors (one fused pass for
two devices), then copied to each other device's. It runs in gsync's
communication thread, so the event loop never waits on it.

Besides the :class:`~gsync.Collective` protocol's flat buffers, it reduces
a bucket as each device's list of gradient tensors
(:meth:`LocalCollective.all_reduce_each`): the devices' gradients can then
stay where autograd put them, instead of being copied into bucket buffers
first, a pass over every gradient per device and step that only a
transport needing contiguous bytes must pay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._capabilities import IN_PLACE
from ._shards import shard_bounds

__all__ = ("LocalCollective",)


class LocalCollective:
    """The :class:`~gsync.Collective` of ``num_devices`` devices in this process: arithmetic in place, no transport."""

    def __init__(self, num_devices: int) -> None:
        self._num_devices = num_devices

    @property
    def world_devices(self) -> int:
        return self._num_devices

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({IN_PLACE})

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        self.all_reduce_each([[tensor] for tensor in tensors], weights)

    def all_reduce_each(self, tensors: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> None:
        """:meth:`all_reduce` of several tensors at once: ``tensors[i][k]`` is device ``i``'s ``k``-th tensor.

        Every device lists tensors of the same shapes and dtypes in the same
        order; each position is reduced on its own, with the same elementwise
        operations as one flat buffer holding them all (results agree to within
        a rounding: torch's vectorized and scalar kernels, which see different
        elements here than in a flat buffer, may round differently).
        """
        first = list(tensors[0])
        _weighted_sum_into(first, tensors, weights)
        for device in tensors[1:]:
            torch._foreach_copy_(list(device), first)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors[1:]:
            tensor.copy_(tensors[0], non_blocking=True)

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Each device's shard of its buffer becomes the weighted sum of that shard over every device.

        Each shard is summed once, by the same arithmetic as :meth:`all_reduce_each` (so a sharded run
        reduces exactly as an unsharded one): straight into its owner's buffer for two devices (one fused
        pass) and for device 0's shard; otherwise into a fresh tensor the size of one shard, then copied
        into its owner's buffer, whose own term must not be overwritten before the sum has read it. The
        rest of each buffer is left as it was.
        """
        bounds = shard_bounds(tensors[0].numel(), len(tensors))
        terms = [index for index, weight in enumerate(weights) if weight != 0.0]
        for owner, (start, stop) in enumerate(bounds):
            if start == stop:
                continue
            parts = [tensor.view(-1)[start:stop] for tensor in tensors]
            if len(terms) == 2 and terms[0] == 0 and abs(weights[0] + weights[terms[1]] - 1.0) < 1e-12:
                # all_reduce_each's fused pass, written straight into the owner's shard (an elementwise
                # operation may write where it reads).
                torch.lerp(parts[0], parts[terms[1]], weights[terms[1]], out=parts[owner])
                continue
            if owner == 0:
                result = [parts[0]]  # the sum forms in device 0's tensor, as all_reduce_each's does
            else:
                result = [parts[0].clone()]
            _weighted_sum_into(result, [result] + [[part] for part in parts[1:]], weights)
            if owner != 0:
                parts[owner].copy_(result[0])

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every buffer gets every owner's shard: ``devices - 1`` shard copies into each buffer, one bucket's bytes."""
        bounds = shard_bounds(tensors[0].numel(), len(tensors))
        flats = [tensor.view(-1) for tensor in tensors]
        for owner, (start, stop) in enumerate(bounds):
            if start == stop:
                continue
            source = flats[owner][start:stop]
            for device, flat in enumerate(flats):
                if device != owner:
                    flat[start:stop].copy_(source)

    def close(self) -> None:
        pass


def _weighted_sum_into(first: list[torch.Tensor], tensors: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> None:
    """``first`` (device 0's tensors, or a copy of them) becomes the weighted sum of every device's, position by
    position; the other devices' tensors are only read."""
    # A zero-weight device (an empty shard) is left out rather than
    # multiplied by zero, so whatever its tensors hold (even inf) cannot
    # turn the sum into NaN.
    terms = [index for index, weight in enumerate(weights) if weight != 0.0]
    if not terms:
        torch._foreach_zero_(first)
    elif terms == [0] and weights[0] == 1.0:
        pass  # one device with all the rows: the sum is already in place
    elif len(terms) == 2 and terms[0] == 0 and abs(weights[0] + weights[terms[1]] - 1.0) < 1e-12:
        # w0*a + w1*b == a + w1*(b - a) when the weights sum to one: one fused pass.
        torch._foreach_lerp_(first, list(tensors[terms[1]]), weights[terms[1]])
    else:
        lead, rest = terms[0], terms[1:]
        if lead != 0:
            torch._foreach_copy_(first, list(tensors[lead]))
        torch._foreach_mul_(first, weights[lead])
        for index in rest:
            torch._foreach_add_(first, list(tensors[index]), alpha=weights[index])
