"""A device's jobs in its worker thread, and where the device is (read by the heartbeat and by timeouts).

Every heavy piece of a device's work (forward and backward, the optimizer
step, an evaluation) is a job on the device's worker thread: its own, or
one its process's CPU devices share. A job is cut into sites (phases);
entering one stops the job if the session is ending, runs the session's
site hooks and, when tracing, times the phase. A failure becomes gsync's
error where it happens, and is kept before it propagates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from ..threads import FitAborted, JobTimedOut, WorkerThread
from ...errors import GsyncError, SyncTimeout, WorkerFailed
from .context import ActorContext

__all__ = ("DeviceJobs",)


class DeviceJobs:
    """Runs device ``index``'s jobs on ``worker`` (a thread of its own when ``None``) and tracks its position."""

    def __init__(self, index: int, name: str, context: ActorContext, worker: WorkerThread | None) -> None:
        self.index = index
        self.name = name
        self._context = context
        self.shares_thread = worker is not None
        if worker is None:
            threads = None if context.intra_op_threads is None else context.intra_op_threads[0]
            worker = WorkerThread(f"gsync-device-{index}", context.loop, torch_threads=threads)
        self.worker = worker
        """The thread that runs this device's jobs: its own, or one its process's CPU devices share."""
        self.queued = False
        """A job of this device waits for the shared thread, behind another device's (read by the sync server
        and the heartbeat: a device held up by another is not the one to blame)."""
        self.site = "data"
        self.step = -1
        self.waiting = False
        """Waiting for the step's gradient sync, or for its turn on a shared thread (read by the heartbeat, from its
        thread)."""
        self.failure: GsyncError | None = None
        self.shard_rows: tuple[int, int] | None = None
        """The rows of the shard in forward and backward now, and of its batch over every device: a failure
        there names them (what a device was given is often why its code failed: a BatchNorm's shard of one row)."""

    def where(self) -> str:
        """Where this device was last seen, e.g. ``"step 2, backward"`` (for timeout reports)."""
        return f"step {self.step}, {self.site}"

    # -- in the worker thread ----------------------------------------------------

    def enter(self, site: str) -> AbstractContextManager[None]:
        """Start a site (phase): stop here if the session is ending; the returned context runs the site hooks
        as it is entered, and times the phase (hooks included) when tracing."""
        context = self._context
        if context.abort.is_set():
            raise FitAborted
        self.site = site
        if context.trace is None and not context.site_hooks:
            return nullcontext()
        return self._phase(site)

    @contextmanager
    def _phase(self, site: str) -> Iterator[None]:
        context = self._context
        # A fault a hook injects (a raise, a stall) happens inside the phase's span, as a real one would.
        with context.trace.span(site, self.step, self.index) if context.trace is not None else nullcontext():
            if context.site_hooks:
                # The engine's list, which the loop's thread may change meanwhile (a fault armed or disarmed).
                for hook in tuple(context.site_hooks):
                    hook(self.index, self.step, site, context.abort)
                # A hook may have blocked while the session ended: do not start the phase then.
                if context.abort.is_set():
                    raise FitAborted
            yield

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a job, turning a failure into gsync's error right where it happens.

        The failure is stamped and kept before it propagates, and the abort
        flag is raised at once, so peers stop at their next phase boundary
        and a failure whose task was already cancelled is still reported.
        """
        try:
            return fn(*args)
        except FitAborted:
            raise
        except GsyncError as error:
            self.failure = error
            self._context.abort.set()
            raise
        except Exception as error:
            rows = self.shard_rows if self.site in ("forward", "backward") else None
            failure = WorkerFailed(self.name, self.index, self.step, self.site, *(rows or (None, None)))
            failure.__cause__ = error
            self.failure = failure
            self._context.abort.set()
            raise failure from error

    def _job(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.queued:
            self.queued = self.waiting = False
        try:
            with self._context.streams.compute_stream(self.index):
                return self._guarded(fn, *args)
        finally:
            if self.shares_thread:
                # Its end reaches the loop only with the jobs queued behind it (a shared thread holds reports):
                # until then the heartbeat must count it as waiting, not as a device still working.
                self.waiting = True

    # -- on the event loop -----------------------------------------------------

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` in the worker thread and return its result.

        With ``timeout``: raise :class:`~gsync._core.threads.JobTimedOut` once the
        job has run that long; its wait behind other devices' jobs on a shared
        thread does not count (see :meth:`WorkerThread.run`).
        """
        if self.shares_thread:
            self.queued = self.waiting = True
        try:
            return await self.worker.run(lambda: self._job(fn, *args), timeout)
        except FitAborted:
            if self.queued:  # the job never started: the thread had stopped
                self.queued = self.waiting = False
            raise

    async def run_timed(self, fn: Callable[..., Any], *args: Any, site: str) -> Any:
        """:meth:`run` within ``sync_timeout``.

        :raises ~gsync.SyncTimeout: naming this device and ``site`` once the job has run that long. The job
            runs on (it cannot be interrupted); the abort flag stops it at its next phase boundary.
        """
        timeout = self._context.sync_timeout
        try:
            return await self.run(fn, *args, timeout=timeout)
        except JobTimedOut:
            self._context.abort.set()
            raise SyncTimeout(
                self.step, timeout, stalled_devices=[self.name], site=site, last_seen={self.name: self.where()},
            ) from None
