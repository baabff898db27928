"""The bridge from gsync's threads to the event loop (``LoopHandle``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gsync._core.threads import JobTimedOut, LoopHandle, Outcome, WorkerThread


def _counting_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count the loop's ``call_soon_threadsafe`` calls: each one writes to its self-pipe and wakes it."""
    count = [0]
    original = loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return count


async def _until(predicate: Any, within_s: float = 10.0) -> None:
    # Each turn of the loop runs the callbacks already scheduled; no sleeping on the clock. Bounded by time, not by
    # turns: on a loaded machine a thread may wait many turns for a core.
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the callbacks never ran")
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _stopping(worker: WorkerThread, *releases: threading.Event) -> AsyncIterator[None]:
    """Run the body, then release every job it may have left blocked, stop ``worker`` and check that it exits."""
    try:
        yield
    finally:
        for event in releases:
            event.set()
        worker.stop()
        assert await worker.join(5)


@pytest.mark.asyncio
async def test_a_burst_of_callbacks_from_threads_wakes_the_loop_once_and_keeps_each_threads_order() -> None:
    wakeups = _counting_wakeups(asyncio.get_running_loop())
    handle = LoopHandle()
    ran: list[tuple[str, int]] = []

    def post(name: str) -> None:
        for index in range(50):
            assert handle.call_soon(ran.append, (name, index))

    posters = [threading.Thread(target=post, args=(name,)) for name in ("a", "b", "c")]
    # The loop is busy (this coroutine does not yield) while the threads post: one wake-up carries them all.
    for poster in posters:
        poster.start()
    for poster in posters:
        poster.join()
    assert wakeups[0] == 1
    await _until(lambda: len(ran) == 150)
    for name in ("a", "b", "c"):
        assert [index for who, index in ran if who == name] == list(range(50))
    # Once the loop has drained the burst, the next post wakes it again.
    handle.call_soon(ran.append, ("d", 0))
    assert wakeups[0] == 2
    await _until(lambda: len(ran) == 151)


@pytest.mark.asyncio
async def test_a_raising_callback_does_not_drop_the_ones_queued_after_it() -> None:
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    loop.set_exception_handler(lambda _, context: errors.append(context["exception"]))
    handle = LoopHandle()
    ran: list[int] = []

    def boom() -> None:
        raise ValueError("a callback failed")

    def post() -> None:
        handle.call_soon(ran.append, 1)
        handle.call_soon(boom)
        handle.call_soon(ran.append, 2)

    poster = threading.Thread(target=post)
    poster.start()
    poster.join()
    await _until(lambda: len(ran) == 2 and errors)
    assert ran == [1, 2]
    assert [str(error) for error in errors] == ["a callback failed"]


def test_posting_to_a_closed_loop_says_so() -> None:
    loop = asyncio.new_event_loop()
    handle: list[LoopHandle] = []

    async def make() -> None:
        handle.append(LoopHandle())

    loop.run_until_complete(make())
    loop.close()
    assert handle[0].call_soon(print) is False
    assert handle[0].call_soon(print) is False


@pytest.mark.asyncio
async def test_a_success_not_to_report_is_not_reported_but_a_failure_always_is() -> None:
    worker = WorkerThread("gsync-test", LoopHandle())
    reports: list[tuple[str, Outcome[None]]] = []

    def fail() -> None:
        raise OSError("link down")

    worker.submit(lambda: None, lambda outcome: reports.append(("quiet", outcome)), report_success=False)
    worker.submit(fail, lambda outcome: reports.append(("failed", outcome)), report_success=False)
    worker.submit(lambda: None, lambda outcome: reports.append(("last", outcome)))
    async with _stopping(worker):
        await _until(lambda: len(reports) == 2)
    assert [name for name, _ in reports] == ["failed", "last"]
    assert isinstance(reports[0][1].error, OSError) and reports[1][1].error is None


