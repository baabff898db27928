"""Callbacks and autograd stand-ins that hold a run at a chosen point, or break it there, so a test can observe what
happens."""

from __future__ import annotations

import math
import threading
from typing import Any

import anyio
import torch

import gsync


class CancelAfterStep:
    """A callback that cancels ``scope`` as step ``step`` ends (as ``anyio.move_on_after`` would, from outside)."""

    def __init__(self, scope: anyio.CancelScope, step: int) -> None:
        self.scope, self.step = scope, step

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        if result.step == self.step:
            self.scope.cancel()


class BackwardGate:
    """Holds backward where a model calls :meth:`hold`, at ``step``, until that step's first ``reductions``
    bucket reductions are done: a test that sees them done knows they ran while backward was still running.

    Pass :attr:`trace` to an engine with ``device_threads="per_device"`` (on a shared thread the held backward
    would wait for a device that cannot run). Steps are counted per thread (each device's backward runs in that
    device's own thread, step after step), so hold at a step after the first, whose devices run in turn. Until
    :attr:`armed` is set, :meth:`hold` lets backward through (a reference run of the same model).
    """

    def __init__(self, step: int, reductions: int, timeout: float = 10.0) -> None:
        self.step, self.reductions, self.timeout = step, reductions, timeout
        self.armed = False
        self._done = threading.Condition()
        self._reduced = 0
        self._steps_in_thread = threading.local()
        gate = self

        class CountingTrace(gsync.Trace):
            def record(self, event: gsync.TraceEvent) -> None:
                super().record(event)
                if event.name == "all_reduce" and event.step == gate.step:
                    with gate._done:
                        gate._reduced += 1
                        gate._done.notify_all()

        self.trace = CountingTrace()

    def hold(self, x: torch.Tensor) -> torch.Tensor:
        return _Held.apply(x, self)  # type: ignore[no-any-return]

    def _wait(self) -> None:
        if not self.armed:
            return
        step = self._steps_in_thread.__dict__.setdefault("count", 0)
        self._steps_in_thread.count += 1
        if step != self.step:
            return
        with self._done:
            if not self._done.wait_for(lambda: self._reduced >= self.reductions, timeout=self.timeout):
                raise AssertionError(
                    f"{self._reduced} of the first {self.reductions} reductions of step {self.step} were done "
                    "while backward was running"
                )


class _Held(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: BackwardGate) -> torch.Tensor:
        ctx.gate = gate
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gate._wait()
        return grad, None


class InfGradOnMarkedRows(torch.autograd.Function):
    """Identity forward; backward gives +inf gradients when the shard holds a marked row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marked: bool) -> torch.Tensor:
        ctx.marked = marked
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (torch.full_like(grad, math.inf) if ctx.marked else grad), None
