"""Held sessions: opened in one task, stepped, fitted and closed from others, as notebook cells and fixtures do."""

from __future__ import annotations

import asyncio
import copy
import gc
import threading
import warnings
from typing import Any

import anyio
import pytest
import torch

import gsync
from gsync._core.base.faults import MembershipBroken
import gsync.testing
from gsync_pytest import gsync_threads
from tests.support import inside
from tests.support.models import RECIPE, TWO, TiedNet, make_batches
from tests.support.reference import assert_same_state, step_lr, train_reference
from tests.support.tasks import assert_no_tasks_left


async def in_a_task(awaitable: Any) -> Any:
    """Await ``awaitable`` in a task of its own, as a notebook cell or a fixture's setup runs."""

    async def cell() -> Any:
        return await awaitable

    return await asyncio.get_running_loop().create_task(cell())


async def closed_by_itself(session: gsync.Session, timeout: float = 10.0) -> None:
    """Until the session has ended everything it started (it closes itself after a failure while idle)."""
    with anyio.fail_after(timeout):
        await inside.ended_event(session).wait()


@pytest.mark.asyncio
async def test_a_session_opened_stepped_and_closed_from_different_tasks_trains_as_a_plain_loop(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(4, 31)
    expected, expected_losses = train_reference(model, batches)
    before = copy.deepcopy(model)
    engine = gsync.Engine(TWO)

    session = await in_a_task(engine.session(model, **RECIPE))  # cell 1
    first = await in_a_task(session.step(batches[0]))  # cell 2
    second = await session.step(batches[1])  # cell 3
    rest = await in_a_task(session.fit(batches[2:], progress=False))  # cell 4
    assert_same_state(model, before, atol=0)  # nothing is written into the model until the close
    await in_a_task(session.aclose())  # cell 5
    await session.aclose()  # idempotent

    assert_same_state(model, expected)
    assert (first.step, second.step, rest.first_step) == (0, 1, 2)
    assert [first.loss, second.loss, *rest.losses] == pytest.approx(expected_losses, abs=2e-5)
    assert gsync_threads() == []
    assert_no_tasks_left()
    with pytest.raises(gsync.SessionClosed, match="after the session was closed"):
        await session.step(batches[0])


@pytest.mark.asyncio
async def test_two_fits_of_a_session_end_exactly_as_one_fit_of_two_epochs(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 19)
    recipe = dict(RECIPE, scheduler=step_lr, clip_grad_norm=0.5)
    one = await gsync.Engine(TWO).fit(copy.deepcopy(model), batches, epochs=2, accumulate=2, progress=False, **recipe)

    held = copy.deepcopy(model)
    session = await gsync.Engine(TWO).session(held, **recipe)
    first = await session.fit(batches, accumulate=2, progress=False)
    second = await session.fit(batches, accumulate=2, progress=False)
    assert session.next_step == 6
    await session.aclose()

    assert_same_state(held, one.model, atol=0)
    assert first.losses + second.losses == one.losses
    assert (first.first_step, second.first_step) == (0, 3)
    assert [r.step for r in second.history] == [3, 4, 5]
    assert [r.lr for r in first.history + second.history] == [r.lr for r in one.history]  # the schedule went on
    assert second.checkpoint is not None and second.checkpoint.step == 5


@pytest.mark.asyncio
async def test_session_model_holds_the_weights_of_the_last_step_and_leaves_the_model_passed_in() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(3, 16)
    after_one, _ = train_reference(model, batches[:1])
    after_three, _ = train_reference(model, batches)
    before = copy.deepcopy(model)
    session = await gsync.Engine(TWO).session(model, **RECIPE)
    try:
        await session.step(batches[0])
        current = session.model
        assert current is not model
        assert_same_state(current, after_one)
        assert_same_state(model, before, atol=0)

        # Read from another task while a step runs: as of the last read, then refreshed as the step is applied.
        step = asyncio.get_running_loop().create_task(session.step(batches[1]))
        while not inside.is_operating(session):
            await asyncio.sleep(0)
        assert_same_state(session.model, after_one)
        await step
        await session.step(batches[2])
        assert session.model is current  # one copy for the session's life, refreshed in place
        assert_same_state(current, after_three)
    finally:
        await session.aclose()
    assert_same_state(model, after_three)
    with pytest.raises(gsync.SessionClosed):
        session.model


@pytest.mark.asyncio
async def test_a_failure_while_no_call_runs_closes_the_session_at_once_and_the_next_call_raises_it(no_leaks: None) -> None:
    model = TiedNet()
    before = copy.deepcopy(model)
    session = await gsync.Engine(TWO).session(model, **RECIPE)
    await session.step(make_batches(1, 8)[0])
    inside.post_a_message_the_server_cannot_take(session)
    await closed_by_itself(session)
    assert gsync_threads() == []  # closed at once, though nothing called it
    assert session.closed

    with pytest.raises(gsync.SyncFailed, match="protocol error") as raised:
        await session.step(make_batches(1, 8)[0])
    assert raised.value.last_step == 0
    assert raised.value.checkpoint is not None and raised.value.checkpoint.step == 0
    with pytest.raises(gsync.SessionClosed, match="failed") as closed:
        await session.step(make_batches(1, 8)[0])
    assert closed.value.__cause__ is raised.value
    await session.aclose()  # the failure was raised already: the close is quiet
    assert_same_state(model, before, atol=0)


@pytest.mark.asyncio
async def test_a_failure_no_call_has_raised_is_raised_by_aclose_once(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    session = await engine.session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 8)[0])
    inside.post_a_message_the_server_cannot_take(session)
    await closed_by_itself(session)
    with pytest.raises(gsync.SyncFailed, match="protocol error") as raised:
        await session.aclose()
    assert raised.value.checkpoint is not None
    await session.aclose()
    await engine.aclose()
    reopened = await engine.session(TiedNet(), **RECIPE)  # the engine is free again
    await reopened.aclose()


