"""The call gate running operations, with a fake life and peer link: what it checks, counts, and fails.

The gate is what every step, evaluate and all_reduce goes through, so its rules are stated here on their own,
without a session's workers behind them: an operation's input is refused before the session is asked; a call the
lifecycle cannot take is refused with a reason; one that runs is counted once and leaves the session idle; one
that fails fails the session with its own error; what an operation's result means is its own (``delivered``),
not the gate's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
import torch

import gsync
from gsync._core.distributed.runtime import ProcessGroupRuntime
from gsync._core.session.calls import CallGate
from gsync._core.session.lifecycle import SessionLife
from gsync._core.session.operations import AllReduce, Evaluate
from gsync._core.session.peers import PeerLink
from gsync._core.session.state import Lifecycle, SessionState
from gsync._core.step.actor import DeviceActor
from gsync._core.threads import LoopHandle
from gsync.types import MetricFn


class FakeLife:
    """The part of a generation's life the gate asks: its lifecycle (the real one), its failure, its calls."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle()
        self.lifecycle.move(SessionState.IDLE)
        self.failure: BaseException | None = None
        self.calls_begun = 0

    @property
    def state(self) -> SessionState:
        return self.lifecycle.state

    @property
    def failing(self) -> bool:
        return self.state in (SessionState.FAILING, SessionState.FAILED)

    async def settled(self) -> None:
        pass

    def take_undelivered(self) -> BaseException | None:
        return None

    def begin_call(self, cancel: Callable[[], bool]) -> None:
        self.lifecycle.move(SessionState.OPERATING)
        self.calls_begun += 1

    def end_call(self) -> None:
        self.lifecycle.operation_over()

    def fail(self, error: BaseException) -> BaseException:
        self.lifecycle.end_asked()
        if self.failure is None:
            self.failure = error
        return error

    def cancelled(self, cancellation: BaseException) -> None:
        self.fail(gsync.SessionClosed("cancelled"))


class FakePeers:
    """One process: no peer has left, nobody to blame."""

    def departed_before(self, operations_done: int) -> None:
        return None

    def waiting(self, what: str | None) -> None:
        pass


class Site:
    """A one-process session as an operation sees it, without devices: nothing to evaluate locally."""

    runtime: ProcessGroupRuntime | None = None
    world_size = 1
    last_step = 4

    def __init__(self) -> None:
        self.loop = LoopHandle()

    def devices(self) -> Sequence[DeviceActor]:
        return []

    def loop_handle(self) -> LoopHandle:
        return self.loop

    def split_one(self, batch: Any, rows: int) -> tuple[list[int], list[Any]]:
        return [], []

    def first_calls_in_turn(self) -> bool:
        return False

    def loss_fn(self) -> MetricFn:
        return lambda model, shard: 0.0

    async def collective(self, job: Callable[[], Any], what: str) -> Any:
        return job()


class Failing:
    """An operation whose collective part fails (a transport's error, as gsync raises it)."""

    what = "all_reduce"
    kind = "all_reduce(op='sum')"
    redoable = True
    input_first = True

    async def run(self, site: Site) -> float:
        raise gsync.SyncFailed(site.last_step, None, site="all_reduce")

    def check(self) -> None:
        pass

    def delivered(self, result: float) -> float:
        return result


class Steady:
    """A session between no generations: four steps applied."""

    changing = False
    last_step = 4


def gate(life: FakeLife) -> CallGate:
    return CallGate(cast(SessionLife, life), cast(PeerLink, FakePeers()), threading.Event(), 10.0, Steady())


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_an_operation_runs_once_counted_and_leaves_the_session_idle() -> None:
    life = FakeLife()
    calls = gate(life)
    operation = AllReduce(torch.tensor([1.0, 2.0]), "mean")
    result = await calls.run(operation, Site())
    assert torch.equal(operation.delivered(result), torch.tensor([1.0, 2.0]))
    assert (calls.done, life.calls_begun, life.state, life.failure) == (1, 1, SessionState.IDLE, None)


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_each_operation_says_whether_its_input_or_the_session_is_checked_first() -> None:
    life = FakeLife()
    life.lifecycle.move(SessionState.CLOSING)
    calls = gate(life)
    # all_reduce's input is refused as it is, whatever the session's state.
    with pytest.raises(gsync.ConfigError, match="op must be"):
        await calls.run(AllReduce(1.0, "median"), Site())  # type: ignore[arg-type]
    # evaluate asks the session first: a failure settled while no call ran is what it raises, with its checkpoint.
    with pytest.raises(gsync.SessionClosed, match="after the session was closed"):
        await calls.run(Evaluate([1], "loss", redoable=True), Site())  # type: ignore[arg-type]
    open_life = FakeLife()
    with pytest.raises(gsync.InputTypeError, match="metric_fn must be callable"):
        await gate(open_life).run(Evaluate([1], "loss", redoable=True), Site())  # type: ignore[arg-type]
    assert (calls.done, life.calls_begun, open_life.calls_begun) == (0, 0, 0)


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_a_call_the_lifecycle_cannot_take_is_refused_with_why() -> None:
    life = FakeLife()
    life.lifecycle.move(SessionState.OPERATING)
    with pytest.raises(gsync.ConfigError, match="a session does one thing at a time"):
        await gate(life).run(AllReduce(1, "sum"), Site())
    life.lifecycle.move(SessionState.CLOSING)
    with pytest.raises(gsync.SessionClosed, match="after the session was closed"):
        await gate(life).run(AllReduce(1, "sum"), Site())
    assert life.calls_begun == 0


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_an_operation_that_fails_fails_the_session_with_its_own_error_and_is_not_counted() -> None:
    life = FakeLife()
    calls = gate(life)
    with pytest.raises(gsync.SyncFailed) as raised:
        await calls.run(Failing(), Site())
    assert life.failure is raised.value
    assert (calls.done, life.state) == (0, SessionState.CLOSING)


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_what_a_result_means_is_the_operations_own_and_fails_nothing() -> None:
    # An evaluation that saw no rows is refused on every rank alike when its result is delivered: the ranks'
    # collectives all ran, so the session goes on.
    life = FakeLife()
    calls = gate(life)
    operation = Evaluate([], None, redoable=True)
    result = await calls.run(operation, Site())
    with pytest.raises(gsync.ConfigError, match="got no rows"):
        operation.delivered(result)
    assert (calls.done, life.state, life.failure) == (1, SessionState.IDLE, None)
