"""Callbacks and autograd stand-ins that hold a run at a chosen point, so a test can observe what happens there."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch

import gsync
from gsync._core.threads import FitAborted

if TYPE_CHECKING:
    from gsync._core.step.sharding import ShardedStep

_GATE_S = 60.0  # a bound on a gather gate's own waits, far beyond a test's: they end on a signal, not on it


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


class GatherGate:
    """The sharded step's collective, whose all-gather of ``bucket`` (the next one once :meth:`arm` ed, every one
    with ``always``) waits until a reader of the replicas waits for that bucket (``"open"``), fails (``"fail"``),
    waits for the session's abort flag (``"abort"``), as a collective over a lost peer does, or ends the process
    (``"exit"``: a rank lost mid-gather).

    It wraps ``sharding``'s collective and the waits that tell it a reader waits (:meth:`ShardedStep._block`,
    :meth:`ShardedStep.whole`); :attr:`events` records ``"reader waits"`` and ``"gathered"`` (the gated bucket let
    through) in order, and a test's own hooks may add to it.
    """

    def __init__(
        self,
        sharding: ShardedStep,
        bucket: int,
        mode: Literal["open", "fail", "abort", "exit"] = "open",
        always: bool = False,
    ) -> None:
        self.inner = sharding._collective
        self.sharding = sharding
        self.bucket = bucket
        self.mode = mode
        self.position = sharding.gather_order.index(bucket)
        self.per_gather = len(sharding.gather_order)
        self.calls = 0
        self.armed = False
        self.always = always
        self.reader_waits = threading.Event()
        self.events: list[str] = []
        sharding._collective = self  # type: ignore[assignment]
        block, whole = sharding._block, sharding.whole

        def blocking(buckets: Sequence[int]) -> None:
            if bucket in buckets:
                self.events.append("reader waits")
                self.reader_waits.set()
            block(buckets)

        async def awaiting() -> None:
            if not sharding.ready([bucket]):
                self.events.append("reader waits")
                self.reader_waits.set()
            await whole()

        sharding._block = blocking  # type: ignore[method-assign]
        sharding.whole = awaiting  # type: ignore[method-assign]

    def arm(self) -> None:
        self.reader_waits.clear()
        self.armed = True

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        position, self.calls = self.calls % self.per_gather, self.calls + 1
        if position == self.position and (self.armed or self.always):
            self.armed = False
            if self.mode == "fail":
                raise RuntimeError("the gate's all-gather failed")
            if self.mode == "exit":
                os._exit(3)
            if self.mode == "abort":
                assert self.sharding._abort.wait(_GATE_S), "the session never aborted"
                raise FitAborted
            assert self.reader_waits.wait(_GATE_S), "nothing waited for the gated bucket"
            self.reader_waits.clear()
            self.events.append("gathered")
        self.inner.all_gather(tensors)  # type: ignore[union-attr]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def bucket_of(sharding: ShardedStep, name: str) -> int:
    """The bucket of the parameter named ``name`` (under a compiled model's ``_orig_mod.`` too)."""
    names = sharding.plan.names
    return sharding.plan.bucket_of[next(i for i, n in enumerate(names) if n == name or n.endswith("." + name))]
