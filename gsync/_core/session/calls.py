"""What every call of a session goes through: one at a time, counted, and closed if cancelled midway.

A step, an evaluation and an all_reduce each run as one operation
(:meth:`CallGate.operation`): across processes the ranks' n-th operations
meet in collectives, so an operation refuses to start on a session that
cannot take part, and a cancelled one closes the session. A call refused
before it starts says why, with what to do instead.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import anyio

from ...errors import ConfigError, GsyncError, SessionClosed, SyncFailed, SyncTimeout
from ..distributed import peer_failed
from ..base.faults import MembershipBroken, recoverable
from ..threads import FitAborted, LoopEvent, LoopHandle, WorkerThread
from .lifecycle import SessionLife
from ..base.outcome import first_failure, is_cancellation
from .operations import Operation, OperationSite
from .peers import PeerLink
from .state import SessionState

__all__ = ("CallGate", "GateView")

_R = TypeVar("_R")


class GateView(Protocol):
    """What the gate reads of the session it guards, which outlives the gate's generation (the session core)."""

    @property
    def changing(self) -> bool:
        """Between two generations of an elastic run (the core's state, not this generation's)."""

    @property
    def last_step(self) -> int:
        """The last step applied (what a refusal names)."""


class CallGate:
    """The calls of one session: the one in flight, and how many completed."""

    def __init__(
        self, life: SessionLife, peers: PeerLink, abort: threading.Event, sync_timeout: float, session: GateView
    ) -> None:
        self._life = life
        self._session = session
        self._peers = peers
        self._abort = abort
        self._sync_timeout = sync_timeout
        self._done = 0
        self._scope: anyio.CancelScope | None = None
        self._over: LoopEvent | None = None

    @property
    def done(self) -> int:
        """Operations completed (across processes, the ranks' n-th meet in collectives)."""
        return self._done

    def over(self) -> LoopEvent | None:
        """Set when the call in flight ends; ``None`` while no call runs."""
        return self._over if self._scope is not None else None

    async def check(self, what: str) -> None:
        """Before a call: a failure being settled is waited for and raised; a call the session cannot take is refused."""
        await self._life.settled()
        failure = self._life.failure
        if self._session.changing and failure is not None and recoverable(failure):
            # A loss was settled while this call waited (the generation ended under it): the elastic carry
            # waits for the next generation and makes the call there.
            raise MembershipBroken(self._session.last_step, None, f"the membership changed before {what}() started")
        self.check_now(what)

    def check_now(self, what: str) -> None:
        """Refuse ``what`` on a session that cannot take it (a failure not raised yet is raised, once).

        :raises ~gsync.SessionClosed: on a failed, closing or closed session, or one not open yet.
        :raises ~gsync.ConfigError: while another call runs, or while an elastic run's membership changes.
        """
        if self._session.changing:
            # Reached by what does not wait for the change (a read of the model, the optimizers, a checkpoint):
            # the asynchronous calls wait for the next generation first (see check).
            raise ConfigError(
                f"{what}() while the elastic run's membership is changing; the session goes on: await a call "
                "(step, evaluate, all_reduce), which waits for the new membership, then try again"
            )
        life = self._life
        undelivered = life.take_undelivered()
        if undelivered is not None:
            # The failure itself, once, with its checkpoint: nothing has raised it yet.
            raise undelivered
        failure = life.failure
        if failure is not None:
            closed = SessionClosed(
                f"{what}() on a session that failed ({type(failure).__name__}: {failure}); "
                "open a new session, with resume=error.checkpoint to continue"
            )
            # The state to resume from travels with every later refusal, not only with the failure itself.
            closed.last_step = getattr(failure, "last_step", None)
            closed.checkpoint = getattr(failure, "checkpoint", None)
            raise closed from failure
        state = life.state
        if state in (SessionState.FAILING, SessionState.FAILED):
            raise SessionClosed(f"{what}() while the session closes after a failure; the next call (or aclose) raises it")
        if state is SessionState.CHANGING:
            raise SessionClosed(f"{what}() on a generation whose membership is changing; the next generation takes it")
        if state in (SessionState.CLOSING, SessionState.CLOSED):
            raise SessionClosed(f"{what}() after the session was closed; open a new session")
        if state is SessionState.OPENING:
            raise SessionClosed(f"{what}() on a session that is not open yet: `session = await engine.session(...)` opens it")
        if state is SessionState.OPERATING:
            raise ConfigError(
                f"{what}() while another task is inside step(), evaluate() or all_reduce() of this session; a "
                "session does one thing at a time: await each call before the next"
            )

    def cancelled(self, cancellation: BaseException) -> None:
        """A call was cancelled: the session closes, and peers are told of the cancellation."""
        self._life.cancelled(cancellation)

    def close_call(self, reason: str) -> None:
        """End the call in flight with :class:`~gsync.SessionClosed` (``reason``), closing the session as failed.

        The call may be between operations (a fit waiting for its data): the
        session fails all the same, so that the model is left as it was.
        """
        if self._life.failing or self._life.failure is not None:
            return  # a failing operation raises that failure itself
        self._life.fail(SessionClosed(reason))
        self._cancel()

    def _cancel(self) -> bool:
        if self._scope is None:
            return False
        self._scope.cancel()
        return True

    @asynccontextmanager
    async def operation(self, loop: LoopHandle) -> AsyncIterator[None]:
        """One step, evaluate or all_reduce; across processes the ranks' n-th operations meet in collectives.

        - A peer that left its session after ``n`` operations makes this
          rank's next one, if it is the (n+1)-th or later, raise :class:`~gsync.PeerFailed`.
        - If the session fails meanwhile (a device, a collective, a peer), the
          operation is cancelled and raises that failure.
        - If the caller cancels it midway, the session is closed: devices may
          be inside the step, and across processes the ranks' collectives
          would no longer match.
        """
        life = self._life
        left = self._peers.departed_before(self._done)
        if left is not None:
            raise life.fail(peer_failed(left))
        over = loop.event()
        scope = anyio.CancelScope()
        life.begin_call(self._cancel)
        self._scope = scope
        self._over = over
        symptom = False
        try:
            with scope:
                yield
        except BaseException as error:
            if not life.failing:
                if is_cancellation(error):
                    self.cancelled(error)
                raise
            # A symptom of the failure being settled (a stopped thread, a closed
            # mailbox): wait for the failure itself and raise it instead.
            await life.settled()
            symptom = True
        finally:
            life.end_call()
            self._scope = None
            over.set()
        if symptom or scope.cancelled_caught:
            raise life.failure or SessionClosed("the session closed during an operation")
        self._done += 1

    async def run(self, operation: Operation[_R, Any], site: OperationSite) -> _R:
        """Run ``operation``: its input checked, and the call refused if the session cannot take it (in the order the
        operation asks), then run as one operation (see :meth:`operation`); a failure of its own (a collective, a
        device, its data) fails the session, whose ranks' collectives no longer match.
        """
        if operation.input_first:
            operation.check()
        await self.check(operation.what)
        if not operation.input_first:
            operation.check()
        failure: BaseException | None = None
        try:
            async with self.operation(site.loop_handle()):
                return await operation.run(site)
        except BaseExceptionGroup as errors:
            failure = first_failure(errors)
        except GsyncError as error:
            failure = error
        raise self._life.fail(failure)

    def counted(self) -> None:
        """An operation that ran outside :meth:`operation` (a sharded checkpoint's gather) completed."""
        self._done += 1

    async def collective_job(self, comm: WorkerThread, job: Callable[[], Any], what: str, step: int) -> Any:
        """Run a collective in the communication thread, after anything it already holds, within ``sync_timeout``.

        :raises ~gsync.SyncFailed: when the collective raises (a peer's
            reported failure, if any, is raised instead: :class:`~gsync.PeerFailed`).
        :raises ~gsync.SyncTimeout: when it does not complete in time.
        """
        failure: GsyncError | None = None
        # Stays set if the collective fails: this rank was waiting in it (its heartbeat says so while it blames).
        self._peers.waiting(what)
        with anyio.move_on_after(self._sync_timeout):
            try:
                result = await comm.run(job)
            except (GsyncError, FitAborted):
                raise
            except Exception as error:  # noqa: BLE001 - the transport's error becomes gsync's, chained
                failure = SyncFailed(step, None, site=what)
                failure.__cause__ = error
            else:
                self._peers.waiting(None)
                return result
        if failure is None:
            self._abort.set()  # the collective's thread leaves its wait
            failure = SyncTimeout(step, self._sync_timeout, site=what)
        raise await self._peers.blame(failure)