@pytest.mark.asyncio
async def test_a_job_s_deadline_counts_from_its_start_not_from_its_wait_in_the_queue() -> None:
    worker = WorkerThread("gsync-test-deadline", LoopHandle())
    release = threading.Event()
    async with _stopping(worker, release):
        worker.submit(lambda: release.wait(10), lambda outcome: None)  # holds the thread
        queued = asyncio.ensure_future(worker.run(lambda: "done", timeout=0.2))
        # Three of its deadlines pass while it waits behind the first job: a bound on what must not happen.
        await asyncio.sleep(0.6)
        assert not queued.done()
        release.set()
        assert await queued == "done"


@pytest.mark.asyncio
async def test_a_job_that_runs_past_its_deadline_times_out_while_it_runs_on() -> None:
    worker = WorkerThread("gsync-test-overrun", LoopHandle())
    release, finished = threading.Event(), threading.Event()

    def overrun() -> None:
        release.wait(10)
        finished.set()

    async with _stopping(worker, release):
        with pytest.raises(JobTimedOut):
            await worker.run(overrun, timeout=0.1)
        assert not finished.is_set()  # the job itself is not interrupted
    assert finished.is_set()


@pytest.mark.asyncio
async def test_jobs_run_back_to_back_report_on_one_wake_up_in_order() -> None:
    handle = LoopHandle()
    wakeups = [0]
    wake = handle._wake

    def counted(callback: Any) -> None:
        wakeups[0] += 1
        wake(callback)

    handle._wake = counted
    worker = WorkerThread("gsync-test-burst", handle, hold_reports=True)
    started = [threading.Event() for _ in range(5)]
    release = [threading.Event() for _ in range(5)]
    reports: list[int] = []

    def job(index: int) -> int:
        started[index].set()
        release[index].wait(10)
        return index

    async with _stopping(worker, *release):
        for index in range(5):
            worker.submit(lambda index=index: job(index), lambda outcome: reports.append(outcome.unwrap()))
        for index in range(5):
            # The loop runs while each job runs: only held reports keep it from waking for the one before.
            assert await asyncio.to_thread(started[index].wait, 10)
            release[index].set()
        await _until(lambda: len(reports) == 5)
        assert reports == [0, 1, 2, 3, 4]
        assert wakeups[0] == 1


@pytest.mark.asyncio
async def test_a_failure_is_reported_without_waiting_for_the_jobs_behind_it() -> None:
    worker = WorkerThread("gsync-test-failure-first", LoopHandle(), hold_reports=True)
    release, behind = threading.Event(), threading.Event()
    reports: list[str] = []

    def fail() -> None:
        raise OSError("link down")

    async with _stopping(worker, release, behind):
        worker.submit(lambda: release.wait(10), lambda outcome: None)
        worker.submit(lambda: None, lambda outcome: reports.append("done"))
        worker.submit(fail, lambda outcome: reports.append(type(outcome.error).__name__))
        worker.submit(lambda: behind.wait(10), lambda outcome: reports.append("behind"))
        release.set()
        # The job behind the failure is still running: the failure (and the report held before it) went out.
        await _until(lambda: len(reports) == 2)
        assert reports == ["done", "OSError"]
        behind.set()
        await _until(lambda: len(reports) == 3)


@pytest.mark.asyncio
async def test_a_job_that_ended_does_not_time_out_while_its_report_waits_for_the_job_behind_it() -> None:
    worker = WorkerThread("gsync-test-held", LoopHandle(), hold_reports=True)
    hold, release, slow_started = threading.Event(), threading.Event(), threading.Event()

    def slow_job() -> bool:
        slow_started.set()
        return release.wait(10)

    async with _stopping(worker, hold, release):
        worker.submit(lambda: hold.wait(10), lambda outcome: None)
        quick = asyncio.ensure_future(worker.run(lambda: "done", timeout=0.1))
        slow = asyncio.ensure_future(worker.run(slow_job))
        # Both queued behind the first job before it ends.
        await _until(lambda: worker._jobs.qsize() == 2)
        hold.set()
        # The quick job has ended; several of its deadlines pass while its report waits with the slow job's.
        assert await asyncio.to_thread(slow_started.wait, 10)
        await asyncio.sleep(0.4)
        assert not quick.done()
        release.set()
        assert await quick == "done"
        assert await slow is True


