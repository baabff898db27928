"""Cancellation from outside is never lost and never late; a close ends a running call and leaves the model alone.

Each test states one sentence of ``docs/failures.md`` or of :meth:`gsync.Session.aclose`'s docstring. The races
(a cancellation that arrives while gsync is already failing) are run many times: one run proves little.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
import traceback
from collections.abc import Callable, Coroutine

import anyio
import pytest
import torch

import gsync
import gsync.testing
from gsync_pytest import gsync_threads
from tests.support.inside import post_a_message_the_server_cannot_take
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

pytestmark = pytest.mark.asyncio


def expire(deadline: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> None:
    """An ``asyncio.timeout`` whose deadline is now, as if it had been set to expire at this moment."""
    with contextlib.suppress(RuntimeError):  # its block ended first (the failure came first): nothing to expire
        deadline.reschedule(loop.time())


def cancel_when_reached(fault: gsync.testing.Fault, cancel: Callable[[], object], delay: float = 0.0) -> threading.Thread:
    """From a thread: once ``fault`` fires (and ``delay`` later), call ``cancel`` on the running loop."""
    loop = asyncio.get_running_loop()

    def wait_then_cancel() -> None:
        if fault.reached.wait(30):
            if delay:
                threading.Event().wait(delay)  # the moment of the cancellation is the test's subject
            with contextlib.suppress(RuntimeError):  # the loop has ended: the test is over, nothing to cancel
                loop.call_soon_threadsafe(cancel)

    thread = threading.Thread(target=wait_then_cancel, daemon=True)
    thread.start()
    return thread


async def train_past_a_failure(session: gsync.Session, batches: list, lost: list[bool]) -> None:  # type: ignore[type-arg]
    """Step until a device fails, as a user's loop that handles WorkerFailed would; then an await at which a
    pending cancellation lands at the latest. ``lost`` says it never landed."""
    try:
        for batch in batches:
            await session.step(batch)
    except gsync.WorkerFailed:
        pass
    await anyio.sleep(30)
    lost.append(True)


@pytest.mark.parametrize("site", ["optimizer", "backward", "forward"])
@pytest.mark.parametrize("trial", range(6))
async def test_a_cancellation_that_meets_a_failure_is_still_delivered(site: str, trial: int, no_leaks: None) -> None:
    """The task is cancelled, whether the cancellation or the failure came first (then it is the context)."""
    engine = gsync.Engine(TWO)
    fault = gsync.testing.fail(0, 1, site)  # type: ignore[arg-type]
    lost: list[bool] = []
    with gsync.testing.inject(engine, fault):
        session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
        task = asyncio.create_task(train_past_a_failure(session, make_batches(4, 8), lost))
        cancel_when_reached(fault, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert lost == []
        await session.aclose()
    assert gsync_threads() == []


@pytest.mark.parametrize("how", ["task.cancel", "asyncio.timeout", "move_on_after"])
@pytest.mark.parametrize("trial", range(3))
async def test_a_cancellation_during_a_failing_step_reaches_each_kind_of_canceller(how: str, trial: int, no_leaks: None) -> None:
    """Whoever cancelled gets their cancellation: the task is cancelled, the timeout expires, the scope is left."""
    engine = gsync.Engine(TWO)
    fault = gsync.testing.fail(1, 1, "optimizer")
    lost: list[bool] = []
    with gsync.testing.inject(engine, fault):
        session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)

        def train() -> Coroutine[object, object, None]:
            return train_past_a_failure(session, make_batches(4, 8), lost)

        if how == "task.cancel":
            task = asyncio.create_task(train())
            cancel_when_reached(fault, task.cancel)
            with pytest.raises(asyncio.CancelledError):
                await task
        elif how == "asyncio.timeout":
            loop = asyncio.get_running_loop()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as deadline:
                    # The deadline is the moment the fault fires, as a timeout that happens to expire then.
                    cancel_when_reached(fault, lambda: expire(deadline, loop))
                    await train()
        else:
            with anyio.move_on_after(None) as scope:
                cancel_when_reached(fault, scope.cancel)
                await train()
            assert scope.cancelled_caught
        assert lost == []
        await session.aclose()


@pytest.mark.parametrize("trial", range(4))
async def test_a_cancellation_met_by_the_last_call_in_a_timeout_block_does_not_outlive_the_block(
    trial: int, no_leaks: None
) -> None:
    """The timeout gets its cancellation inside its block; nothing is left to cancel the task after it."""
    engine = gsync.Engine(TWO)
    fault = gsync.testing.fail(1, 1, "optimizer")
    loop = asyncio.get_running_loop()
    with gsync.testing.inject(engine, fault):
        session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
        with pytest.raises((TimeoutError, gsync.WorkerFailed)):
            async with asyncio.timeout(None) as deadline:
                canceller = cancel_when_reached(fault, lambda: expire(deadline, loop))
                for batch in make_batches(4, 8):
                    await session.step(batch)  # the block's last await
        # The expiry may come after the block ended (the failure came first): wait until it has been made.
        await anyio.to_thread.run_sync(canceller.join, 30)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # no cancellation nobody owns lands here
        await session.aclose()


@pytest.mark.parametrize("trial", range(4))
async def test_a_task_group_cancelling_a_failing_step_gets_its_sibling_error_and_nothing_leaks(
    trial: int, no_leaks: None
) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.fail(1, 1, "optimizer")
    with gsync.testing.inject(engine, fault):
        session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)

        async def sibling_fails_with_the_fault() -> None:
            await anyio.to_thread.run_sync(fault.reached.wait, 30)
            raise KeyError("the sibling's own error")

        with pytest.raises(BaseExceptionGroup) as caught:
            async with asyncio.TaskGroup() as group:
                group.create_task(sibling_fails_with_the_fault())
                for batch in make_batches(4, 8):
                    await session.step(batch)
        # The sibling's error, and the step's failure if it left the step before the group's cancellation came.
        assert all(isinstance(e, (KeyError, gsync.WorkerFailed)) for e in caught.value.exceptions), caught.value.exceptions
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)
        with pytest.raises(gsync.SessionClosed):  # the step met the cancellation while failing: the session closed
            await session.step(make_batches(1, 8)[0])
        await session.aclose()


@pytest.mark.parametrize("device_threads", ["per_device", "shared"])
async def test_cancelling_while_a_device_thread_is_stuck_ends_the_call_within_a_second(
    device_threads: str, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    """Not after ``sync_timeout``: the stuck thread is left behind, named in a warning, not waited for."""
    engine = gsync.Engine(TWO, sync_timeout=20.0, device_threads=device_threads)  # type: ignore[arg-type]
    fault = gsync.testing.stall(1, 2, "backward", interruptible=False)
    try:
        with gsync.testing.inject(engine, fault):
            session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)

            async def train() -> None:
                for batch in make_batches(4, 8):
                    await session.step(batch)

            task = asyncio.create_task(train())
            cancelled_at: list[float] = []

            def cancel() -> None:
                cancelled_at.append(time.monotonic())
                task.cancel()

            cancel_when_reached(fault, cancel, delay=0.3)
            with pytest.raises(asyncio.CancelledError):
                await task
            ended_after = time.monotonic() - cancelled_at[0]
            # A bound that a loaded machine keeps: what it rules out is a wait for the 20 s timeout.
            assert ended_after < 5.0, f"the cancelled call took {ended_after:.1f} s to end"
            assert any("left behind" in r.getMessage() and "cpu:1" in r.getMessage() for r in caplog.records)
            with pytest.raises(gsync.SessionClosed, match="cancelled"):
                await session.step(make_batches(1, 8)[0])
            await session.aclose()
    finally:
        fault.release.set()  # the native call returns; the thread left behind ends at its next phase boundary
    for thread in threading.enumerate():
        if thread.name in gsync_threads():
            thread.join(10)
    assert gsync_threads() == []


async def test_aclose_while_another_tasks_fit_waits_for_its_data_leaves_the_model_as_it_was(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    before = copy.deepcopy(model)
    engine = gsync.Engine(TWO)
    session = await engine.session(model, optimizer=sgd, loss_fn=classification_loss)
    await session.step(make_batches(1, 8)[0])
    waiting = anyio.Event()

    async def slow_batches():  # type: ignore[no-untyped-def]
        for batch in make_batches(50, 8):
            waiting.set()
            await anyio.sleep(0.01)  # a data source that takes its time: the close comes while the fit waits on it
            yield batch

    async def fit() -> None:
        await session.fit(slow_batches())

    task = asyncio.create_task(fit())
    await waiting.wait()
    await session.aclose()
    # Right after aclose() returns, every call says the session is closed, though the fit is still winding down.
    with pytest.raises(gsync.SessionClosed):
        await session.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.SessionClosed):
        await session.fit(make_batches(1, 8))
    with pytest.raises(gsync.SessionClosed, match=r"aclose\(\) was called while another task's call"):
        await task
    assert_same_state(model, before, atol=0)  # the close ended a running call: the model is left as it was
    assert session.closed


async def test_a_data_failure_in_a_later_fit_names_the_global_step(no_leaks: None) -> None:
    """Step numbers in errors are 0-based global optimizer-step indices, across session.step and session.fit."""
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        for batch in make_batches(3, 8):
            await session.step(batch)

        def failing_data():  # type: ignore[no-untyped-def]
            batches = make_batches(4, 8)
            yield batches[0]
            raise OSError("the second read fails")

        with pytest.raises(gsync.DataFailed) as caught:
            await session.fit(failing_data())
    assert caught.value.step == 4
    assert caught.value.last_step == 3
    assert "step 4" in str(caught.value)


async def test_a_scoped_block_that_swallows_the_sessions_interrupt_is_left_with_no_cancellation_pending(
    no_leaks: None,
) -> None:
    """gsync's own cancel of the block (a failure while no call ran) is withdrawn: the task is not left cancelling."""
    engine = gsync.Engine(TWO)
    swallowed = False
    with pytest.raises(gsync.SyncFailed, match="protocol error"):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            post_a_message_the_server_cannot_take(session)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:  # code the user did not write well: a library that swallows cancellation
                swallowed = True
    assert swallowed
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    with pytest.raises(TimeoutError):  # asyncio.timeout still knows its own cancellation from someone else's
        async with asyncio.timeout(0.01):
            await asyncio.sleep(30)