@pytest.mark.asyncio
async def test_cancelling_a_call_closes_the_session_and_later_calls_raise_session_closed(no_leaks: None) -> None:
    model = TiedNet()
    before = copy.deepcopy(model)
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=1, step=1, site="backward")
    with gsync.testing.inject(engine, fault):
        session = await engine.session(model, **RECIPE)
        await session.step(make_batches(1, 8)[0])
        with anyio.move_on_after(0.2) as scope:
            await in_a_task(session.step(make_batches(1, 8)[0]))
        assert scope.cancelled_caught
        assert gsync_threads() == []  # stopped by the time the cancellation propagated
        with pytest.raises(gsync.SessionClosed, match="cancelled midway") as closed:
            await session.step(make_batches(1, 8)[0])
        assert closed.value.checkpoint is not None and closed.value.checkpoint.step == 0
        await session.aclose()
    assert_same_state(model, before, atol=0)
    async with engine.session(TiedNet(), **RECIPE) as again:
        await again.step(make_batches(1, 8)[0])


@pytest.mark.asyncio
async def test_a_second_open_names_the_first_and_engine_aclose_closes_it() -> None:
    engine = gsync.Engine(TWO)
    model = TiedNet()
    first = await engine.session(model, **RECIPE)
    await first.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.ConfigError, match=r"already has an open session \(opened at .*test_held_sessions.py:\d+\).*aclose"):
        await engine.session(TiedNet(), **RECIPE)
    with pytest.raises(gsync.ConfigError, match="already has an open session"):
        await engine.fit(TiedNet(), make_batches(1, 8), **RECIPE)
    assert not first.closed  # refusing the second left the first as it was
    await first.step(make_batches(1, 8)[0])
    trained = copy.deepcopy(first.model)
    await engine.aclose()
    assert first.closed and gsync_threads() == []
    assert_same_state(model, trained, atol=0)  # a clean close through the engine writes the weights too


@pytest.mark.asyncio
async def test_a_session_dropped_while_open_warns_where_it_was_opened_and_ends_its_threads(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    model = TiedNet()
    before = copy.deepcopy(model)
    session = await engine.session(model, **RECIPE)
    await session.step(make_batches(1, 8)[0])
    ended = inside.ended_event(session)
    with pytest.warns(gsync.SessionLeftOpenWarning, match=r"opened at .*test_held_sessions.py:\d+ was dropped while open"):
        del session
        gc.collect()
    with anyio.fail_after(10):
        await ended.wait()
    assert gsync_threads() == []
    assert_same_state(model, before, atol=0)  # never written into silently
    again = await engine.session(TiedNet(), **RECIPE)
    await again.aclose()


@pytest.mark.asyncio
async def test_a_closed_session_dropped_says_nothing() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.aclose()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del session
        gc.collect()


@pytest.mark.asyncio
async def test_a_session_is_used_from_the_thread_of_the_loop_that_opened_it() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    try:
        outcomes: list[BaseException] = []

        def from_a_thread() -> None:
            for call in (session.checkpoint, lambda: asyncio.run(session.step(make_batches(1, 8)[0]))):
                try:
                    call()
                except BaseException as error:  # noqa: BLE001 - the test reads it
                    outcomes.append(error)

        thread = threading.Thread(target=from_a_thread)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(error) for error in outcomes] == [gsync.ConfigError, gsync.ConfigError]
        assert all("another thread" in str(error) for error in outcomes)
        await session.step(make_batches(1, 8)[0])  # still open: a refused call changes nothing
    finally:
        await session.aclose()


