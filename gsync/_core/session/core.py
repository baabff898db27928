"""The session's core: what one open session holds and does, from its start to its teardown.

:class:`SessionCore` is the engine room behind the public
:class:`gsync.Session` handle: it starts the session (replicas, actors,
server, threads, the process group), runs its operations (a step, an
evaluation, an all_reduce, a checkpoint) and turns whatever fails into one
error with a checkpoint. It extends
:class:`~gsync._core.session.operations.SessionOperations` (what every
operation goes through; evaluate and all_reduce) and
:class:`~gsync._core.session.lifecycle.SessionLife` (starting, serving,
failing, closing) with the step and what the handle reads.
:func:`open_session` is its life as one anyio task
group; :mod:`gsync._core.session.service` runs that life in a task of its own, so
that the handle can be used from any task of the loop.

A failure raised to a caller of an operation is *delivered*; one settled
while no operation runs (a peer lost between steps, a late device error) is
kept as :attr:`SessionCore.undelivered` until a call or the close raises it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
from torch import nn

from ..threads import LoopEvent, LoopHandle, WorkerThread
from ..step.actor import DeviceActor
from ..data.batches import batch_rows
from ..gradients.buffers import BufferSync
from ...checkpoint import Checkpoint
from ...comm.base import Collective
from ..step.context import ActorContext, Recipe, Shard
from ..distributed import FailureReport, peer_failed
from ..distributed.runtime import ProcessGroupRuntime
from ..elastic.watcher import ReformWatcher
from ...errors import (
    CheckpointError,
    ConfigError,
    GsyncError,
    LostRank,
    MailboxClosed,
    SessionClosed,
    SyncFailed,
)
from ..step.mailbox import Mailbox
from ..step.messages import ServerMessage, SessionMessage, StepApplied, StepDispatched, StepLoss
from .outcome import raised_by_block
from .sharded_checkpoint import gather_whole_state
from .state import Lifecycle, SessionState
from .lifecycle import _built
from .operations import ReduceOp, SessionOperations
from ..gradients.rebuild import PlanRebuild
from ..state.held import HeldState
from ..state.rng import capture_rng, restore_rng
from ...result import FitStats, StepResult
from ..step.server import SyncServer
from ..streams import StreamSync
from ..topology import Topology
from ...trace import Trace
from ..trace_files import finish_trace

if TYPE_CHECKING:
    from ..elastic.membership import ElasticMembership
    from ..settings import EngineSettings

__all__ = ("ReduceOp", "SessionCore", "open_session")

logger = logging.getLogger("gsync")


class SessionCore(SessionOperations):
    """One open session's state and operations; users reach it through :class:`gsync.Session`."""

    def __init__(
        self,
        settings: EngineSettings,
        model: nn.Module,
        recipe: Recipe,
        resume: Checkpoint | None,
        process_local_data: bool,
        *,
        replay: bool | None = None,
        elastic: ElasticMembership | None = None,
        on_idle_failure: Callable[[], None] | None = None,
        held: HeldState | None = None,
        agreed_start: bool = False,
    ) -> None:
        self._settings = settings
        self._elastic = elastic
        self._watcher: ReformWatcher | None = None
        self.change_due = False
        """Every rank agreed to change the elastic run's membership after the last step: the next call changes it."""
        self.last_applied_at: float | None = None
        """When the last step was applied (``time.monotonic()``)."""
        self.model = model
        """The module passed in; it receives the trained weights when the block ends and the session did not fail."""
        self._recipe = recipe
        self._resume = resume
        self._process_local = bool(process_local_data)
        self.joins = settings.uneven == "join"
        """The session's own ``uneven="join"`` (``Engine.session(uneven=...)``)."""
        self.joining = self.joins
        """Each step starts with every rank's rows, so a rank whose data ended joins it with empty shards
        (``step(None)``); a fit sets it for its own steps (``fit(uneven=...)``)."""
        self.first_step = held.next_step if held is not None else 0 if resume is None else resume.next_step
        """The global index of this session's first step (> 0 when resuming)."""
        self._held = held
        """An elastic run's last generation's replicas, which this one goes on with (nothing copied or loaded)."""
        self._agreed_start = agreed_start
        """Every rank starts from a state the elastic run agreed on: no broadcast of rank 0's is needed."""
        self._ending_for_change = False
        self._next_step = self.first_step
        self._abort = threading.Event()
        self._life = Lifecycle()
        self._operations_done = 0
        self._operation_over: LoopEvent | None = None
        self._op_scope: anyio.CancelScope | None = None
        self._settled = anyio.Event()
        self._checkpoint_attempted: set[int] = set()
        self._failure: BaseException | None = None
        self._reported: BaseException | None = None
        self._peer_left: FailureReport | None = None
        # What the failure watcher and the heartbeat heard of other ranks, first news first.
        self._peer_news: list[FailureReport | list[LostRank] | str] = []
        self._peer_news_arrived = anyio.Event()
        self._torn_down = False
        self._left_behind: list[str] = []
        self._collective_what: str | None = None
        self.undelivered: BaseException | None = None
        """A failure settled while no operation ran, not yet raised to anyone (the next call or the close raises it)."""
        self.end_requested = anyio.Event()
        """Set when the session should end: closed by its user, or failed (the service then leaves the task group).
        Set through :meth:`request_end` (or a failure), which also ends the lifecycle's serving."""
        self.on_idle_failure = on_idle_failure
        """Called once a failure that no operation waits for is settled (the scoped form cancels the user's block)."""
        self.replay_pending = resume is not None if replay is None else replay
        """Until the first step: a fit on this session replays its data up to the checkpoint it resumed from."""
        self._cancellation: BaseException | None = None
        self._rng_before_resume: dict[str, Any] | None = None
        self._snapshot: nn.Module | None = None
        self._snapshot_step = -1
        self._snapshot_wanted = False
        # Built by _start; teardown copes with any prefix of them.
        self._loop: LoopHandle | None = None
        self._setup: WorkerThread | None = None
        self._runtime: ProcessGroupRuntime | None = None
        self._actors: list[DeviceActor] = []
        self._server: SyncServer | None = None
        self._collective: Collective | None = None
        self._streams: StreamSync | None = None
        self._buffers: BufferSync | None = None
        self._rebuild: PlanRebuild | None = None
        self._context: ActorContext | None = None
        self._server_mailbox: Mailbox[ServerMessage] | None = None
        self._session_mailbox: Mailbox[SessionMessage] | None = None
        self._topology = Topology(local_devices=len(settings.devices))
        self.trace: Trace | None = None
        """The session's timeline, when the engine traces."""

    # -- public ----------------------------------------------------------------

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The local replicas' optimizers (see :attr:`gsync.Session.optimizers`)."""
        self._check_usable("optimizers")
        return tuple(actor.optimizer for actor in self._actors)

    @property
    def next_step(self) -> int:
        """The global index the next :meth:`step` will have."""
        return self._next_step

    @property
    def rank(self) -> int:
        """This process's rank (0 in a one-process run)."""
        return self._topology.rank

    @property
    def world_size(self) -> int:
        """The number of processes (1 in a one-process run)."""
        return self._topology.world_size

    @property
    def stats(self) -> FitStats:
        server = self._server
        if server is None:
            return FitStats()
        plan = server.plan
        return FitStats(
            steps=server.steps_synced,
            buckets=len(plan.buckets),
            bucket_ready_messages=server.bucket_ready_received,
            bucket_sizes=tuple(b.nbytes for b in plan.buckets),
            bucket_params=tuple(tuple(plan.names[p] for p in b.params) for b in plan.buckets),
            rebuilt_buckets=self._rebuild is not None and self._rebuild.rebuilt,
            reduced_bytes=server.reduced_bytes,
        )

    def checkpoint(self) -> Checkpoint:
        """The consistent state as of the last step, copied to the CPU (see :meth:`gsync.Session.checkpoint`).

        With ``shard_optimizer=True`` across processes it is a collective, called on the event loop: every
        rank takes it between the same steps, and the other ranks' slices of the optimizer state are gathered
        in the communication thread while the loop waits (see
        :mod:`~gsync._core.session.sharded_checkpoint`). It counts as one of the session's operations; a
        failed gather fails the session.

        :raises ~gsync.CheckpointError: when the ranks' optimizer states do not make a whole one.
        """
        self._check_usable("checkpoint")
        actor = self._actors[0]
        sharding = _built(self._context).sharding
        runtime = self._runtime
        whole: dict[int, dict[str, Any]] | None = None
        if sharding is not None and runtime is not None:
            left = self._peer_left
            if left is not None and self._operations_done >= left.operations:
                raise self._fail(peer_failed(left))
            self._collective_what = "checkpoint"  # the heartbeat says this rank waits in a collective
            try:
                whole = gather_whole_state(sharding, runtime, self._setup, self._next_step - 1)
            except CheckpointError:
                self._collective_what = None
                self._operations_done += 1  # every rank took part, and raises it
                raise
            except GsyncError as error:
                # The ranks' collectives no longer match: the session fails, as after a failed all_reduce.
                raise self._fail(error)
            self._collective_what = None
            self._operations_done += 1
        # The optimizer's state_dict() is the gathered whole state while it is held.
        with sharding.holding(whole) if sharding is not None and whole is not None else contextlib.nullcontext():
            checkpoint = Checkpoint.capture(
                self._next_step - 1, actor.replica, actor.optimizer, scheduler=actor.scheduler, scaler=actor.scaler
            )
        # Between steps, the generators are where the next step starts from.
        return replace(checkpoint, rng_state=self.generators())

    @property
    def checkpoint_gathers(self) -> bool:
        """A ``shard_optimizer=True`` run across processes: :meth:`checkpoint` is a collective every rank takes."""
        context = self._context
        return self.world_size > 1 and context is not None and context.sharding is not None

    def generators(self) -> dict[str, Any] | None:
        """The global random generators' state as a checkpoint keeps it (``None`` across processes)."""
        if self.world_size > 1:
            # Each rank's generators are its own and one rank writes the file:
            # restoring its state on every rank would not continue the run.
            return None
        cuda = [spec.torch_device for spec in self._settings.devices if spec.torch_device.type == "cuda"]
        return capture_rng(cuda)

    # -- the step ----------------------------------------------------------------

    async def step(self, batches: Sequence[Any], last: bool) -> StepResult:
        """One optimizer step over ``batches``; ``last``: no step follows it in this fit (the server frees early)."""
        await self._settle_first()
        self._check_usable("step")
        if not batches:
            raise ConfigError("step() needs at least one batch: step(batch), or step(b1, ..., bN) to accumulate")
        step = self._next_step
        joining = self.joining and self._process_local
        if joining:
            own_rows = [0 if batch is None else batch_rows(batch, f"batch {i} of step {step}") for i, batch in enumerate(batches)]
        else:
            shards, total_rows = self._split(batches, step)
        started = time.perf_counter()
        async with self._operation():
            if joining:
                joined = await self._join(batches, own_rows, step)
                if joined is None:
                    # No rank had a batch: every rank's data has ended, and nothing is trained.
                    return StepResult(step=step, loss=math.nan, lr=math.nan, rows=0, seconds=0.0, world_size=self.world_size)
                shards, total_rows = joined
            weights = tuple(shard.weight for shard in shards)
            # Joined, ranks' rows differ by design and their data ends apart: the step's agreement checks neither.
            local_rows = 0 if joining else sum(sum(shard.rows) for shard in shards)
            _built(self._server_mailbox).post(StepDispatched(step, weights, local_rows, last and not joining))
            for actor, shard in zip(self._actors, shards):
                actor.shards.post(shard)
            loss, applied = await self._await_applied(step)
        self._next_step = step + 1
        self.last_applied_at = time.monotonic()
        runtime = self._runtime
        if runtime is not None and runtime.change_after == step:
            self.change_due = True
        self.replay_pending = False
        if self._snapshot_wanted:
            self._refresh_snapshot()
        return StepResult(
            step=step,
            loss=loss,
            lr=applied.lr,
            rows=total_rows,
            seconds=time.perf_counter() - started,
            grad_norm=applied.grad_norm,
            skipped=applied.skipped,
            world_size=self.world_size,
            lrs=applied.lrs,
        )

    def _split(self, batches: Sequence[Any], step: int) -> tuple[list[Shard], int]:
        """Every local device's shard of the step, after validating every batch; and the step's global rows."""
        per_device: list[tuple[list[int], list[int], list[Any]]] = [([], [], []) for _ in self._actors]
        global_rows = 0
        local_rows: list[tuple[int, ...]] = []
        padded: list[bool] = []
        topology = self._topology
        for batch in batches:
            if batch is None:
                raise ConfigError(
                    f"step {step} was given None for a batch: a rank whose data has ended says so with step(None) "
                    "only in a session of process-local data that joins uneven data: "
                    "engine.session(..., process_local_data=True, uneven='join')"
                )
            rows = batch_rows(batch, f"the batch of step {step}")
            counts, shards = self._split_one(batch, rows)
            total = rows * topology.world_size if self._process_local else rows
            global_rows += total
            local_rows.append(tuple(counts))
            # A global batch with fewer rows than the run's devices may leave a whole process without any.
            padded.append(not self._process_local and topology.world_size > 1 and rows < topology.world_devices)
            for (device_rows, totals, data), count, shard in zip(per_device, counts, shards):
                device_rows.append(count)
                totals.append(total)
                data.append(shard)
        return [
            Shard(step, tuple(r), tuple(t), tuple(d), tuple(local_rows), tuple(padded)) for r, t, d in per_device
        ], global_rows

    async def _join(self, batches: Sequence[Any], own_rows: list[int], step: int) -> tuple[list[Shard], int] | None:
        """Every rank's rows in this step (one small all-reduce), and this process's shards for it.

        A batch position no rank has is left out of the step; ``None`` when no
        rank has any batch.

        :raises ~gsync.ConfigError: on every rank, when the ranks passed different numbers of batches.
        """
        topology = self._topology
        world, count = topology.world_size, len(batches)
        table = torch.zeros(world * (count + 1), dtype=torch.float64)
        table[topology.rank * count : (topology.rank + 1) * count] = torch.tensor(own_rows, dtype=torch.float64)
        table[world * count + topology.rank] = count
        runtime = self._runtime
        if runtime is not None:
            table = await self._collective_job(lambda: runtime.all_reduce(table, "sum"), "joining uneven data")
        counts = [int(c) for c in table[world * count :].tolist()]
        if any(c != count for c in counts):
            raise ConfigError(
                f"the ranks passed {counts} batches to step {step} (rank-major); with uneven='join' every rank passes "
                "as many, None for each one it does not have (fit does so itself)"
            )
        rows = table[: world * count].view(world, count)
        totals = rows.sum(dim=0)
        kept = [p for p in range(count) if totals[p] > 0]
        if not kept:
            return None
        local = topology.local_devices
        per_device: list[tuple[list[int], list[int], list[Any]]] = [([], [], []) for _ in self._actors]
        local_rows: list[tuple[int, ...]] = []
        padded: list[bool] = []
        for p in kept:
            batch = batches[p]
            counts_p, parts = ([0] * local, [None] * local) if batch is None else self._split_one(batch, own_rows[p])
            total = int(totals[p])
            local_rows.append(tuple(counts_p))
            padded.append(bool((rows[:, p] == 0).any()))
            for (device_rows, device_totals, data), rows_p, part in zip(per_device, counts_p, parts):
                device_rows.append(rows_p)
                device_totals.append(total)
                data.append(part)
        shards = [Shard(step, tuple(r), tuple(t), tuple(d), tuple(local_rows), tuple(padded)) for r, t, d in per_device]
        return shards, int(sum(int(totals[p]) for p in kept))

    @property
    def process_local(self) -> bool:
        """Each process feeds its own batches (``process_local_data=True``)."""
        return self._process_local

    async def _await_applied(self, step: int) -> tuple[float, StepApplied]:
        """The step's loss, from the sync server, and the first device's report, once every device applied it."""
        mailbox = _built(self._session_mailbox)
        loss: float | None = None
        first: StepApplied | None = None
        for _ in range(len(self._actors) + 1):
            try:
                message = await mailbox.receive()
            except MailboxClosed:
                # Closed by _serve once a failure is settled: raise that failure itself.
                raise self._failure or SessionClosed("the session closed during a step") from None
            match message:
                case StepLoss(step=at, loss=value) if at == step and loss is None:
                    loss = value
                case StepApplied(step=at) if at == step and loss is not None:
                    first = first or message
                case _:
                    raise SyncFailed(step, None, f"protocol error: {message!r} while waiting for step {step}")
        return _built(loss), _built(first)

    @property
    def resume(self) -> Checkpoint | None:
        """The checkpoint the session started from."""
        return self._resume

    @property
    def runtime(self) -> ProcessGroupRuntime | None:
        """The process group's side of the session, once joined (``None`` in one process)."""
        return self._runtime

    @property
    def failure(self) -> BaseException | None:
        """What closed the session, if it did not end normally."""
        return self._failure

    @property
    def state(self) -> SessionState:
        """Where the session is in its lifecycle (see :mod:`gsync._core.session.state`)."""
        return self._life.state

    @property
    def usable(self) -> bool:
        """Open and not failed: operations may run."""
        return self._life.state in (SessionState.IDLE, SessionState.OPERATING) and self._failure is None

    def request_end(self) -> None:
        """End the session (a close, a drop, a planned membership change): no call starts from now on."""
        self._life.end_asked()
        self.end_requested.set()

    def end_for_change(self) -> None:
        """End the session for a membership change every rank agreed on: the next generation goes on with its
        replicas (:meth:`hold`), so the model passed in is not written back."""
        self._ending_for_change = True
        self.request_end()

    def rewind_generators_for_replay(self) -> None:
        """Before a resumed fit replays its data: the generators as they were when the session opened.

        The replay draws what the interrupted run drew reading the same data
        (a shuffling DataLoader's seed at each ``iter``); the fit restores the
        checkpoint's generators where it continues the run.
        """
        state, self._rng_before_resume = self._rng_before_resume, None
        if state is not None:
            restore_rng(state)

    def current_model(self) -> nn.Module:
        """A module holding the weights of the last step applied (see :attr:`gsync.Session.model`)."""
        operating = self._life.state is SessionState.OPERATING
        if not operating:  # a read while a step runs is refreshed after it
            self._check_usable("model")
        if self._snapshot is None:
            # Made once: the user's model is left as it was until the session closes.
            self._snapshot = copy.deepcopy(self.model)
        if operating:
            self._snapshot_wanted = True  # the step in flight is written in when it is applied
        elif self._snapshot_step != self._next_step - 1:
            self._refresh_snapshot()
        return self._snapshot

    def _refresh_snapshot(self) -> None:
        snapshot = self._snapshot
        if snapshot is None or not self._actors:
            return
        self._snapshot_wanted = False
        self._snapshot_step = self._next_step - 1
        with torch.no_grad():
            snapshot.load_state_dict(self._actors[0].replica.state_dict())

    def threads(self) -> list[threading.Thread]:
        """The session's long-lived threads: the devices', the communication thread and the process group's."""
        workers = [actor.worker for actor in self._actors]
        if self._server is not None:
            workers.append(self._server.comm)
        if self._setup is not None:
            workers.append(self._setup)
        return list({id(worker): worker.thread for worker in workers}.values())

    def loop_handle(self) -> LoopHandle:
        """The loop the session runs on, for posting to it from threads."""
        return _built(self._loop)

