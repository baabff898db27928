from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from plain_loop import train_steps
from torch import nn

import gsync
from gsync_pytest import gsync_threads  # noqa: F401 - tests import it from here

# gsync's own plugin (the one users get through its pytest11 entry point) checks every test of this suite for
# threads and tasks left running, and gives tests gsync_engine and gsync_faults. Named here too, so the suite has
# it without the entry point as well (the same name: loaded once either way).
pytest_plugins = ("gsync_pytest",)


@pytest.fixture
def no_leaks() -> None:
    """The plugin's leak check runs for every test; tests that name this fixture say so out loud."""


def assert_no_tasks_left() -> None:
    current = asyncio.current_task()
    assert {t for t in asyncio.all_tasks() if t is not current} == set()


class TiedNet(nn.Module):
    """A tied weight (two modules share one Parameter), a frozen module, a module
    that is never used, and one used only for some rows (so on some shards only)."""

    def __init__(self, d_in: int = 12, hidden: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.first = nn.Linear(hidden, hidden)
        self.second = nn.Linear(hidden, hidden)
        self.second.weight = self.first.weight
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.never_used = nn.Linear(hidden, hidden)
        self.rare = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.first(h)) + self.frozen(h)
        h = torch.tanh(self.second(h))
        mask = x[:, 0] > 1.2
        if bool(mask.any()):
            h = h.clone()
            h[mask] = h[mask] + self.rare(h[mask])
        return self.head(h)


class Normed(nn.Module):
    """Parameters and BatchNorm buffers: buffers must be broadcast, and checkpoints must get both right."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class Deep(nn.Module):
    """A stack of Linear layers: enough parameters for several buckets at small bucket sizes."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def make_batches(steps: int, rows: int, d_in: int = 12, classes: int = 5, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, d_in, generator=generator), torch.randint(0, classes, (rows,), generator=generator))
        for _ in range(steps)
    ]


def classification_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def train_reference(
    model: nn.Module,
    batches: Sequence[Any],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = sgd,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = classification_loss,
) -> tuple[nn.Module, list[float]]:
    """Plain one-device full-batch training: the result gsync must reproduce."""
    model = copy.deepcopy(model)
    losses = train_steps(model, optimizer([p for p in model.parameters() if p.requires_grad]), batches, loss_fn)
    return model, losses


def assert_same_state(actual: nn.Module, expected: nn.Module, atol: float = 2e-5) -> None:
    expected_state = expected.state_dict()
    for name, value in actual.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


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