def test_a_session_outliving_its_event_loop_says_so() -> None:
    async def open_one() -> gsync.Session:
        session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
        await session.step(make_batches(1, 8)[0])
        return session

    with pytest.warns(gsync.SessionLeftOpenWarning, match=r"opened at .*test_held_sessions.py:\d+ was still open when its task was cancelled"):
        session = asyncio.run(open_one())  # the loop's end cancels the session's task, and its threads stop
    assert gsync_threads() == []
    with pytest.raises(gsync.SessionClosed, match="event loop that opened this session has ended"):
        asyncio.run(session.step(make_batches(1, 8)[0]))


@pytest.mark.asyncio
async def test_with_instead_of_async_with_says_what_to_write() -> None:
    engine = gsync.Engine(TWO)
    with pytest.raises(gsync.ConfigError, match=r"async with engine.session\(...\) as session.*await engine.session"):
        with engine.session(TiedNet(), **RECIPE):  # type: ignore[attr-defined]
            pass
    async with engine.session(TiedNet(), **RECIPE) as session:  # nothing was opened by the refused one
        await session.step(make_batches(1, 8)[0])


@pytest.mark.asyncio
async def test_a_held_session_resumed_from_a_checkpoint_fits_on_as_the_uninterrupted_run(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 16)
    whole = await gsync.Engine(TWO).fit(copy.deepcopy(model), batches, epochs=2, progress=False, **RECIPE)
    engine = gsync.Engine(TWO)
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=8, site="backward")):
        with pytest.raises(gsync.WorkerFailed) as failed:
            await engine.fit(copy.deepcopy(model), batches, epochs=2, progress=False, **RECIPE)
    resumed = copy.deepcopy(model)
    session = await engine.session(resumed, resume=failed.value.checkpoint, **RECIPE)
    assert session.first_step == 8
    rest = await session.fit(batches, epochs=2, progress=False)  # replays up to step 7, trains 8..11
    await session.aclose()
    assert [r.step for r in rest.history] == [8, 9, 10, 11]
    assert_same_state(resumed, whole.model, atol=0)


@pytest.mark.asyncio
async def test_async_with_on_a_held_session_closes_it() -> None:
    model = TiedNet()
    async with await gsync.Engine(TWO).session(model, **RECIPE) as session:
        await session.step(make_batches(1, 8)[0])
        trained = copy.deepcopy(session.model)
    assert session.closed
    assert_same_state(model, trained, atol=0)


@pytest.mark.asyncio
async def test_a_fit_resumed_mid_epoch_replays_a_shuffled_loader_in_the_order_the_run_read_it(tmp_path: Any) -> None:
    # The replay's iter(data) must draw from the generators as the interrupted run's did; the checkpoint's
    # generators (a file's carry them) take over only at the step the checkpoint continues from.
    dataset = torch.utils.data.TensorDataset(*make_batches(1, 96)[0])

    def loader() -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)  # the global generator shuffles

    model = TiedNet()
    torch.manual_seed(0)
    whole = await gsync.Engine(TWO).fit(copy.deepcopy(model), loader(), epochs=2, progress=False, **RECIPE)
    engine = gsync.Engine(TWO)
    files = dict(checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    torch.manual_seed(0)
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=8, site="backward")):  # epoch 1, mid-way
        with pytest.raises(gsync.WorkerFailed):
            await engine.fit(copy.deepcopy(model), loader(), epochs=2, **files, **RECIPE)
    torch.manual_seed(0)  # a restarted script seeds as the first run did
    resumed = await engine.fit(copy.deepcopy(model), loader(), epochs=2, resume=tmp_path, **files, **RECIPE)
    assert resumed.first_step == 8
    assert resumed.losses == whole.losses[8:]
    assert_same_state(resumed.model, whole.model, atol=0)


