"""A step's losses, read on the host without stalling the device between forward and backward.

``loss.item()`` right after forward is a host synchronization on CUDA: the
worker thread waits for the forward kernels to finish before it can launch
backward, and the GPU idles while the host catches up. Instead each loss is
copied, behind its forward pass on the same stream, into a pinned host slot
with an event recorded after it; the values are read once the step's
backward passes are launched, waiting (if at all) only for the forward
passes. On CPU the values are read directly: there is nothing to overlap.
"""

from __future__ import annotations

import torch

__all__ = ("LossReadout",)


class LossReadout:
    """The losses of one device's forward passes in one step, each with its weight in the step's mean."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pinned = torch.empty(0, dtype=torch.float32)
        self._events: list[torch.cuda.Event] = []
        self._pending: list[tuple[torch.Tensor, float]] = []

    def start(self, batches: int) -> None:
        """Begin a step of up to ``batches`` forward passes (grows the host slots while none is in flight)."""
        self._pending = []
        if self._cuda and self._pinned.numel() < batches:
            self._pinned = torch.empty(batches, dtype=torch.float32, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(batches)]

    def add(self, loss: torch.Tensor, weight: float) -> None:
        """Queue ``loss`` (a scalar) for reading; call on the stream its forward pass ran on."""
        detached = loss.detach()
        if not self._cuda:
            self._pending.append((detached, weight))
            return
        index = len(self._pending)
        slot = self._pinned[index]
        slot.copy_(detached.reshape(()), non_blocking=True)
        self._events[index].record()
        self._pending.append((slot, weight))

    def read(self) -> list[tuple[float, float]]:
        """``(loss, weight)`` of every forward pass of the step, in order; waits only for the forward passes."""
        values = []
        for index, (value, weight) in enumerate(self._pending):
            if self._cuda:
                self._events[index].synchronize()
            values.append((float(value), weight))
        return values
