"""The bridge between the event loop and gsync's own OS threads.

gsync runs heavy work (forward, backward, optimizer steps, reductions) in
threads it owns, one per job stream, rather than in anyio's shared thread
pool: the threads end when ``fit`` ends, so nothing of gsync outlives it.
Threads report back by scheduling a callback on the loop; they never block on
the loop and the loop never blocks on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio
import torch

T = TypeVar("T")

logger = logging.getLogger("gsync")

THREADS_PER_THREAD = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
"""Each thread can run torch's kernels on its own number of intra-op threads (OpenMP's per-thread count)."""

__all__ = ("THREAD_GRACE_S", "FitAborted", "JobTimedOut", "LoopEvent", "LoopHandle", "Outcome", "WorkerThread")

THREAD_GRACE_S = 0.5
"""How long an ending session waits for a worker thread to finish its current job before leaving it behind (a
daemon that stops at its job's next phase boundary, or with the process)."""


class LoopEvent(Protocol):
    """A one-shot event of the loop's own library (``asyncio.Event`` or ``trio.Event``), set on the loop."""

    def set(self) -> object: ...

    def is_set(self) -> bool: ...

    def wait(self) -> Awaitable[object]: ...


class FitAborted(Exception):
    """Raised inside a gsync thread to stop a job early once the run is ending (its abort flag is set)."""


class JobTimedOut(Exception):
    """A job ran past its deadline (raised on the event loop; the job itself runs on)."""


class LoopHandle:
    """Schedules callbacks on the event loop that created it, from any thread.

    Callbacks posted while the loop has not yet run earlier ones ride on one
    wake-up: each wake-up costs the poster a write to the loop's self-pipe
    and the loop a read, and every such system call gives up the GIL, which
    the thread must then win back from the device threads. With many
    threads reporting (devices' jobs, reductions, mailboxes), the loop is
    woken once per burst instead of once per callback. Callbacks run in
    posting order.
    """

    def __init__(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            self._wake: Callable[..., Any] = loop.call_soon_threadsafe
            self._loop_closed: Callable[[], bool] = loop.is_closed
            self._new_event: Callable[[], LoopEvent] = asyncio.Event
            self._call_later: Callable[..., Callable[[], object]] = _asyncio_call_later(loop)
        except RuntimeError:
            # Not asyncio: anyio's only other backend is trio.
            import trio

            self._wake = trio.lowlevel.current_trio_token().run_sync_soon
            self._loop_closed = lambda: False
            self._new_event = trio.Event
            self._call_later = _trio_call_later(trio)
        self._lock = threading.Lock()
        # Non-empty while a wake-up that will run it is scheduled (or about to be, by the
        # poster that made it non-empty). If the loop closes meanwhile, what is queued is
        # dropped: nothing is left to run it, as with a closed loop's own call_soon_threadsafe.
        self._pending: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def event(self) -> LoopEvent:
        """A new event of the loop's own library, for a task of this loop to wait on.

        A mailbox or a job waited for makes one per wait, several per step.
        ``anyio.Event()`` first asks which library runs the loop, about 5 us
        each time (asyncio's own costs 0.3); anyio's cancel scopes cancel a
        wait on it as on anyio's. Unlike ``anyio.Event``, waiting on an event
        already set returns without yielding to the loop: not a checkpoint.
        (Events made once per session or thread stay ``anyio.Event``.)
        """
        return self._new_event()

    def call_later(self, delay: float, callback: Callable[..., object], *args: object) -> Callable[[], object]:
        """From the loop: run ``callback(*args)`` on the loop in ``delay`` seconds, unless the returned function
        is called first (calling it later does nothing). What ``callback`` raises is logged, not raised: nothing
        awaits a timer.

        gsync's deadlines (a step's sync, a job's run) are timers, not anyio
        cancel scopes: the steps' hot path enters several per step, and a
        scope costs the loop tens of microseconds on asyncio (its own
        bookkeeping and a timer), a timer a few.
        """
        return self._call_later(delay, callback, *args)

    def call_soon(self, callback: Callable[..., object], *args: object) -> bool:
        """Schedule ``callback(*args)`` on the loop; ``False`` when the loop is already closed."""
        return self.call_soon_each(((callback, args),))

    def call_soon_each(self, calls: Sequence[tuple[Callable[..., object], tuple[object, ...]]]) -> bool:
        """Schedule each ``callback(*args)`` of ``calls`` on the loop, in order, on one wake-up at most."""
        with self._lock:
            was_empty = not self._pending
            self._pending.extend(calls)
            if not was_empty:
                if not self._loop_closed():
                    return True
                self._pending.clear()
                return False
        try:
            self._wake(self._run_pending)
        except RuntimeError:
            with self._lock:
                self._pending.clear()
            return False
        return True

    def _run_pending(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for position, (callback, args) in enumerate(batch):
            try:
                callback(*args)
            except BaseException:
                # The loop reports this one as it would any callback's; the rest still run, first.
                rest = batch[position + 1 :]
                if rest:
                    with self._lock:
                        nothing_scheduled = not self._pending
                        self._pending[:0] = rest
                    if nothing_scheduled:
                        try:
                            self._wake(self._run_pending)
                        except RuntimeError:
                            pass
                raise


def _asyncio_call_later(loop: asyncio.AbstractEventLoop) -> Callable[..., Callable[[], object]]:
    def call_later(delay: float, callback: Callable[..., object], *args: object) -> Callable[[], object]:
        return loop.call_later(delay, callback, *args).cancel

    return call_later


def _trio_call_later(trio: Any) -> Callable[..., Callable[[], object]]:
    def call_later(delay: float, callback: Callable[..., object], *args: object) -> Callable[[], object]:
        # trio has no timer callbacks: a system task sleeps in a scope that cancelling the timer cancels.
        scope = trio.CancelScope()

        async def timer() -> None:
            with scope:
                await trio.sleep(delay)
                try:
                    callback(*args)
                except Exception:
                    # A system task that raises ends the whole trio run; asyncio logs a raising callback.
                    logger.exception("gsync: a timer callback raised")

        trio.lowlevel.spawn_system_task(timer, name="gsync timer")
        return scope.cancel

    return call_later


class Outcome(Generic[T]):
    """The result of a job run in a worker thread: a value or the exception it raised."""

    __slots__ = ("value", "error")

    def __init__(self, value: T | None = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    def unwrap(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


_STOP = object()


class WorkerThread:
    """One daemon OS thread that runs submitted jobs one at a time, in submission order.

    Jobs cannot be interrupted from outside: cancelling the awaiting task leaves
    the current job running. Callers that need jobs to stop early give them a
    flag to poll (gsync's gradient hooks poll the engine's abort flag).

    With ``hold_reports``, jobs queued back to back (several devices'
    forward passes on the thread they share) report to the loop together,
    when the thread runs out of jobs: one wake-up per burst, not one per job.
    Each wake-up makes the loop take the GIL from the thread in the middle of
    the next job; what the loop does for a report (resume an actor that then
    waits for the sync) cannot speed up a job still queued. The price: a job
    that ended is awaited until the jobs queued behind it end too, so it is
    only for jobs whose results are waited for together anyway (a step waits
    for every device). A failure is reported at once.

    The thread runs torch's kernels on ``torch_threads`` intra-op threads
    (its own OpenMP team), or by default on as many as the creating thread
    had. It sets its count as it starts even then: a thread reads the count
    it starts with from a process-wide value, which another session's
    device threads may have set to their share of the cores. That value is
    also what a thread the user starts during such a session begins with;
    a thread given ``torch_threads`` sets it back to the creating thread's
    count as it exits, so threads started afterwards get what they would
    have had without gsync. Only where torch's parallel backend is OpenMP
    (``torch.__config__.parallel_info()``): its native backend has one
    pool of threads per process, fixed once it has run.
    """

    def __init__(self, name: str, loop: LoopHandle, hold_reports: bool = False, torch_threads: int | None = None) -> None:
        self.name = name
        self._loop = loop
        self._hold_reports = hold_reports
        self._creator_torch_threads = torch.get_num_threads()
        self._torch_threads = torch_threads if torch_threads is not None else self._creator_torch_threads
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._exited = threading.Event()
        self._exit_seen = anyio.Event()
        self._stopped = False
        # Started by the first job, so building an actor that never runs costs no thread.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    @property
    def thread(self) -> threading.Thread:
        """The OS thread this worker runs on (started by its first job)."""
        return self._thread

    def _serve(self) -> None:
        # With hold_reports: reports of jobs that ran back to back, held until the thread runs out of jobs.
        held: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        try:
            if THREADS_PER_THREAD:
                torch.set_num_threads(self._torch_threads)
            while True:
                if held and (not self._hold_reports or self._jobs.empty()):
                    self._loop.call_soon_each(held)
                    held = []
                job = self._jobs.get()
                if job is _STOP:
                    return
                report = job()
                if report is not None:
                    on_done, outcome = report
                    held.append((on_done, (outcome,)))
                    if outcome.error is not None:
                        # A failure goes out at once: the session ends sooner.
                        self._loop.call_soon_each(held)
                        held = []
        finally:
            if THREADS_PER_THREAD and self._torch_threads != self._creator_torch_threads:
                with contextlib.suppress(Exception):  # a count not restored must not keep the thread from ending
                    torch.set_num_threads(self._creator_torch_threads)
            if held:
                self._loop.call_soon_each(held)
            self._exited.set()
            self._loop.call_soon(self._exit_seen.set)

    def submit(
        self,
        fn: Callable[[], T],
        on_done: Callable[[Outcome[T]], object],
        report_success: bool = True,
    ) -> None:
        """Run ``fn()`` in the thread, then ``on_done(outcome)`` on the event loop.

        After :meth:`stop`, ``on_done`` gets a :class:`FitAborted` outcome instead.

        ``report_success=False`` skips ``on_done`` when ``fn`` returns: for a
        job whose success a later job's report implies (a failure is always
        reported).

        ``on_done`` is dropped silently if the loop has closed by then: nobody
        is left to receive it.
        """

        def job() -> tuple[Callable[[Outcome[T]], object], Outcome[T]] | None:
            try:
                outcome: Outcome[T] = Outcome(value=fn())
            except BaseException as error:  # noqa: BLE001 - handed to the loop, never swallowed
                outcome = Outcome(error=error)
            else:
                if not report_success:
                    return None
            return on_done, outcome

        if self._stopped:
            # Nothing would ever run it: the thread exits at the stop already queued.
            self._loop.call_soon(on_done, Outcome(error=FitAborted()))
            return
        self._jobs.put(job)
        if self._thread.ident is None:
            self._thread.start()

    async def run(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn()`` in the thread and return its result (or raise its exception).

        With ``timeout``: raise :class:`JobTimedOut` once the job has run
        that long. Time spent queued behind earlier jobs does not count (on a
        thread that several users share, each earlier job has its own
        deadline), nor does the wait of a job that has ended for the jobs
        behind it to end too (its report is held with theirs).

        If the awaiting task is cancelled or times out, the job keeps running
        to its end in the thread and its result is discarded.
        """
        loop = self._loop
        # The event the awaiting task waits on now: the job's report sets it, and so does a deadline passing
        # (after which the task waits on a new one, if the job may still run).
        waiting = [loop.event()]
        box: list[Outcome[T]] = []
        started: list[float] = []
        ended: list[bool] = []

        def finish(outcome: Outcome[T]) -> None:
            box.append(outcome)
            waiting[0].set()

        def timed() -> T:
            started.append(time.monotonic())
            try:
                return fn()
            finally:
                ended.append(True)

        if timeout is None:
            self.submit(fn, finish)
            await waiting[0].wait()
            return box[0].unwrap()
        self.submit(timed, finish)
        wait: float | None = timeout
        while True:
            event = waiting[0]
            cancel_timer = None if wait is None else loop.call_later(wait, event.set)
            try:
                await event.wait()
            finally:
                if cancel_timer is not None:
                    cancel_timer()
            if box:
                return box[0].unwrap()
            waiting[0] = loop.event()
            if ended:  # its report is held with those of the jobs behind it, each with its own deadline
                wait = None
                continue
            wait = timeout if not started else started[0] + timeout - time.monotonic()
            if wait <= 0:
                raise JobTimedOut

    def stop(self) -> None:
        """Let the thread exit after the jobs already submitted; later jobs fail at once with :class:`FitAborted`.

        Idempotent: every user of a shared thread may stop it.
        """
        if self._stopped:
            return
        self._stopped = True
        self._jobs.put(_STOP)

    async def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to exit, without blocking the loop.

        Shielded from cancellation, so cleanup still waits when ``fit`` is
        being cancelled. Returns whether the thread has exited.
        """
        if self._thread.ident is None:
            return True
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            await self._exit_seen.wait()
        if self._exited.is_set():
            # The thread has run its last line; this join returns at once.
            self._thread.join()
            return True
        return False
