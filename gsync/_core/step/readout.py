"""A step's scalars (its losses, its gradient norm), read on the host without stalling the device.

``loss.item()`` right after forward is a host synchronization on CUDA: the
worker thread waits for the forward kernels to finish before it can launch
backward, and the GPU idles while the host catches up. Instead each value is
copied, behind the kernels that compute it on the same stream, into a pinned
host slot with an event recorded after it; the values are read once the work
that should overlap them is launched (a step's backward passes, the
optimizer step), waiting (if at all) only for what computes them. On CPU the
values are read directly: there is nothing to overlap.

The wait polls the event (:func:`~gsync._core.streams.cuda.wait_on_host`) against
the run's abort flag: a stream stuck behind a collective a dead peer never
completes would hold ``Event.synchronize`` forever.
"""

from __future__ import annotations

import threading

import torch

from ...errors import GsyncError
from ..streams.cuda import wait_on_host

__all__ = ("LossReadout", "ScalarReadout")


class LossReadout:
    """The losses of one device's forward passes in one step, each with its weight in the step's mean.

    ``abort``: the run's abort flag; :meth:`read` leaves with
    :class:`~gsync._core.threads.FitAborted` once it is set.
    """

    def __init__(self, device: torch.device, abort: threading.Event | None = None) -> None:
        self._cuda = device.type == "cuda"
        self._abort = abort
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
        """``(loss, weight)`` of every forward pass of the step, in order; waits only for the forward passes.

        :raises ~gsync._core.threads.FitAborted: when the abort flag is set while waiting.
        """
        values = []
        for index, (value, weight) in enumerate(self._pending):
            if self._cuda:
                wait_on_host(self._events[index], self._abort)
            values.append((float(value), weight))
        return values


class ScalarReadout:
    """One scalar per step read back the same way (the clipped gradient's norm): :meth:`put`, then :meth:`get`.

    Put it as soon as it is computed, launch what may overlap the copy (the
    optimizer step), then get it. One pinned slot and one event, reused each
    step: a step gets its value before the next puts one.
    """

    def __init__(self, device: torch.device, abort: threading.Event | None = None) -> None:
        self._cuda = device.type == "cuda"
        self._abort = abort
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._value: torch.Tensor | None = None

    def put(self, value: torch.Tensor) -> None:
        """Queue ``value`` (a one-element tensor) for reading, on the current stream."""
        detached = value.detach()
        if not self._cuda:
            self._value = detached
            return
        if self._pinned is None or self._pinned.dtype != detached.dtype:
            # In the value's own dtype: a copy that also converts would stage through a temporary.
            self._pinned = torch.empty((), dtype=detached.dtype, pin_memory=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._pinned.copy_(detached.reshape(()), non_blocking=True)
        self._event.record()
        self._value = self._pinned

    def get(self) -> float:
        """The value last put, waiting only for the kernels queued before it.

        :raises ~gsync.GsyncError: (a bug in the caller) when nothing was put since the last :meth:`get`.
        :raises ~gsync._core.threads.FitAborted: when the abort flag is set while waiting.
        """
        value = self._value
        if value is None:
            raise GsyncError("ScalarReadout.get() without a put() since the last get()")
        if self._cuda and self._event is not None:
            wait_on_host(self._event, self._abort)
        self._value = None
        return float(value)