class SlowToCopy(TiedNet):
    """A model whose copy for each device waits until released: the session is still opening meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.copying = threading.Event()
        self.release = threading.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self.copying.set()
        self.release.wait(10)
        plain = TiedNet()
        plain.load_state_dict(self.state_dict())
        return plain


@pytest.mark.asyncio
async def test_engine_aclose_while_a_session_opens_abandons_the_open(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    model = SlowToCopy()
    opening = asyncio.get_running_loop().create_task(in_a_task(engine.session(model, **RECIPE)))
    await anyio.to_thread.run_sync(model.copying.wait, 10)
    closing = asyncio.get_running_loop().create_task(engine.aclose())
    await asyncio.sleep(0)  # the close is asked for while the copy still runs
    model.release.set()
    with anyio.fail_after(10):
        await closing  # returns, though the session never opened
        with pytest.raises(gsync.SessionClosed, match="closed .* while it opened"):
            await opening
    assert gsync_threads() == []
    again = await engine.session(TiedNet(), **RECIPE)  # the engine is free
    await again.aclose()


@pytest.mark.asyncio
async def test_a_fit_is_one_call_another_task_cannot_step_beside_it(no_leaks: None) -> None:
    model = TiedNet()
    before = copy.deepcopy(model)
    session = await gsync.Engine(TWO).session(model, **RECIPE)
    refused: list[BaseException] = []
    fitting = asyncio.Event()

    class Midway:
        async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            if result.step == 1:
                fitting.set()
                await session.evaluate(make_batches(1, 8))  # the fit's own callbacks may use the session

    async def step_beside() -> None:
        await fitting.wait()
        try:
            await session.step(make_batches(1, 8)[0])
        except gsync.ConfigError as error:
            refused.append(error)
        await session.aclose()  # from another task: ends the fit, and writes nothing into the model

    beside = asyncio.get_running_loop().create_task(step_beside())
    with pytest.raises(gsync.SessionClosed, match="aclose"):
        await session.fit(make_batches(4, 8) * 50, callbacks=[Midway()], progress=False)
    await beside
    assert [type(error) for error in refused] == [gsync.ConfigError]
    assert "another task's fit() runs" in str(refused[0])
    assert_same_state(model, before, atol=0)
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_scoped_block_never_left_is_dropped_as_a_held_session_is(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    opener = engine.session(TiedNet(), **RECIPE)
    session = await opener.__aenter__()  # in a notebook cell; its __aexit__ never comes
    await session.step(make_batches(1, 8)[0])
    ended = inside.ended_event(session)
    with pytest.warns(gsync.SessionLeftOpenWarning, match="dropped while open"):
        del opener, session
        gc.collect()
    again = await engine.session(TiedNet(), **RECIPE)  # opened at once: waits for the dropped one to end
    assert ended.is_set()
    await again.aclose()
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_failure_nobody_raised_is_logged_when_its_session_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 8)[0])
    inside.post_a_message_the_server_cannot_take(session)
    await closed_by_itself(session)
    with caplog.at_level("WARNING", logger="gsync"):
        del session
        gc.collect()
    assert any("SyncFailed" in record.getMessage() and "protocol error" in record.getMessage() for record in caplog.records)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_core_ended_for_a_membership_change_refuses_calls_and_leaves_the_model_to_the_next_generation(
    no_leaks: None,
) -> None:
    # What an elastic run's service does between calls once every rank agreed to change (a knock, a departure):
    # the generation's core moves to CHANGING and ends; its replicas go on in the next generation, so the model
    # passed in is not written back (here, with no next generation, it is left as it was).
    torch.manual_seed(0)
    model = TiedNet()
    before = copy.deepcopy(model)
    session = await gsync.Engine(TWO).session(model, **RECIPE)
    await session.step(make_batches(1, 31)[0])
    inside.end_generation_for_change(session)
    assert inside.is_changing(session) and not inside.is_usable(session)
    # Refused, not closed: in an elastic run the session goes on over the next generation.
    with pytest.raises(gsync.ConfigError, match="membership is changing; the session goes on"):
        await inside.step_the_generation(session, make_batches(1, 31))
    with pytest.raises(gsync.ConfigError, match="membership is changing"):
        session.model
    await session.aclose()
    assert inside.is_closed(session)
    assert_same_state(model, before)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_call_that_meets_a_generation_ended_by_a_loss_raises_the_loss_for_the_carry_to_redo(
    no_leaks: None,
) -> None:
    # What a step of an elastic run meets when a loss was settled while it waited to start, and the service had
    # already ended the generation for the change: the loss (which the elastic carry redoes over the next
    # generation), not a refusal that would end the fit.
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 31)[0])
    inside.settle_a_loss_and_end_the_generation(session, MembershipBroken(0, None, "a member was lost"))
    assert inside.is_changing(session)
    with pytest.raises(MembershipBroken, match="the membership changed before step"):
        await inside.step_the_generation(session, make_batches(1, 31))
    with pytest.raises(gsync.ConfigError, match="membership is changing"):
        session.model
    await session.aclose()
    assert inside.is_closed(session)
