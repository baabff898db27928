"""A session's peers: the other ranks of a multi-process run, heard of, told, and waited on.

What a rank hears (a peer's failure report, a peer whose heartbeat stopped),
what it tells (why its session ends; that it leaves normally, after how many
operations), and what its heartbeat says of where it is. Mixed into
:class:`~gsync._core.session.core.SessionCore`, whose state it reads: every
attribute it uses is declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ...errors import SESSION_START, GsyncError, LostRank, PeerFailed, PeerLost, SyncFailed
from ..distributed import FailureReport, peer_failed
from ..distributed.heartbeat import Whereabouts, locate
from ..elastic.recovery import MembershipBroken, recoverable
from ..threads import FitAborted
from .state import Lifecycle, SessionState

if TYPE_CHECKING:
    import threading

    from torch import nn

    from ..distributed.runtime import ProcessGroupRuntime
    from ..step.actor import DeviceActor
    from ..threads import LoopEvent, LoopHandle, WorkerThread

__all__ = ("DEPARTED", "SessionPeers", "departure")

logger = logging.getLogger("gsync")

# Upper bound on reporting a failure to other ranks and closing a process group.
DIST_TEARDOWN_S = 10.0
# The error type a rank publishes when it leaves its session normally.
DEPARTED = "SessionClosed"
# News from an elastic run's watcher: the membership is changing, and this generation's step ends.
MEMBERSHIP_CHANGING = "membership changing"


def departure(news: FailureReport | list[LostRank] | str) -> bool:
    """Whether ``news`` is a rank leaving its session normally (a failure only for the operations it misses)."""
    return isinstance(news, FailureReport) and news.error_type == DEPARTED


class SessionPeers:
    """The peers protocol of a session: watch, listen, start together, report, depart."""

    # The session's state this protocol reads and writes (SessionCore sets every one in its __init__).
    first_step: int
    _next_step: int
    _abort: threading.Event
    _life: Lifecycle
    _op_scope: anyio.CancelScope | None
    _failure: BaseException | None
    _operations_done: int
    _operation_over: LoopEvent | None
    _reported: BaseException | None
    _peer_left: FailureReport | None
    _peer_news: list[FailureReport | list[LostRank] | str]
    _peer_news_arrived: anyio.Event
    _collective_what: str | None
    _loop: LoopHandle | None
    _setup: WorkerThread | None
    _runtime: ProcessGroupRuntime | None
    _actors: list[DeviceActor]
    change_due: bool

    async def _watch_peers(self) -> None:
        """Wait for another rank's failure report and raise it as :class:`~gsync.PeerFailed`.

        A rank that left its session normally is a failure only for a step
        it never took part in: it is noted, and the next step past it raises.
        """
        await self._peer_news_arrived.wait()
        report = self._peer_news[0]
        if isinstance(report, str):
            raise MembershipBroken(self._next_step, None, "another member asked for a membership change")
        if isinstance(report, list):
            raise PeerLost(report)
        if departure(report) and not (self._op_scope is not None and self._operations_done >= report.operations):
            self._peer_left = report
            return
        over = self._operation_over
        if self._op_scope is not None and report.step > self._next_step and over is not None:
            # The peer failed in a later step than the one this rank is finishing: it took part
            # in every collective of this one, so this step completes (its update is consistent
            # everywhere) before the failure ends the session.
            await over.wait()
        raise peer_failed(report)

    async def _listen_to_peers(self) -> None:
        """From now on, hear of other ranks that fail (their reports) or fall silent (their heartbeats).

        :meth:`_watch_peers` acts on the news once the session serves. Until
        then, news of a failure aborts the session's start: its collectives
        would otherwise wait for the failed rank until the group's own
        timeout (30 minutes for a group the user made), then fail with the
        transport's error.
        """
        runtime, setup, loop = self._runtime, self._setup, self._loop
        if runtime is None or setup is None or loop is None:
            raise RuntimeError("peers are listened to once the process group is joined")

        def deliver(news: FailureReport | list[LostRank]) -> None:
            self._peer_news.append(news)
            self._peer_news_arrived.set()
            if not self._life.opened and not departure(news):
                self._abort.set()  # the start's collectives leave their waits

        runtime.track(self._whereabouts, lambda lost: loop.call_soon(deliver, lost))
        # Starting the watcher opens a store connection: not on the event loop.
        await setup.run(lambda: runtime.watch(lambda report: loop.call_soon(deliver, report)))

    async def _start_with_peers(self, runtime: ProcessGroupRuntime, modules: list[nn.Module], broadcast: bool = True) -> None:
        """The start's collectives (same parameters, same step, rank 0's state unless not ``broadcast``); a peer
        failing meanwhile is named.

        :raises ~gsync.PeerFailed: when a peer reported a failure (its own
            start failed: an optimizer factory that raised, a checkpoint's
            optimizer state that does not fit), or :class:`~gsync.PeerLost`
            when its heartbeat stopped.
        :raises ~gsync.SyncFailed: ``site="session start"``, when a collective
            failed and no peer can be named.
        :raises ~gsync.ConfigError: on every rank, when they differ in parameters or in the step they resume from.
        """
        setup = self._setup
        if setup is None:
            raise RuntimeError("a start with peers needs the process group joined")
        self._collective_what = SESSION_START
        failure: BaseException
        try:
            await setup.run(lambda: runtime.prepare(modules, self.first_step, broadcast))
        except FitAborted:
            # Only news of a peer's failure aborts a start (a cancellation of this rank raises in the await instead).
            failures = [news for news in self._peer_news if not departure(news)]
            if not failures:
                raise
            news = failures[0]
            if isinstance(news, str):
                failure = MembershipBroken(self.first_step - 1, None, "the membership changed while the session started", site=SESSION_START)
            else:
                failure = PeerLost(news) if isinstance(news, list) else peer_failed(news)
        except GsyncError:
            raise
        except Exception as error:  # noqa: BLE001 - the transport's error becomes gsync's, chained
            failed = SyncFailed(self.first_step - 1, None, site=SESSION_START)
            failed.__cause__ = error
            # A peer that failed reported before it closed its connections; one that died is named by its silence.
            failure = await self._in_setup(lambda: runtime.blame_peer(failed), failed)
        else:
            self._collective_what = None
            return
        raise failure

    def _whereabouts(self) -> Whereabouts:
        """Where this rank is, for its heartbeat (called from the heartbeat thread)."""
        last = self._next_step - 1
        what = self._collective_what
        if what is not None:
            return Whereabouts(last, what, waiting=True)
        if self._life.state in (SessionState.FAILING, SessionState.FAILED) or self._failure is not None:
            # Ending because a step or collective failed: a victim, not the rank others wait for.
            return Whereabouts(last, "ending after a failure", waiting=True)
        if not self._life.opened:
            return Whereabouts(last, "starting the session")
        if self._op_scope is None:
            return Whereabouts(last, "outside gsync")
        return locate(self._actors, last)

    async def _report(self, failure: BaseException) -> None:
        """Tell the other ranks why this rank's session is ending, unless it was because of them."""
        runtime = self._runtime
        if runtime is None or failure is self._reported or (isinstance(failure, PeerFailed) and not isinstance(failure, PeerLost)):
            return
        if runtime.elastic and recoverable(failure):
            return  # not a failure of the run: its members change, and a report would end the others' sessions
        if runtime.store_unreachable():
            return  # a write to a store that does not answer would only hold the teardown up
        self._reported = failure
        site = "fit" if self._life.opened else SESSION_START
        await self._in_setup(lambda: runtime.report(failure, site), None)

    async def _announce_departure(self) -> None:
        runtime = self._runtime
        if runtime is None or self.change_due:
            # An elastic generation ending for a change every rank agreed on: nobody's loop went apart.
            return
        last = self._next_step - 1
        notice = FailureReport(
            runtime.membership.rank if runtime.names is None else runtime.names[runtime.membership.rank],
            "", -1, last, "session", DEPARTED,
            "this rank started another step (or evaluate, or all_reduce); every rank must run the same loop",
            operations=self._operations_done,
        )
        await self._in_setup(lambda: runtime.board.report(notice), None)

    async def _in_setup(self, job: Callable[[], Any], default: Any) -> Any:
        """Run a store or group job in the setup thread, bounded and shielded (teardown must finish)."""
        setup = self._setup
        if setup is None:
            return default
        with anyio.CancelScope(shield=True), anyio.move_on_after(DIST_TEARDOWN_S):
            try:
                return await setup.run(job)
            except Exception as error:  # noqa: BLE001 - a store gone with a dead host must not hide the failure
                logger.warning("gsync: talking to the other ranks failed while closing the session: %r", error)
                return default
        logger.warning("gsync: talking to the other ranks took over %g s while closing the session", DIST_TEARDOWN_S)
        return default