@pytest.mark.asyncio
async def test_without_hold_reports_each_job_reports_as_it_ends() -> None:
    worker = WorkerThread("gsync-test-unheld", LoopHandle())
    release = threading.Event()
    reports: list[str] = []
    async with _stopping(worker, release):
        worker.submit(lambda: None, lambda outcome: reports.append("first"))
        worker.submit(lambda: release.wait(10), lambda outcome: reports.append("second"))
        await _until(lambda: reports == ["first"])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_timer_runs_its_callback_on_the_loop_unless_cancelled_first(backend: str) -> None:
    ran: list[tuple[str, int]] = []

    async def main() -> None:
        handle = LoopHandle()
        done = handle.event()

        def kept() -> None:
            ran.append(("kept", threading.get_ident()))
            done.set()

        cancel_early = handle.call_later(0.01, lambda: ran.append(("cancelled", threading.get_ident())))
        cancel_kept = handle.call_later(0.05, kept)
        cancel_early()
        with anyio.fail_after(10):
            await done.wait()
        # Cancelling a timer that has run, or one already cancelled, does nothing.
        cancel_kept()
        cancel_early()

    anyio.run(main, backend=backend)
    assert ran == [("kept", threading.get_ident())]


def test_a_job_past_its_deadline_times_out_under_trio_too() -> None:
    release = threading.Event()

    async def main() -> None:
        worker = WorkerThread("gsync-test-overrun", LoopHandle())
        try:
            with pytest.raises(JobTimedOut):
                await worker.run(lambda: release.wait(10), timeout=0.1)
            release.set()  # the job ran on: now it ends, and the thread takes the next
            assert await worker.run(lambda: "next", timeout=5) == "next"
        finally:
            release.set()
            worker.stop()
            assert await worker.join(5)

    anyio.run(main, backend="trio")


def test_trio_timers_run_in_deadline_order_whatever_order_they_were_set_in() -> None:
    import trio
    from trio.testing import MockClock

    ran: list[tuple[str, float]] = []

    async def main() -> None:
        handle = LoopHandle()
        done = handle.event()
        start = trio.current_time()

        def record(name: str) -> None:
            ran.append((name, trio.current_time() - start))

        def then_another() -> None:
            record("2")
            handle.call_later(0.0, record, "2, then")
            cancel_4()  # due later: a timer can cancel another from its callback

        handle.call_later(3.0, record, "3")
        cancel_head = handle.call_later(0.5, record, "cancelled head")
        handle.call_later(2.0, then_another)
        cancel_4 = handle.call_later(4.0, record, "cancelled by 2")
        handle.call_later(1.0, record, "1")  # set last, due first
        handle.call_later(5.0, done.set)
        cancel_head()
        await done.wait()

    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    assert ran == [("1", 1.0), ("2", 2.0), ("2, then", 2.0), ("3", 3.0)]


def test_a_raising_timer_callback_under_trio_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    # Under trio a timer is a system task, and a system task that raises would end the whole run.
    async def main() -> None:
        handle = LoopHandle()
        done = handle.event()
        def set_then_raise() -> None:
            done.set()  # main resumes only after this task has handled what it raises
            raise ZeroDivisionError

        handle.call_later(0.0, set_then_raise)
        with anyio.fail_after(10):
            await done.wait()

    with caplog.at_level("ERROR", logger="gsync"):
        anyio.run(main, backend="trio")
    assert "a timer callback raised" in caplog.text
