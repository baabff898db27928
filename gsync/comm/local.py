"""In-process reduction across the devices of one process.

On CPU, "devices" share one address space, so an all-reduce is arithmetic on
the bucket buffers: one fused pass to form the weighted sum in the first
buffer, one copy back to each other buffer. It runs in gsync's communication
thread, so the event loop never waits on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ("LocalCollective",)


class LocalCollective:
    def __init__(self, num_devices: int) -> None:
        self._num_devices = num_devices

    @property
    def world_devices(self) -> int:
        return self._num_devices

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        first = tensors[0]
        others = tensors[1:]
        # A zero-weight device (an empty shard) is left out rather than
        # multiplied by zero, so whatever its buffer holds (even inf) cannot
        # turn the sum into NaN.
        terms = [(tensor, weight) for tensor, weight in zip(tensors, weights) if weight != 0.0]
        if len(terms) == 1 and terms[0][0] is first and terms[0][1] == 1.0:
            pass  # one device with all the rows: the sum is already in place
        elif len(terms) == 2 and terms[0][0] is first and abs(terms[0][1] + terms[1][1] - 1.0) < 1e-12:
            # w0*a + w1*b == a + w1*(b - a) when the weights sum to one: one fused pass.
            first.lerp_(terms[1][0].to(first.device, non_blocking=True), terms[1][1])
        elif not terms:
            first.zero_()
        else:
            (lead, lead_weight), rest = terms[0], terms[1:]
            torch.mul(lead.to(first.device, non_blocking=True), lead_weight, out=first)
            for tensor, weight in rest:
                first.add_(tensor.to(first.device, non_blocking=True), alpha=weight)
        for tensor in others:
            tensor.copy_(first, non_blocking=True)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors[1:]:
            tensor.copy_(tensors[0], non_blocking=True)

    def close(self) -> None:
        pass