async def test_a_step_asked_for_after_a_close_began_is_refused(no_leaks: None) -> None:
    """Between aclose() asking the session to end and the session ending, no new call starts."""
    torch.manual_seed(0)
    model = TiedNet()
    batch = make_batches(1, 8)[0]
    expected, _ = train_reference(model, [batch])
    engine = gsync.Engine(TWO)
    session = await engine.session(model, optimizer=sgd, loss_fn=classification_loss)
    await session.step(batch)
    closing = asyncio.create_task(session.aclose())
    await asyncio.sleep(0)  # the close has been asked for; the session has not ended yet
    assert session.closed
    with pytest.raises(gsync.SessionClosed, match="closed"):
        await session.step(batch)
    await closing
    assert_same_state(model, expected)  # a clean close after one step: the refused step changed nothing


async def test_a_cancelled_call_leaves_without_gsyncs_frames_and_says_what_it_did(no_leaks: None) -> None:
    """A notebook interrupt shows the user's cell, the call, and one note: the session closed, how to go on."""
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(1, 1, "backward")
    with gsync.testing.inject(engine, fault):
        session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
        await session.step(make_batches(1, 8)[0])
        task = asyncio.create_task(session.step(make_batches(1, 8)[0]))
        cancel_when_reached(fault, task.cancel)
        with pytest.raises(asyncio.CancelledError) as caught:
            await task
        frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
        assert not any("/gsync/_core/" in name for name in frames), frames
        assert any("closed the session" in note and "resume=" in note for note in caught.value.__notes__)
        await session.aclose()
