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
        if len(others) == 1 and abs(weights[0] + weights[1] - 1.0) < 1e-12:
            # w0*a + w1*b == a + w1*(b - a) when the weights sum to one: one fused pass.
            first.lerp_(others[0].to(first.device, non_blocking=True), weights[1])
        else:
            first.mul_(weights[0])
            for tensor, weight in zip(others, weights[1:]):
                first.add_(tensor.to(first.device, non_blocking=True), alpha=weight)
        for tensor in others:
            tensor.copy_(first, non_blocking=True)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors[1:]:
            tensor.copy_(tensors[0], non_blocking=True)

    def close(self) -> None:
        pass
