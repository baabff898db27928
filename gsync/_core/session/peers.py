"""A session's link to its peers: the other ranks of a multi-process run, joined, heard of, told, and waited on.

:class:`PeerLink` joins the process group (in a setup thread of its own:
joining, reports and teardown all block), hears what other ranks say (a
failure report, a heartbeat that stopped, an elastic run's membership
changing), tells them why this rank's session ends, and answers the
heartbeat's question of where this rank is. It owns all of that state; what
it reads of its session (the step, the lifecycle, the call in flight, the
devices) it asks through :class:`SessionView`. In one process it holds
nothing, and its reports and waits return at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread

from ...errors import SESSION_START, GsyncError, LostRank, PeerFailed, PeerLost, SyncFailed
from ..distributed import FailureReport, peer_failed
from ..distributed.heartbeat import DevicePosition, Whereabouts, locate
from ..distributed.waiting import DIST_TEARDOWN_S
from ..distributed.runtime import ProcessGroupRuntime
from ..base.faults import MembershipBroken, recoverable
from ..elastic.watcher import ReformWatcher
from ..threads import THREAD_GRACE_S, FitAborted, LoopEvent, LoopHandle, WorkerThread
from .state import SessionState

if TYPE_CHECKING:
    from torch import nn

    from ..elastic.membership import ElasticMembership
    from ..settings import EngineSettings

__all__ = ("DEPARTED", "PeerLink", "SessionView", "departure")

logger = logging.getLogger("gsync")

# The error type a rank publishes when it leaves its session normally.
DEPARTED = "SessionClosed"
# News from an elastic run's watcher: the membership is changing, and this generation's step ends.
MEMBERSHIP_CHANGING = "membership changing"

_News = FailureReport | list[LostRank] | str


def departure(news: _News) -> bool:
    """Whether ``news`` is a rank leaving its session normally (a failure only for the operations it misses)."""
    return isinstance(news, FailureReport) and news.error_type == DEPARTED


class SessionView(Protocol):
    """What the link reads of the session it belongs to."""

    start_step: int

    @property
    def change_agreed(self) -> bool: ...

    @property
    def next_step(self) -> int: ...

    @property
    def state(self) -> SessionState: ...

    @property
    def opened(self) -> bool: ...

    @property
    def failure(self) -> BaseException | None: ...

    @property
    def operations_done(self) -> int: ...

    def call_over(self) -> LoopEvent | None:
        """Set when the call in flight ends; ``None`` while no call runs."""

    def devices(self) -> Sequence[DevicePosition]: ...


class PeerLink:
    """The other ranks of one session: the group joined, their news heard, this rank's end told."""

    def __init__(self, session: SessionView, abort: threading.Event) -> None:
        self._session = session
        self._abort = abort
        self._runtime: ProcessGroupRuntime | None = None
        self._setup: WorkerThread | None = None
        self._watcher: ReformWatcher | None = None
        self._news: list[_News] = []  # first news first
        self._news_arrived = anyio.Event()
        self._left: FailureReport | None = None
        self._reported: BaseException | None = None
        self._waiting_in: str | None = None

    @property
    def runtime(self) -> ProcessGroupRuntime | None:
        """The process group's side of the session, once joined (``None`` in one process)."""
        return self._runtime

    # -- joining -------------------------------------------------------------------

    async def join(self, settings: EngineSettings, elastic: ElasticMembership | None, loop: LoopHandle, process_local: bool) -> None:
        """Join the process group (the elastic generation's, in an elastic run) and start hearing from peers."""
        self._setup = setup = WorkerThread("gsync-dist", loop)
        generation = elastic.generation if elastic is not None else None
        abort = self._abort
        self._runtime = runtime = await setup.run(
            lambda: ProcessGroupRuntime.start(
                settings.process_group if generation is None else generation.group,
                settings.store if generation is None else generation.store,
                settings.devices[0].type,
                settings.devices[0].torch_device,
                len(settings.devices),
                # The transport must not give up before gsync's own deadline for a step.
                settings.sync_timeout * settings.devices_in_turn,
                process_local,
                abort,
                elastic=generation is not None,
                names=None if generation is None else generation.members,
            )
        )
        await self._listen(runtime, setup, loop)
        if elastic is not None and generation is not None and elastic.run is not None:
            if elastic.leaving:
                runtime.want_change()  # a SIGTERM that came while this generation started
            changing = self._membership_changing
            self._watcher = ReformWatcher(
                elastic.run, generation, lambda planned: loop.call_soon(changing, planned), runtime.want_change
            )
            self._watcher.start()

    async def _listen(self, runtime: ProcessGroupRuntime, setup: WorkerThread, loop: LoopHandle) -> None:
        """From now on, hear of other ranks that fail (their reports) or fall silent (their heartbeats).

        :meth:`watch` acts on the news once the session serves. Until then,
        news of a failure aborts the session's start: its collectives would
        otherwise wait for the failed rank until the group's own timeout (30
        minutes for a group the user made), then fail with the transport's error.
        """
        runtime.track(self.whereabouts, lambda lost: loop.call_soon(self._deliver, lost))
        # Starting the watcher opens a store connection: not on the event loop.
        await setup.run(lambda: runtime.watch(lambda report: loop.call_soon(self._deliver, report)))

    def _deliver(self, news: _News) -> None:
        self._news.append(news)
        self._news_arrived.set()
        if not self._session.opened and not departure(news):
            self._abort.set()  # the start's collectives leave their waits

    def _membership_changing(self, planned_after: int | None) -> None:
        if planned_after is not None:
            # Planned in that step's agreement, which every member took part in: this rank finishes the step
            # (its collectives are done), and the next call makes the change (Change.DUE).
            return
        self._news.append(MEMBERSHIP_CHANGING)
        self._news_arrived.set()
        self._abort.set()  # threads inside the step's collectives leave them: the step is redone

    async def start_together(self, modules: list[nn.Module], broadcast: bool = True) -> None:
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
        runtime, setup = self._runtime, self._setup
        if runtime is None or setup is None:
            raise RuntimeError("a start with peers needs the process group joined")
        first_step = self._session.start_step
        self._waiting_in = SESSION_START
        failure: BaseException
        try:
            await setup.run(lambda: runtime.prepare(modules, first_step, broadcast))
        except FitAborted:
            # Only news of a peer's failure aborts a start (a cancellation of this rank raises in the await instead).
            failures = [news for news in self._news if not departure(news)]
            if not failures:
                raise
            news = failures[0]
            if isinstance(news, str):
                failure = MembershipBroken(first_step - 1, None, "the membership changed while the session started", site=SESSION_START)
            else:
                failure = PeerLost(news) if isinstance(news, list) else peer_failed(news)
        except GsyncError:
            raise
        except Exception as error:  # noqa: BLE001 - the transport's error becomes gsync's, chained
            failed = SyncFailed(first_step - 1, None, site=SESSION_START)
            failed.__cause__ = error
            # A peer that failed reported before it closed its connections; one that died is named by its silence.
            failure = await self.blame(failed)
        else:
            self._waiting_in = None
            return
        raise failure

    # -- hearing -------------------------------------------------------------------

    async def watch(self) -> None:
        """Wait for another rank's failure report and raise it as :class:`~gsync.PeerFailed`.

        A rank that left its session normally is a failure only for a step
        it never took part in: it is noted, and the next step past it raises.
        """
        await self._news_arrived.wait()
        report = self._news[0]
        session = self._session
        if isinstance(report, str):
            raise MembershipBroken(session.next_step, None, "another member asked for a membership change")
        if isinstance(report, list):
            raise PeerLost(report)
        over = session.call_over()
        if departure(report) and not (over is not None and session.operations_done >= report.operations):
            self._left = report
            return
        if over is not None and report.step > session.next_step:
            # The peer failed in a later step than the one this rank is finishing: it took part
            # in every collective of this one, so this step completes (its update is consistent
            # everywhere) before the failure ends the session.
            await over.wait()
        raise peer_failed(report)

    def departed_before(self, operations_done: int) -> FailureReport | None:
        """A peer that left its session normally after fewer operations than ``operations_done``: the next one
        cannot meet it."""
        left = self._left
        return left if left is not None and operations_done >= left.operations else None

    # -- what the heartbeat says ------------------------------------------------------

    def stepped(self) -> None:
        """A step was applied: the heartbeat says so now, not at its next beat (see :meth:`Heartbeat.nudge`)."""
        runtime = self._runtime
        if runtime is not None:
            runtime.heartbeat.nudge()

    def waiting(self, what: str | None) -> None:
        """This rank waits in a collective of ``what`` (``None``: no longer); a failed one leaves it set, so
        the heartbeat still says where this rank waited while it blames a peer."""
        self._waiting_in = what

    def whereabouts(self) -> Whereabouts:
        """Where this rank is, for its heartbeat (called from the heartbeat thread)."""
        session = self._session
        last = session.next_step - 1
        what = self._waiting_in
        if what is not None:
            return Whereabouts(last, what, waiting=True)
        if session.state in (SessionState.FAILING, SessionState.FAILED) or session.failure is not None:
            # Ending because a step or collective failed: a victim, not the rank others wait for.
            return Whereabouts(last, "ending after a failure", waiting=True)
        if not session.opened:
            return Whereabouts(last, "starting the session")
        if session.call_over() is None:
            return Whereabouts(last, "outside gsync")
        return locate(session.devices(), last)

    # -- telling ---------------------------------------------------------------------

    async def report(self, failure: BaseException) -> None:
        """Tell the other ranks why this rank's session is ending, unless it was because of them."""
        runtime = self._runtime
        if runtime is None or failure is self._reported or (isinstance(failure, PeerFailed) and not isinstance(failure, PeerLost)):
            return
        if runtime.elastic and recoverable(failure):
            return  # not a failure of the run: its members change, and a report would end the others' sessions
        if runtime.store_unreachable():
            return  # a write to a store that does not answer would only hold the teardown up
        self._reported = failure
        site = "fit" if self._session.opened else SESSION_START
        await self.in_setup(lambda: runtime.report(failure, site), None)

    async def announce_departure(self) -> None:
        """Tell the other ranks this one left its session normally, after how many operations."""
        runtime = self._runtime
        session = self._session
        if runtime is None or session.change_agreed:
            # An elastic generation ending for a change every rank agreed on: nobody's loop went apart.
            return
        notice = FailureReport(
            runtime.membership.rank if runtime.names is None else runtime.names[runtime.membership.rank],
            "", -1, session.next_step - 1, "session", DEPARTED,
            "this rank started another step (or evaluate, or all_reduce); every rank must run the same loop",
            operations=session.operations_done,
        )
        await self.in_setup(lambda: runtime.board.report(notice), None)

    async def blame(self, failure: GsyncError) -> GsyncError:
        """``failure`` (a collective's), or the peer its heartbeat or report names instead; bounded."""
        runtime = self._runtime
        if runtime is None:
            return failure
        blamed: GsyncError = await self.in_setup(lambda: runtime.blame_peer(failure), failure)
        return blamed

    async def in_setup(self, job: Callable[[], Any], default: Any) -> Any:
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

    # -- closing ---------------------------------------------------------------------

    def stop_watching(self) -> None:
        """No more news of membership changes (the session is closing)."""
        if self._watcher is not None:
            self._watcher.stop()

    async def close(self) -> None:
        """Leave the process group, and stop the membership watcher and the setup thread (shielded by the caller)."""
        if self._runtime is not None:
            await self.in_setup(self._runtime.close, None)
        watcher = self._watcher
        # Woken by stop_watching's write, it ends within milliseconds; a store that stopped answering keeps it in
        # its wait, and it is left behind (a daemon) rather than holding the close up. Not in the setup thread,
        # whose queue a hung group teardown may hold.
        if watcher is not None and not await anyio.to_thread.run_sync(watcher.join, THREAD_GRACE_S):
            logger.warning("gsync: the membership watcher did not stop within %.1f s; left behind", THREAD_GRACE_S)
        if self._setup is not None:
            self._setup.stop()
            await self._setup.join(THREAD_GRACE_S)

    @property
    def setup(self) -> WorkerThread | None:
        """The thread the group's joining, reports and teardown run in (where a culprit is looked for)."""
        return self._setup

    def threads(self) -> list[WorkerThread]:
        return [] if self._setup is None else [self._setup]
