"""A held session's life: opened, stepped, closed, cancelled; one at a time per engine; its errors."""

from __future__ import annotations

import asyncio
import copy

import anyio
import pytest
import torch

import gsync
import gsync.testing
from gsync_pytest import gsync_threads
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.tasks import assert_no_tasks_left

pytestmark = pytest.mark.asyncio


async def test_a_session_loop_equals_fit_and_writes_the_weights_back(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(5, 31)
    expected, expected_losses = train_reference(model, batches)
    engine = gsync.Engine(TWO)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=sgd, loss_fn=classification_loss) as session:
        results = [await session.step(batch) for batch in batches]
        assert_same_state(trained, model, atol=0)  # only written back when the block ends
    assert_same_state(trained, expected)
    assert [r.step for r in results] == [0, 1, 2, 3, 4]
    assert [r.loss for r in results] == pytest.approx(expected_losses, abs=2e-5)
    assert all(r.rows == 31 and r.seconds > 0 and r.lr == 0.1 for r in results)
    fitted = await engine.fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss)
    assert_same_state(fitted.model, trained, atol=0)
    assert_no_tasks_left()


async def test_using_a_session_after_its_block_says_so() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.SessionClosed, match="after the session was closed"):
        await session.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.SessionClosed):
        session.checkpoint()


async def test_two_tasks_stepping_one_session_is_refused(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=1, step=0, site="backward")
    with gsync.testing.inject(engine, fault):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            async with anyio.create_task_group() as group:
                group.start_soon(session.step, make_batches(1, 8)[0])
                await anyio.to_thread.run_sync(fault.reached.wait, 10)
                with pytest.raises(gsync.ConfigError, match="another task is inside step"):
                    await session.step(make_batches(1, 8)[0])
                fault.release.set()


async def test_an_exception_in_the_users_body_propagates_unchanged_and_stops_everything(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    model = TiedNet()
    before = copy.deepcopy(model)
    mine = KeyError("the user's own bug")
    with pytest.raises(KeyError) as caught:
        async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            raise mine
    assert caught.value is mine
    assert_same_state(model, before, atol=0)
    assert gsync_threads() == []
    assert_no_tasks_left()
    async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as again:
        await again.step(make_batches(1, 8)[0])


async def test_a_device_failure_raises_from_step_and_closes_the_session(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    batches = make_batches(4, 8)
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=2, site="backward")):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(batches[0])
            await session.step(batches[1])
            with pytest.raises(gsync.WorkerFailed) as caught:
                await session.step(batches[2])
            failure = caught.value
            assert failure.device_index == 1 and failure.step == 2 and failure.site == "backward"
            assert isinstance(failure.__cause__, gsync.testing.InjectedFault)
            assert failure.last_step == 1 and failure.checkpoint.step == 1
            with pytest.raises(gsync.SessionClosed, match="failed") as closed:
                await session.step(batches[3])
            assert closed.value.__cause__ is failure
    assert gsync_threads() == []


async def test_an_uncaught_failure_leaves_the_block_as_itself() -> None:
    engine = gsync.Engine(TWO)
    with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=1, site="optimizer")):
        with pytest.raises(gsync.WorkerFailed) as caught:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                for batch in make_batches(3, 8):
                    await session.step(batch)
    assert caught.value.step == 1 and caught.value.site == "optimizer"
    # Device 1 may have applied step 1 before the abort reached it: then its state is the checkpoint.
    assert caught.value.last_step in (0, 1) and caught.value.checkpoint.step == caught.value.last_step


async def test_a_bad_batch_is_refused_before_anything_is_dispatched() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        x, y = make_batches(1, 8)[0]
        with pytest.raises(gsync.ConfigError, match="disagree on their size"):
            await session.step((x, y[:5]))
        with pytest.raises(gsync.ConfigError, match="at least one batch"):
            await session.step()
        # Nothing was dispatched: the session goes on.
        result = await session.step((x, y))
    assert result.step == 0


async def test_cancelling_a_session_stops_everything_and_the_engine_opens_another(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=0, step=1, site="forward")
    with gsync.testing.inject(engine, fault):
        with anyio.move_on_after(5) as scope:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                await session.step(make_batches(1, 8)[0])
                async with anyio.create_task_group() as group:
                    group.start_soon(session.step, make_batches(1, 8)[0])
                    await anyio.to_thread.run_sync(fault.reached.wait, 10)
                    scope.cancel()
    assert scope.cancelled_caught
    assert gsync_threads() == []
    assert_no_tasks_left()
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 8)[0])


async def test_one_session_or_fit_at_a_time_per_engine() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss):
        with pytest.raises(gsync.ConfigError, match="already has an open session"):
            await engine.fit(TiedNet(), make_batches(1, 8), optimizer=sgd, loss_fn=classification_loss)


async def test_a_session_used_from_an_asyncio_task_group_too() -> None:
    """Sessions are plain anyio: an asyncio.TaskGroup around them works as well."""
    engine = gsync.Engine(TWO)
    torch.manual_seed(0)
    model = TiedNet()
    _, expected_losses = train_reference(model, make_batches(1, 8))
    async with asyncio.TaskGroup() as group:
        async def train() -> float:
            async with engine.session(copy.deepcopy(model), optimizer=sgd, loss_fn=classification_loss) as session:
                return (await session.step(make_batches(1, 8)[0])).loss

        task = group.create_task(train())
    assert task.result() == pytest.approx(expected_losses[0], abs=2e-5)


async def test_cancelling_one_step_midway_closes_the_session(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=1, step=1, site="backward")
    with gsync.testing.inject(engine, fault):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            with anyio.move_on_after(0.2) as scope:
                await session.step(make_batches(1, 8)[0])
            assert scope.cancelled_caught
            with pytest.raises(gsync.SessionClosed, match="cancelled midway"):
                await session.step(make_batches(1, 8)[0])
    assert gsync_threads() == []


async def test_two_fits_at_once_on_one_engine_name_the_running_fit_not_asyncio() -> None:
    """The second fit is refused before any work, saying a fit runs and what to do; no place inside asyncio."""
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=0, step=0, site="forward")
    with gsync.testing.inject(engine, fault):
        first = asyncio.create_task(engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss))
        await anyio.to_thread.run_sync(fault.reached.wait, 10)
        with pytest.raises(gsync.ConfigError, match="is running a fit") as refused:
            await engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)
        assert "asyncio" not in str(refused.value) and "open session" not in str(refused.value)
        assert "Engine of its own" in str(refused.value)
        with pytest.raises(gsync.ConfigError, match="is running a fit"):
            await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
        fault.release.set()
        result = await first
    assert len(result.losses) == 2


async def test_a_fit_called_from_the_users_code_is_named_by_its_line() -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=0, step=0, site="forward")
    with gsync.testing.inject(engine, fault):

        async def train() -> None:
            await engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)

        first = asyncio.create_task(train())
        await anyio.to_thread.run_sync(fault.reached.wait, 10)
        with pytest.raises(gsync.ConfigError, match=r"engine.fit called at .*test_session_lifecycle.py:\d+"):
            await engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)
        fault.release.set()
        await first
