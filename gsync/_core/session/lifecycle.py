"""A session's life: its start (the process group, replicas, the assembly), serving, failing, teardown.

:class:`SessionLife` is the part of :class:`~gsync._core.session.core.SessionCore`
that builds what a session runs and takes it down again, and settles a
failure into the one error the session raises; the core adds the
operations a user calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import torch
from torch import nn

from ..threads import LoopHandle, WorkerThread
from .assembly import Assembly, assemble, plan_buckets
from ..gradients.buffers import BufferSync
from ...checkpoint import Checkpoint
from ..state.checkpointing import restore_checkpoint_rng
from ...comm.base import Collective
from ..step.context import ActorContext, Recipe
from ..distributed.runtime import ProcessGroupRuntime
from ..elastic.quorum import Generation
from ..elastic.recovery import recoverable
from ..elastic.watcher import ReformWatcher
from ...errors import GsyncError, SessionClosed, SyncFailed, SyncTimeout
from ..step.mailbox import Mailbox
from ..step.messages import Close, ServerMessage, SessionMessage
from .outcome import first_failure, is_cancellation
from .peers import MEMBERSHIP_CHANGING, SessionPeers
from .state import Lifecycle, SessionState
from ..gradients.rebuild import PlanRebuild
from ..state.recovery import attach_checkpoint, last_consistent
from ..state.held import HeldState
from ..state.replicas import Replica, copy_replicas, equip_replicas
from ..state.rng import capture_rng
from ..step.server import SyncServer
from ..streams import StreamSync
from ..topology import Topology
from ...trace import Trace

if TYPE_CHECKING:
    from ..elastic.membership import ElasticMembership
    from ..settings import EngineSettings

__all__ = ("SessionLife",)

# How long teardown waits for worker threads to finish their current job
# before leaving them (they are daemons and stop at their next phase boundary
# or gradient hook).
_THREAD_GRACE_S = 0.5

logger = logging.getLogger("gsync")
_T = TypeVar("_T")


class SessionLife(SessionPeers):
    """Start, serve, fail and close one session."""

    # The session's state this part reads and writes (SessionCore sets every one in its __init__).
    model: nn.Module
    trace: Trace | None
    undelivered: BaseException | None
    end_requested: anyio.Event
    on_idle_failure: Callable[[], None] | None
    _settings: EngineSettings
    _elastic: ElasticMembership | None
    _watcher: ReformWatcher | None
    _recipe: Recipe
    _resume: Checkpoint | None
    _process_local: bool
    _life: Lifecycle
    _torn_down: bool
    _op_scope: anyio.CancelScope | None
    _settled: anyio.Event
    _checkpoint_attempted: set[int]
    _rng_before_resume: dict[str, Any] | None
    _topology: Topology
    _context: ActorContext | None
    _streams: StreamSync | None
    _collective: Collective | None
    _buffers: BufferSync | None
    _server_mailbox: Mailbox[ServerMessage] | None
    _session_mailbox: Mailbox[SessionMessage] | None
    _rebuild: PlanRebuild | None
    _server: SyncServer | None
    _held: HeldState | None
    _agreed_start: bool
    _ending_for_change: bool
    _left_behind: list[str]

    # -- open ----------------------------------------------------------------

    async def _start(self) -> None:
        settings = self._settings
        self._loop = loop = LoopHandle()
        if settings.distributed:
            await self._join_group(loop)
        # Planned from the model itself, so a model with nothing to train is refused first.
        plan = plan_buckets(settings, [(name, p) for name, p in self.model.named_parameters() if p.requires_grad])
        # A copy of the model per device takes tens of milliseconds for a 10M-parameter MLP (seconds for a large
        # model): off the event loop, which other tasks of the user's program share. The user's factories run on
        # the loop, as the rest of the user's code does.
        held = self._held
        if held is not None:
            # A membership change: the survivors' replicas go on as they are, nothing copied or loaded.
            replicas = held.take_replicas()
        else:
            copies = await anyio.to_thread.run_sync(copy_replicas, self.model, settings.devices, self._resume)
            replicas = equip_replicas(copies, settings.devices, self._recipe, self._resume)
        runtime = self._runtime
        if runtime is not None:
            await self._start_with_peers(runtime, [r.module for r in replicas], broadcast=not self._agreed_start)
        self._adopt(assemble(settings, self._recipe, plan, replicas, runtime, self._abort, loop, self._process_local))
        if held is not None:
            for actor in self._actors:
                actor.update.holds(held.step)
            if held.buffers is not None:
                _built(self._buffers).seed(held.step, held.buffers)
        resume = self._resume
        if resume is not None and resume.rng_state is not None:
            # A loop of the user's continues from the checkpoint's generators (its next batch is drawn from them);
            # a fit that replays its data first rewinds to these, as the interrupted run read its data with them.
            self._rng_before_resume = capture_rng([spec.torch_device for spec in settings.devices if spec.torch_device.type == "cuda"])
            restore_checkpoint_rng(resume)
        if self._life.state is SessionState.OPENING:  # nothing ended it while it started
            self._life.move(SessionState.IDLE)
        logger.info(
            "gsync: session on %s (rank %d of %d), %d bucket(s) of %s MiB for %d parameter tensors",
            ", ".join(spec.name for spec in settings.devices), self._topology.rank, self._topology.world_size, len(plan.buckets),
            "/".join(f"{b.nbytes / 2**20:.2f}" for b in plan.buckets), len(plan.names),
        )

    async def _join_group(self, loop: LoopHandle) -> None:
        """Join the process group (the elastic generation's, in an elastic run) and start hearing from peers."""
        settings = self._settings
        # Joining, checks, reports and teardown of a process group all block:
        # they run in a thread of their own, never on the event loop.
        self._setup = WorkerThread("gsync-dist", loop)
        elastic = self._elastic
        generation = elastic.generation if elastic is not None else None
        self._runtime = await self._setup.run(
            lambda: ProcessGroupRuntime.start(
                settings.process_group if generation is None else generation.group,
                settings.store if generation is None else generation.store,
                settings.devices[0].type,
                settings.devices[0].torch_device,
                len(settings.devices),
                # The transport must not give up before gsync's own deadline for a step.
                settings.sync_timeout * settings.devices_in_turn,
                self._process_local,
                self._abort,
                elastic=generation is not None,
                names=None if generation is None else generation.members,
            )
        )
        await self._listen_to_peers()
        if elastic is not None and generation is not None:
            self._watch_membership(elastic, generation, loop)

    def _adopt(self, parts: Assembly) -> None:
        self._topology = parts.topology
        self._context = parts.context
        self._streams = parts.streams
        self._collective = parts.collective
        self._buffers = parts.buffers
        self._server_mailbox = parts.server_mailbox
        self._session_mailbox = parts.session_mailbox
        self._actors = parts.actors
        self._rebuild = parts.rebuild
        self._server = parts.server
        self.trace = parts.trace

    def _watch_membership(self, elastic: ElasticMembership, generation: Generation, loop: LoopHandle) -> None:
        """From now on, answer a membership change at once, and hear of processes that knock."""
        runtime = _built(self._runtime)
        runtime.change_wanted = elastic.leaving  # a SIGTERM that came while this generation started

        def knocked() -> None:
            runtime.change_wanted = True

        def changing(planned_after: int | None) -> None:
            if planned_after is not None:
                # Planned in that step's agreement, which every member took part in: this rank finishes the step
                # (its collectives are done), and the next call makes the change (change_due).
                return
            self._peer_news.append(MEMBERSHIP_CHANGING)
            self._peer_news_arrived.set()
            self._abort.set()  # threads inside the step's collectives leave them: the step is redone

        watcher = ReformWatcher(_built(elastic.run), generation, lambda planned: loop.call_soon(changing, planned), knocked)
        self._watcher = watcher
        watcher.start()

    # -- life: serve -----------------------------------------------------------------

    async def _serve(self) -> None:
        """Run the server, the actors and (across processes) the peer watcher until the session ends.

        A failure is settled here (threads stopped, the failure picked,
        reported to peers, given its checkpoint); a waiting :meth:`step`
        then raises it, otherwise it is raised into the task group, which
        cancels the user's code.
        """
        server = _built(self._server)
        try:
            async with anyio.create_task_group() as group:
                if self._runtime is not None:
                    group.start_soon(self._watch_peers)
                async with anyio.create_task_group() as work:
                    work.start_soon(server.run)
                    for actor in self._actors:
                        work.start_soon(actor.run)
                group.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            if is_cancellation(errors):
                self._settled.set()
                raise
            closed_already = self._failure is not None
            self._life.move(SessionState.FAILING)
            try:
                failure = await self._settle(errors)
                self._fail(failure)
                self._life.move(SessionState.FAILED)
            finally:
                self._settled.set()
        else:
            self._settled.set()
            return
        if closed_already:
            return  # an operation closed the session; its caller already knows
        if self._op_scope is not None:
            self._op_scope.cancel()  # the operation raises the failure
            return
        if self._runtime is not None and self._runtime.elastic and recoverable(failure):
            return  # the membership changes between calls: the next call waits for the next generation
        self.undelivered = failure
        if self.on_idle_failure is not None:
            self.on_idle_failure()
        raise failure


    def _stop_serving(self) -> None:
        """End the data: actors finish what they hold, the server closes them, serving returns."""
        for actor in self._actors:
            actor.shards.close()
        if self._server_mailbox is not None:
            self._server_mailbox.try_post(Close("end of session"))

    # -- life: close ---------------------------------------------------------------

    async def _teardown(self) -> None:
        """Stop every actor and thread of the session (not the process group). Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        self._abort.set()
        for actor in self._actors:
            actor.shards.discard()
        if self._server_mailbox is not None:
            self._server_mailbox.discard()
        # The session mailbox stays open: a step waiting on it learns of a
        # failure only once the failure is settled (see _serve).
        workers = []
        for actor in self._actors:
            actor.close()
            actor.mailbox.discard()
            if actor.worker not in workers:  # CPU devices may share one
                workers.append(actor.worker)
        if self._server is not None and self._streams is not None:
            streams = self._streams
            # The last job of the communication thread waits for every stream's queued
            # work (a host sync, so never on the event loop), before replica state is
            # read and bucket buffers are freed.
            self._server.comm.submit(lambda: streams.close(timeout=_THREAD_GRACE_S * 10), lambda outcome: None)
            self._server.close()
            workers.append(self._server.comm)
        deadline = time.monotonic() + _THREAD_GRACE_S
        left_behind = [worker.name for worker in workers if not await worker.join(max(0.0, deadline - time.monotonic()))]
        self._left_behind = left_behind
        if left_behind:
            where = ", ".join(f"{actor.name} ({actor.where})" for actor in self._actors if actor.worker.name in left_behind)
            logger.warning(
                "gsync: thread(s) %s did not stop within %.1f s and are left behind (daemon threads, stuck in %s); "
                "they end at their job's next phase boundary, or with the process",
                ", ".join(left_behind), _THREAD_GRACE_S, where or "a collective",
            )
        if self._collective is not None:
            self._collective.close()

    async def _settle(self, errors: BaseExceptionGroup[Any]) -> BaseException:
        """The one exception a failed session raises: threads stopped first, then picked, reported, checkpointed."""
        # Shielded (its waits are bounded): a settling cut short by the task group's cancellation would leave
        # teardown marked done with threads unjoined and the collective open, and the close would skip it.
        with anyio.CancelScope(shield=True):
            await self._teardown()
        # Devices that failed while the group was already ending had their
        # tasks cancelled before they could raise; their failures were kept on the actor.
        late = [actor.failure for actor in self._actors if actor.failure is not None]
        if self._server is not None and self._server.failure is not None:
            late.append(self._server.failure)
        failure = first_failure(errors, late)
        runtime = self._runtime
        if runtime is not None and isinstance(failure, GsyncError):
            # Blame before reporting: a stuck peer that heard this rank's report
            # would leave its session, and its heartbeat would no longer say
            # where it was stuck. The blame waits a bounded time (heartbeats),
            # so two ranks whose collective failed never wait on each other.
            if isinstance(failure, (SyncFailed, SyncTimeout)):
                collective_failure = failure
                failure = await self._in_setup(lambda: runtime.blame_peer(collective_failure), failure)
            await self._report(failure)
        if isinstance(failure, GsyncError):
            self._attach_checkpoint(failure)
        return failure


    async def _close(self) -> None:
        """Tear everything down, the process group last. Idempotent, shielded from cancellation."""
        self._life.end_asked()
        with anyio.CancelScope(shield=True):
            if self._watcher is not None:
                self._watcher.stop()
            await self._teardown()
            if self._session_mailbox is not None:
                self._session_mailbox.discard()
            if self._runtime is not None:
                await self._in_setup(self._runtime.close, None)
            if self._setup is not None:
                self._setup.stop()
                await self._setup.join(_THREAD_GRACE_S)
        self._life.move(SessionState.CLOSED)

    async def _finish(self) -> None:
        """After a clean end: the model passed in receives the first replica's parameters and buffers.

        A copy of every parameter and buffer, in a thread: not on the event loop.
        """
        if not self._actors or self._ending_for_change:
            return  # a membership change: the next generation goes on with the replicas
        replica = self._actors[0].replica

        def write_back() -> None:
            with torch.no_grad():
                self.model.load_state_dict(replica.state_dict())

        await anyio.to_thread.run_sync(write_back)

    def _attach_checkpoint(self, failure: GsyncError) -> None:
        """Give ``failure`` the most advanced consistent state any replica still holds (tried once per failure)."""
        if not self._actors or id(failure) in self._checkpoint_attempted:
            return
        self._checkpoint_attempted.add(id(failure))
        attach_checkpoint(failure, lambda busy: last_consistent(
            self._actors, busy=busy, first_step=self.first_step, model=self.model, resume=self._resume,
            buffers=self._buffers, held_start=self._held is not None,
        ))

    def hold(self, finish: Callable[[Checkpoint], Checkpoint]) -> HeldState | None:
        """Once the session has ended: the state it leaves an elastic run's next generation.

        Its replicas themselves when every local one holds the same step
        whole (the next generation takes them: nothing is copied), their
        buffers put back as that step left them (an interrupted forward moves
        running statistics on); otherwise the failure's checkpoint; ``None``
        when there is neither. ``finish`` completes a checkpoint taken of it.
        """
        taken = getattr(self._failure, "checkpoint", None)
        step = self._whole_step()
        if step is None:
            return None if taken is None else HeldState.of(finish(taken))
        buffers = _built(self._buffers)
        snapshot = None if buffers.empty else buffers.restore(step)
        first = self._actors[0]
        replicas = [Replica(a.replica, a.optimizer, a.scheduler, a.scaler) for a in self._actors]

        def capture() -> Checkpoint:
            if isinstance(taken, Checkpoint) and taken.step == step:
                return finish(taken)  # the failure's own, already copied
            return finish(Checkpoint.capture(
                step, first.replica, first.optimizer, snapshot, scheduler=first.scheduler, scaler=first.scaler
            ))

        return HeldState(step, capture, replicas, snapshot)

    def _whole_step(self) -> int | None:
        """The step every local replica holds whole once the session has ended, if they all hold one."""
        actors = self._actors
        if not actors or not self._torn_down or self._left_behind or actors[0].update.shard is not None:
            return None
        steps = {actor.applied_step for actor in actors}
        if len(steps) != 1 or any(actor.optimizer_dirty for actor in actors):
            return None
        step = steps.pop()
        if step < self.first_step - 1:
            return None
        buffers = self._buffers
        moved = self._failure is not None  # a step was interrupted: its forward may have moved the buffers
        if buffers is None or (moved and not buffers.empty and buffers.snapshot(step) is None):
            return None
        return step

    def _fail(self, error: BaseException) -> BaseException:
        """Close the session for good because of ``error`` (raised by the caller)."""
        self._abort.set()
        self._life.end_asked()
        self.end_requested.set()
        if self._failure is None:
            self._failure = error
            if isinstance(error, GsyncError) and error.checkpoint is None:
                self._attach_checkpoint(error)
        return error


def _built(value: _T | None) -> _T:
    """A part of the session that exists once it is open."""
    if value is None:
        raise SessionClosed("the session is not open: use it inside `async with engine.session(...)`")
    return value