@asynccontextmanager
async def open_session(
    settings: EngineSettings,
    model: nn.Module,
    recipe: Recipe,
    *,
    resume: Checkpoint | None,
    process_local_data: bool,
    replay: bool | None = None,
    elastic: ElasticMembership | None = None,
    on_idle_failure: Callable[[], None] | None = None,
    held: HeldState | None = None,
    agreed_start: bool = False,
) -> AsyncIterator[SessionCore]:
    """The life of one session around the user's block; see :meth:`gsync.Engine.session`.

    ``replay``: a fit replays its data up to ``resume`` (default: whenever
    resuming; an elastic generation after the first continues the fit in
    place). ``elastic``: the run this session is one generation of. ``on_idle_failure``: called once a failure
    that no call waits for is settled. ``held``: the last generation's replicas, which this one takes (instead of
    copying ``model`` and loading ``resume``); ``agreed_start``: every rank starts from a state the elastic run
    agreed on (rank 0's is not broadcast).
    """
    session = SessionCore(
        settings, model, recipe, resume, process_local_data, replay=replay, elastic=elastic,
        on_idle_failure=on_idle_failure, held=held, agreed_start=agreed_start,
    )
    raised: BaseException | None = None
    try:
        try:
            await session._start()
            async with anyio.create_task_group() as group:
                group.start_soon(session._serve)
                try:
                    yield session
                except BaseException:
                    raise  # the group cancels everything: nothing to end gracefully
                else:
                    if session._failure is None:
                        session._stop_serving()
                    else:
                        # Failed or cancelled: nothing it holds is to be finished, and a device thread stuck in
                        # native code would keep a graceful end waiting for its sync_timeout. It is left behind.
                        group.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            raised = raised_by_block(errors, session._failure)
        except BaseException as error:  # noqa: BLE001 - sorted below, re-raised unchanged
            raised = error
        if raised is None:
            if session._failure is None:
                await session._announce_departure()
                await session._finish()
            else:
                # The session failed or was cancelled, and then closed: peers still learn of it.
                await session._report(session._cancellation or session._failure)
        else:
            if isinstance(raised, GsyncError) and not isinstance(raised, SessionClosed) and raised is not session._failure:
                session._fail(raised)
            if not session._life.opened:
                # A start interrupted in its collectives (a cancellation): the report below
                # queues behind them in the setup thread, which leaves them on the abort flag.
                session._abort.set()
            # Whatever ended this rank's block (the user's own exception, a
            # cancellation), peers learn of it before the group goes down,
            # instead of waiting in a collective for a rank that has left.
            await session._report(session._failure if isinstance(raised, SessionClosed) and session._failure else raised)
    finally:
        await session._close()
        # Marks how the session ended, writes Engine(trace=path)'s file, ends `raised`'s message with its path.
        await finish_trace(session.trace, settings.trace_file, raised, session._cancellation or session._failure)
    if raised is not None:
        raise raised
