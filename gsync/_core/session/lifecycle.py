"""A session's life over one process group: its start, its serving, a failure settled into the one error it
raises, and its end. Outside an elastic run that is the session's whole life; in one, each membership gets a life
of its own under the one session core.

:class:`SessionLife` owns the session's :class:`~gsync._core.session.state.Lifecycle`
(every transition is made through it) and its failure, and drives the two
parts that do the work: the :class:`~gsync._core.session.workers.SessionWorkers`
(actors, server, threads) and the :class:`~gsync._core.session.peers.PeerLink`
(the other ranks). The :class:`~gsync._core.session.core.SessionCore` runs the
calls a user makes and asks its life whether they may run.

A failure raised to a caller of an operation is *delivered*; one settled
while no operation runs (a peer lost between steps, a late device error) is
kept as :attr:`SessionLife.undelivered` until a call or the close raises it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
from torch import nn

from ...checkpoint import Checkpoint
from ...errors import GsyncError, SessionClosed, SyncFailed, SyncTimeout
from ..base.faults import recoverable
from ..state.checkpointing import restore_checkpoint_rng
from ..state.held import HeldState, hold_replicas
from ..state.recovery import attach_checkpoint, last_consistent
from ..state.replicas import copy_replicas, equip_replicas
from ..state.rng import capture_rng
from ...trace import Trace
from ..step.context import Recipe
from ..threads import LoopHandle
from ..topology import Topology
from .assembly import plan_buckets
from ..base.outcome import first_failure, is_cancellation
from .peers import PeerLink
from .state import Lifecycle, SessionState
from .workers import SessionWorkers

if TYPE_CHECKING:
    from ..elastic.membership import ElasticMembership
    from ..settings import EngineSettings

__all__ = ("SessionLife",)

logger = logging.getLogger("gsync")


class SessionLife:
    """Start, serve, fail and close one session (one generation of an elastic one)."""

    def __init__(
        self,
        settings: EngineSettings,
        model: nn.Module,
        recipe: Recipe,
        resume: Checkpoint | None,
        process_local: bool,
        peers: PeerLink,
        abort: threading.Event,
        *,
        first_step: int,
        elastic: ElasticMembership | None,
        held: HeldState | None,
        agreed_start: bool,
        on_idle_failure: Callable[[], None] | None,
        trace: Trace | None,
        topology: Topology | None = None,
    ) -> None:
        self._settings = settings
        self._trace = trace
        self._model = model
        self._recipe = recipe
        self._resume = resume
        self._process_local = process_local
        self._peers = peers
        self._abort = abort
        self._first_step = first_step
        self._elastic = elastic
        self._held = held
        """An elastic run's last generation's replicas, which this one goes on with (nothing copied or loaded)."""
        self._agreed_start = agreed_start
        """Every rank starts from a state the elastic run agreed on: no broadcast of rank 0's is needed."""
        self._on_idle_failure = on_idle_failure
        self._state = Lifecycle()
        self.workers = SessionWorkers(abort)
        self._loop: LoopHandle | None = None
        self._topology = topology if topology is not None else Topology(local_devices=len(settings.devices))
        self._failure: BaseException | None = None
        self._cancellation: BaseException | None = None
        self._undelivered: BaseException | None = None
        self.end_requested = anyio.Event()
        """Set when the session should end: closed by its user, or failed (the service then leaves the task group)."""
        self._rng_before_resume: dict[str, Any] | None = None
        self._settled = anyio.Event()
        self._checkpoint_attempted: set[int] = set()
        self._cancel_call: Callable[[], bool] = lambda: False

    # -- what the core asks ---------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """What closed the session, if it did not end normally."""
        return self._failure

    @property
    def cancellation(self) -> BaseException | None:
        """The cancellation of a call that closed the session (peers hear of it rather than of the failure)."""
        return self._cancellation

    @property
    def undelivered(self) -> BaseException | None:
        """A failure settled while no operation ran, not yet raised to anyone (the next call or the close raises it)."""
        return self._undelivered

    @property
    def loop(self) -> LoopHandle | None:
        """The loop the session runs on, once started."""
        return self._loop

    @property
    def topology(self) -> Topology:
        """The world's shape: this process's devices, and (once joined) its rank among the processes."""
        return self._topology

    @property
    def state(self) -> SessionState:
        return self._state.state

    @property
    def opened(self) -> bool:
        return self._state.opened

    @property
    def failing(self) -> bool:
        """The session's task group failed: the failure is being settled, or has been."""
        return self._state.state in (SessionState.FAILING, SessionState.FAILED)

    def begin_call(self, cancel: Callable[[], bool]) -> None:
        """A call starts (refused by the lifecycle unless idle); ``cancel`` ends it if a failure is settled meanwhile
        (``True`` when there was a call to end)."""
        self._state.move(SessionState.OPERATING)
        self._cancel_call = cancel

    def end_call(self) -> None:
        self._state.operation_over()
        self._cancel_call = lambda: False

    async def settled(self) -> None:
        """Until a failure being settled is settled (at once when none is), whatever cancels the caller."""
        if self._state.state is SessionState.FAILING:
            with anyio.CancelScope(shield=True):
                await self._settled.wait()

    def cancelled(self, cancellation: BaseException) -> None:
        """A call was cancelled midway: the session fails closed, and peers hear of the (first) cancellation."""
        if self._cancellation is None:
            self._cancellation = cancellation
        self.fail(SessionClosed("a call of this session was cancelled midway, so the session is closed"))

    def take_rng_before_resume(self) -> dict[str, Any] | None:
        """The generators as they were before the checkpoint's were restored, once (a resumed fit's replay reads
        its data with them)."""
        state, self._rng_before_resume = self._rng_before_resume, None
        return state

    def take_undelivered(self) -> BaseException | None:
        """The failure settled while no operation ran, once: whoever takes it raises or logs it."""
        undelivered, self._undelivered = self._undelivered, None
        return undelivered

    def request_end(self) -> None:
        """End the session (a close, a drop, a departure): no call starts from now on."""
        self._state.end_asked()
        self.end_requested.set()

    def end_for_change(self) -> None:
        """End for a membership change every rank agreed on, between calls: the next generation goes on with the
        replicas, so the model passed in is not written back."""
        self._state.move(SessionState.CHANGING)
        self.end_requested.set()

    def fail(self, error: BaseException) -> BaseException:
        """Close the session for good because of ``error`` (raised by the caller)."""
        self._abort.set()
        self.request_end()
        if self._failure is None:
            self._failure = error
            if isinstance(error, GsyncError) and error.checkpoint is None:
                self._attach_checkpoint(error)
        return error

    # -- open ----------------------------------------------------------------------

    async def start(self) -> None:
        """Join the peers, take or copy the replicas, start together, and build the workers."""
        settings = self._settings
        self._loop = loop = LoopHandle()
        if settings.distributed:
            await self._peers.join(settings, self._elastic, loop, self._process_local)
        # Planned from the model itself, so a model with nothing to train is refused first.
        plan = plan_buckets(settings, [(name, p) for name, p in self._model.named_parameters() if p.requires_grad])
        held = self._held
        if held is not None:
            # A membership change: the survivors' replicas go on as they are, nothing copied or loaded.
            replicas = held.take_replicas()
        else:
            # A copy of the model per device takes tens of milliseconds for a 10M-parameter MLP (seconds for a
            # large model): off the event loop, which other tasks of the user's program share. The user's
            # factories run on the loop, as the rest of the user's code does.
            copies = await anyio.to_thread.run_sync(copy_replicas, self._model, settings.devices, self._resume)
            replicas = equip_replicas(copies, settings.devices, self._recipe, self._resume)
        runtime = self._peers.runtime
        if runtime is not None:
            await self._peers.start_together([r.module for r in replicas], broadcast=not self._agreed_start)
        parts = self.workers.build(settings, self._recipe, plan, replicas, runtime, loop, self._process_local, self._trace)
        self._topology = parts.topology
        if held is not None:
            for actor in parts.actors:
                actor.update.holds(held.step)
            if held.buffers is not None:
                parts.buffers.seed(held.step, held.buffers)
        resume = self._resume
        if resume is not None and resume.rng_state is not None:
            # A loop of the user's continues from the checkpoint's generators (its next batch is drawn from them);
            # a fit that replays its data first rewinds to these, as the interrupted run read its data with them.
            self._rng_before_resume = capture_rng([spec.torch_device for spec in settings.devices if spec.torch_device.type == "cuda"])
            restore_checkpoint_rng(resume)
        if self._state.state is SessionState.OPENING:  # nothing ended it while it started
            self._state.move(SessionState.IDLE)
        logger.info(
            "gsync: session on %s (rank %d of %d), %d bucket(s) of %s MiB for %d parameter tensors",
            ", ".join(spec.name for spec in settings.devices), self._topology.rank, self._topology.world_size,
            len(plan.buckets), "/".join(f"{b.nbytes / 2**20:.2f}" for b in plan.buckets), len(plan.names),
        )

    # -- serve -----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the workers and (across processes) the peers' news until the session ends.

        A failure is settled here (threads stopped, the failure picked,
        reported to peers, given its checkpoint); a waiting call then raises
        it, otherwise it is raised into the task group, which cancels the
        user's code.
        """
        runtime = self._peers.runtime
        try:
            await self.workers.serve(self._peers.watch if runtime is not None else None)
        except BaseExceptionGroup as errors:
            if is_cancellation(errors):
                self._settled.set()
                raise
            closed_already = self._failure is not None
            self._state.move(SessionState.FAILING)
            try:
                failure = await self._settle(errors)
                self.fail(failure)
                self._state.move(SessionState.FAILED)
            finally:
                self._settled.set()
        else:
            self._settled.set()
            return
        if closed_already:
            return  # an operation closed the session; its caller already knows
        if self._cancel_call():
            return  # the operation raises the failure
        if runtime is not None and runtime.elastic and recoverable(failure):
            return  # the membership changes between calls: the next call waits for the next generation
        self._undelivered = failure
        if self._on_idle_failure is not None:
            self._on_idle_failure()
        raise failure

    def end_of_data(self) -> None:
        """A clean end of the user's block: the workers finish what they hold, and serving returns."""
        self.workers.end_of_data()

    async def _settle(self, errors: BaseExceptionGroup[Any]) -> BaseException:
        """The one exception a failed session raises: threads stopped first, then picked, reported, checkpointed."""
        # Shielded (its waits are bounded): a settling cut short by the task group's cancellation would leave
        # teardown marked done with threads unjoined and the collective open, and the close would skip it.
        with anyio.CancelScope(shield=True):
            await self.workers.teardown()
        # Devices that failed while the group was already ending had their
        # tasks cancelled before they could raise; their failures were kept on the actor.
        failure = first_failure(errors, self.workers.late_failures())
        if self._peers.runtime is not None and isinstance(failure, GsyncError):
            # Blame before reporting: a stuck peer that heard this rank's report
            # would leave its session, and its heartbeat would no longer say
            # where it was stuck. The blame waits a bounded time (heartbeats),
            # so two ranks whose collective failed never wait on each other.
            if isinstance(failure, (SyncFailed, SyncTimeout)):
                failure = await self._peers.blame(failure)
            await self._peers.report(failure)
        if isinstance(failure, GsyncError):
            self._attach_checkpoint(failure)
        return failure

    # -- end -------------------------------------------------------------------------

    async def close(self) -> None:
        """Tear everything down, the process group last. Idempotent, shielded from cancellation."""
        self._state.end_asked()
        with anyio.CancelScope(shield=True):
            self._peers.stop_watching()
            await self.workers.teardown()
            built = self.workers.built
            if built is not None:
                built.session_mailbox.discard()
            await self._peers.close()
        self._state.move(SessionState.CLOSED)

    def interrupted_start(self) -> None:
        """The user's block ended before the start did (a cancellation): the start's collectives leave their waits,
        so that the report to peers, queued behind them in the setup thread, goes out."""
        if not self._state.opened:
            self._abort.set()

    async def finish(self) -> None:
        """After a clean end: the model passed in receives the first replica's parameters and buffers.

        A copy of every parameter and buffer, in a thread: not on the event loop.
        """
        actors = self.workers.actors
        if not actors or self._state.state is SessionState.CHANGING:
            return  # a membership change: the next generation goes on with the replicas
        replica, model = actors[0].replica, self._model

        def write_back() -> None:
            with torch.no_grad():
                model.load_state_dict(replica.state_dict())

        await anyio.to_thread.run_sync(write_back)

    def _attach_checkpoint(self, failure: GsyncError) -> None:
        """Give ``failure`` the most advanced consistent state any replica still holds (tried once per failure)."""
        actors = self.workers.actors
        if not actors or id(failure) in self._checkpoint_attempted:
            return
        self._checkpoint_attempted.add(id(failure))
        built = self.workers.built
        attach_checkpoint(failure, lambda busy: last_consistent(
            actors, busy=busy, first_step=self._first_step, model=self._model, resume=self._resume,
            buffers=None if built is None else built.buffers, held_start=self._held is not None,
        ))

    def hold(self, finish: Callable[[Checkpoint], Checkpoint]) -> HeldState | None:
        """Once the session has ended: the state it leaves an elastic run's next generation.

        Its replicas themselves when every local one holds the same step
        whole (the next generation takes them: nothing is copied); otherwise
        the failure's checkpoint; ``None`` when there is neither. ``finish``
        completes a checkpoint taken of it.
        """
        workers = self.workers
        built = workers.built
        whole = built is not None and workers.torn_down and not workers.left_behind
        return hold_replicas(
            workers.actors, None if built is None else built.buffers, self._failure, self._first_step, finish, whole=whole
        )
