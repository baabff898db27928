"""The session's core: what one open session holds, and the calls its user makes.

:class:`SessionCore` is the engine room behind the public
:class:`gsync.Session` handle. It holds the session's progress (the next
step, the replicas' snapshot) and runs its calls (a step, an evaluation, an
all_reduce, a checkpoint), each through its :class:`~gsync._core.session.calls.CallGate`.
It owns three parts, each with one job:

- its :class:`~gsync._core.session.lifecycle.SessionLife`: the lifecycle, the start,
  serving, a failure settled into one error, and the end;
- the :class:`~gsync._core.session.workers.SessionWorkers` its life drives: actors,
  sync server, threads;
- its :class:`~gsync._core.session.peers.PeerLink`: the other ranks.

:func:`run_generation` is the life of its parts as one anyio task group:
once, or once per membership of an elastic run, the core itself staying
(:meth:`SessionCore.next_generation`). :mod:`gsync._core.session.service`
runs that in a task of its own, so that the handle can be used from any task
of the loop.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import torch
from torch import nn

from ...checkpoint import Checkpoint
from ...errors import CheckpointError, ConfigError, GsyncError, MailboxClosed, SessionClosed, SyncFailed
from ...result import FitStats, StepResult
from ...trace import Trace
from ..data.batches import batch_rows, shard_rows, split_batch
from ..distributed import peer_failed
from ..distributed.runtime import ProcessGroupRuntime
from ..state.held import HeldState
from ..state.rng import capture_rng, restore_rng
from ..step.actor import DeviceActor, MetricFn
from ..step.context import Recipe, Shard
from ..step.messages import StepApplied, StepDispatched, StepLoss
from ..threads import LoopEvent, LoopHandle
from ..topology import Topology
from .assembly import Assembly, session_trace
from .calls import CallGate
from .lifecycle import SessionLife
from .operations import Operation, ReduceOp
from ..base.outcome import raised_by_block
from .peers import PeerLink
from ..sharding.checkpoint import gather_whole_state
from .state import Change, LifecycleError, SessionState

if TYPE_CHECKING:
    from ..elastic.membership import ElasticMembership
    from ..settings import EngineSettings

__all__ = ("ReduceOp", "SessionCore", "run_generation")

_T = TypeVar("_T")
_R = TypeVar("_R")


class SessionCore:
    """One session's state and calls for its whole life; users reach it through :class:`gsync.Session`.

    In an elastic run it outlives every membership change: :meth:`next_generation` swaps what depends on the
    process group (the peer link, the workers built over the group, the call gate) underneath, and the core
    keeps its progress, its trace, its counters and the snapshot :attr:`gsync.Session.model` returns.
    """

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
        agreed_start: bool = False,
    ) -> None:
        self._settings = settings
        self.model = model
        """The module passed in; it receives the trained weights when the block ends and the session did not fail."""
        self._recipe = recipe
        self._resume = resume
        self._process_local = bool(process_local_data)
        self._elastic = elastic
        self._on_idle_failure = on_idle_failure
        self.joins = settings.uneven == "join"
        """The session's own ``uneven="join"`` (``Engine.session(uneven=...)``): a :meth:`step` joins by default."""
        self.first_step = 0 if resume is None else resume.next_step
        """The global index of this session's first step (> 0 when resuming, or when taken into a running run)."""
        self._next_step = self.first_step
        self.last_applied_at: float | None = None
        """When the last step was applied (``time.monotonic()``)."""
        self._replay_from = resume if (resume is not None if replay is None else replay) else None
        self._trace = session_trace(settings)
        self._synced_before = FitStats()
        """The counters of the generations that ended (each generation's sync server counts its own)."""
        self._snapshot: nn.Module | None = None
        self._snapshot_step = -1
        self._snapshot_wanted = False
        self._change: Change | None = None
        self._generations_traced = 0
        """Generations built and recorded on the trace (an engine's one ``Trace`` may have been another session's)."""
        self._begin(resume, None, agreed_start)

    def _begin(
        self, resume: Checkpoint | None, held: HeldState | None, agreed_start: bool, topology: Topology | None = None
    ) -> None:
        """Build the parts that live over one process group (nothing runs until :func:`run_generation`);
        ``topology``: the last generation's, which the session reports until this one has joined its group."""
        self.start_step = self._next_step
        """The step the parts running now started from (the first step after the last membership change)."""
        abort = threading.Event()  # every thread of the generation leaves its wait when it is set
        self._peers = PeerLink(self, abort)
        self._life = SessionLife(
            self._settings, self.model, self._recipe, resume, self._process_local, self._peers, abort,
            first_step=self.start_step, elastic=self._elastic, held=held, agreed_start=agreed_start,
            on_idle_failure=self._on_idle_failure, trace=self._trace,
            topology=topology,
        )
        self._calls = CallGate(self._life, self._peers, abort, self._settings.sync_timeout, self)

    def next_generation(self, held: HeldState | None, agreed_start: bool) -> None:
        """After an elastic membership change, once the last generation's parts have stopped: new parts over the
        new group, starting from ``held`` (the replicas themselves, or a checkpoint handed over; ``None``: the
        initial state, no member having applied a step), which :func:`run_generation` then starts.

        :raises ~gsync._core.session.state.LifecycleError: while the last generation's parts still run (a bug).
        """
        if self._life.state not in (SessionState.CLOSED, SessionState.FAILED):
            raise LifecycleError(f"a new generation while the last one is {self._life.state.value}")
        built = self._life.workers.built
        if built is not None:
            self._synced_before = _added(self._synced_before, built)
        self._change = Change.JOINING
        if held is None:
            # Nobody had applied a step: the run starts over from what the session opened with.
            self._next_step = 0 if self._resume is None else self._resume.next_step
            self._begin(self._resume, None, agreed_start, self._life.topology)
            return
        self._next_step = held.next_step
        replicas = held if held.has_replicas else None
        self._begin(None if replicas is not None else held.checkpoint(), replicas, agreed_start, self._life.topology)

    # -- the parts, as its calls use them ---------------------------------------------------

    @property
    def _parts(self) -> Assembly:
        return self._life.workers.parts

    @property
    def _actors(self) -> list[DeviceActor]:
        return self._life.workers.actors

    @property
    def _topology(self) -> Topology:
        return self._life.topology

    @property
    def life(self) -> SessionLife:
        """The life of the generation it runs now (its start, serving and end; :func:`run_generation` drives it)."""
        return self._life

    # -- public ----------------------------------------------------------------

    @property
    def trace(self) -> Trace | None:
        """The session's timeline, when the engine traces (one for the session's whole life)."""
        return self._trace

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The local replicas' optimizers (see :attr:`gsync.Session.optimizers`)."""
        self._calls.check_now("optimizers")
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
        """The session's counters, summed over its generations; the buckets are the ones it runs now."""
        built = self._life.workers.built
        return self._synced_before if built is None else _added(self._synced_before, built)

    @property
    def resume(self) -> Checkpoint | None:
        """The checkpoint the session started from."""
        return self._resume

    @property
    def runtime(self) -> ProcessGroupRuntime | None:
        """The process group's side of the session, once joined (``None`` in one process)."""
        return self._peers.runtime

    @property
    def process_local(self) -> bool:
        """Each process feeds its own batches (``process_local_data=True``)."""
        return self._process_local

    @property
    def failure(self) -> BaseException | None:
        """What closed the session, if it did not end normally."""
        return self._life.failure

    @property
    def undelivered(self) -> BaseException | None:
        """A failure settled while no operation ran, not yet raised to anyone (the next call or the close raises it)."""
        return self._life.undelivered

    @property
    def end_requested(self) -> anyio.Event:
        """Set when the session should end: closed by its user, or failed (the service then leaves the task group)."""
        return self._life.end_requested

    @property
    def state(self) -> SessionState:
        """Where the session is in its lifecycle (see :mod:`gsync._core.session.state`): its generation's state,
        or ``CHANGING`` from the moment its generation ends for a membership change until the next one is open."""
        return SessionState.CHANGING if self.changing else self._life.state

    @property
    def changing(self) -> bool:
        """Between two generations of an elastic run: the last one ended for a membership change (one every rank
        agreed on, or a loss), and the next one is not open yet."""
        return self._change in (Change.PLANNED, Change.LOST, Change.JOINING)

    @property
    def change(self) -> Change | None:
        """Where an elastic run's membership change stands (``None``: none is due or under way)."""
        return self._change

    @property
    def change_due(self) -> bool:
        """Every rank agreed to change the elastic run's membership after the last step: the next call changes it."""
        return self._change is Change.DUE

    @property
    def change_agreed(self) -> bool:
        """Every rank agreed, in the last step's agreement, to change the membership after it: the change is due
        or under way (a generation that ends for it leaves nobody's loop apart)."""
        return self._change in (Change.DUE, Change.PLANNED)

    @property
    def pending_replay(self) -> Checkpoint | None:
        """Until the first step: the checkpoint a fit on this session replays its data up to (the one it resumed
        from, or the state an elastic run handed it)."""
        return self._replay_from

    @property
    def traced(self) -> bool:
        """Some generation was built and recorded on the trace (a start that failed before that leaves no file)."""
        return self._generations_traced > 0

    @property
    def usable(self) -> bool:
        """Open and not failed: operations may run."""
        return self.state in (SessionState.IDLE, SessionState.OPERATING) and self._life.failure is None

    def take_undelivered(self) -> BaseException | None:
        """The failure settled while no operation ran, once: whoever takes it raises or logs it."""
        return self._life.take_undelivered()

    def request_end(self) -> None:
        """End the session (a close, a drop, a departure): no call starts from now on."""
        self._life.request_end()

    def end_for_change(self) -> None:
        """End the generation for a membership change every rank agreed on: the next generation goes on with its
        replicas (:meth:`hold`), so the model passed in is not written back."""
        self._life.end_for_change()
        self._change = Change.PLANNED

    def lost_generation(self) -> None:
        """The generation ended because a member was lost, and the elastic run goes on with the others (a
        generation ending for a planned change that loses a member on the way stays a planned change: the peers
        still finishing its last step finish it)."""
        if self._change is not Change.PLANNED:
            self._change = Change.LOST

    def generation_open(self) -> None:
        """The generation :func:`run_generation` started is open: calls run on it."""
        self._change = None

    def _describe_trace(self) -> None:
        """Once the generation's parts are built: say on the trace which process it is. In an elastic run that is its
        launch rank and world (``RANK`` and ``WORLD_SIZE`` at launch), which it keeps across changes, as its events
        and errors do (and so does its file's name: a survivor renumbered after a change does not write over the
        file of the process that held its new rank before)."""
        trace, elastic, topology = self._trace, self._elastic, self._topology
        if trace is None:
            return
        self._generations_traced += 1
        devices = [spec.name for spec in self._settings.devices]
        if elastic is not None:
            trace.describe(elastic.launch_rank, elastic.launch_world, devices)
        else:
            trace.describe(topology.rank, topology.world_size, devices)

    def ended(self) -> None:
        """The session opens no further generation (it closed, failed, or its run ended)."""
        self._change = None

    def hold(self, finish: Callable[[Checkpoint], Checkpoint]) -> HeldState | None:
        """Once its generation has ended: the state it leaves the next one (see :meth:`SessionLife.hold`)."""
        return self._life.hold(finish)

    def cancelled(self, cancellation: BaseException) -> None:
        """A call was cancelled: the session closes, and peers are told of the cancellation."""
        self._calls.cancelled(cancellation)

    def close_operation(self, reason: str) -> None:
        """End the call in flight with :class:`~gsync.SessionClosed` (``reason``), closing the session as failed."""
        self._calls.close_call(reason)

    def checkpoint(self) -> Checkpoint:
        """The consistent state as of the last step, copied to the CPU (see :meth:`gsync.Session.checkpoint`).

        With ``shard_optimizer=True`` across processes it is a collective, called on the event loop: every
        rank takes it between the same steps, and the other ranks' slices of the optimizer state are gathered
        in the communication thread while the loop waits (see
        :mod:`~gsync._core.sharding.checkpoint`; :meth:`checkpoint_off_loop` leaves the loop free). It
        counts as one of the session's operations; a failed gather fails the session.

        :raises ~gsync.CheckpointError: when the ranks' optimizer states do not make a whole one.
        """
        self._calls.check_now("checkpoint")
        gather = self._gather()
        if gather is None:
            return self._capture(None)()
        try:
            whole = gather()
        except BaseException as error:
            raise self._gather_failed(error) from None
        return self._capture(self._gathered(whole))()

    async def checkpoint_off_loop(self) -> Checkpoint:
        """:meth:`checkpoint`, its copy (and a sharded run's gather across processes) in a worker thread, so that
        the event loop stays free meanwhile (what a fit takes between its steps)."""
        self._calls.check_now("checkpoint")
        gather = self._gather()
        if gather is None:
            return await anyio.to_thread.run_sync(self._capture(None))
        try:
            whole = await anyio.to_thread.run_sync(gather)
        except BaseException as error:
            raise self._gather_failed(error) from None
        return await anyio.to_thread.run_sync(self._capture(self._gathered(whole)))

    def _gather(self) -> Callable[[], dict[int, dict[str, Any]]] | None:
        """A sharded run's gather of the whole optimizer state across processes (``None`` when there is none to
        make); from now on this rank waits in a collective, as its heartbeat says."""
        sharding = self._parts.sharding
        runtime = self._peers.runtime
        if sharding is None or runtime is None:
            return None
        left = self._peers.departed_before(self._calls.done)
        if left is not None:
            raise self._life.fail(peer_failed(left))
        self._peers.waiting("checkpoint")
        setup, step = self._peers.setup, self._next_step - 1
        return lambda: gather_whole_state(sharding, runtime, setup, step)

    def _gathered(self, whole: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        self._peers.waiting(None)
        self._calls.counted()
        return whole

    def _gather_failed(self, error: BaseException) -> BaseException:
        """What a failed gather raises: a refusal every rank made (the session goes on), or the session's failure."""
        if isinstance(error, CheckpointError):
            self._peers.waiting(None)
            self._calls.counted()  # every rank took part, and raises it
            return error
        if isinstance(error, GsyncError):
            # The ranks' collectives no longer match: the session fails, as after a failed all_reduce.
            return self._life.fail(error)
        return error

    def _capture(self, whole: dict[int, dict[str, Any]] | None) -> Callable[[], Checkpoint]:
        """What copies the checkpoint of the first replica (a sharded optimizer's state is ``whole`` when gathered).

        The replica, the optimizer's sharding and the step are read here, on the loop: the copy may run in a
        thread, while an elastic run's change builds the next generation's parts and moves the step count.
        """
        actor = self._actors[0]
        sharding = self._parts.sharding
        step = self._next_step - 1

        def capture() -> Checkpoint:
            # The optimizer's state_dict() is the gathered whole state while it is held.
            with sharding.holding(whole) if sharding is not None and whole is not None else contextlib.nullcontext():
                checkpoint = Checkpoint.capture(step, actor.replica, actor.optimizer, scheduler=actor.scheduler, scaler=actor.scaler)
            # Between steps, the generators are where the next step starts from.
            return replace(checkpoint, rng_state=self.generators())

        return capture

    @property
    def checkpoint_gathers(self) -> bool:
        """A ``shard_optimizer=True`` run across processes: :meth:`checkpoint` is a collective every rank takes."""
        built = self._life.workers.built
        return self.world_size > 1 and built is not None and built.sharding is not None

    def generators(self) -> dict[str, Any] | None:
        """The global random generators' state as a checkpoint keeps it (``None`` across processes)."""
        if self.world_size > 1:
            # Each rank's generators are its own and one rank writes the file:
            # restoring its state on every rank would not continue the run.
            return None
        cuda = [spec.torch_device for spec in self._settings.devices if spec.torch_device.type == "cuda"]
        return capture_rng(cuda)

    # -- the step ----------------------------------------------------------------

    async def step(self, batches: Sequence[Any], last: bool, joining: bool | None = None) -> StepResult:
        """One optimizer step over ``batches``; ``last``: no step follows it in this fit (the server frees early).

        ``joining`` (default: the session's :attr:`joins`; a fit passes its own ``uneven``): the step starts with
        every rank's rows, so a rank whose data ended joins it with empty shards (``step(None)``).
        """
        await self._calls.check("step")
        if not batches:
            raise ConfigError("step() needs at least one batch: step(batch), or step(b1, ..., bN) to accumulate")
        step = self._next_step
        joining = (self.joins if joining is None else joining) and self._process_local
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
            self._parts.server_mailbox.post(StepDispatched(step, weights, local_rows, last and not joining))
            for actor, shard in zip(self._actors, shards):
                actor.shards.post(shard)
            loss, applied = await self._await_applied(step)
        self._next_step = step + 1
        self.last_applied_at = time.monotonic()
        self._peers.stepped()
        runtime = self._peers.runtime
        if runtime is not None and runtime.change_after == step:
            self._change = Change.DUE
        self._replay_from = None
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
            counts, shards = self.split_one(batch, rows)
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
        runtime = self._peers.runtime
        if runtime is not None:
            table = await self.collective(lambda: runtime.all_reduce(table, "sum"), "joining uneven data")
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
            counts_p, parts = ([0] * local, [None] * local) if batch is None else self.split_one(batch, own_rows[p])
            total = int(totals[p])
            local_rows.append(tuple(counts_p))
            padded.append(bool((rows[:, p] == 0).any()))
            for (device_rows, device_totals, data), rows_p, part in zip(per_device, counts_p, parts):
                device_rows.append(rows_p)
                device_totals.append(total)
                data.append(part)
        shards = [Shard(step, tuple(r), tuple(t), tuple(d), tuple(local_rows), tuple(padded)) for r, t, d in per_device]
        return shards, int(sum(int(totals[p]) for p in kept))

    async def _await_applied(self, step: int) -> tuple[float, StepApplied]:
        """The step's loss, from the sync server, and the first device's report, once every device applied it."""
        mailbox = self._parts.session_mailbox
        loss: float | None = None
        first: StepApplied | None = None
        for _ in range(len(self._actors) + 1):
            try:
                message = await mailbox.receive()
            except MailboxClosed:
                # Closed by the life once a failure is settled: raise that failure itself.
                raise self._life.failure or SessionClosed("the session closed during a step") from None
            match message:
                case StepLoss(step=at, loss=value) if at == step and loss is None:
                    loss = value
                case StepApplied(step=at) if at == step and loss is not None:
                    first = first or message
                case _:
                    raise SyncFailed(step, None, f"protocol error: {message!r} while waiting for step {step}")
        if loss is None or first is None:
            raise SyncFailed(step, None, f"protocol error: step {step} ended without its loss or its report")
        return loss, first

    # -- evaluate and all_reduce ------------------------------------------------------

    async def run(self, operation: Operation[_R, Any]) -> _R:
        """A collective call of the session (an evaluation, an all_reduce) through its call gate; its result as every
        rank holds it (:meth:`Operation.delivered` turns it into what the caller gets)."""
        return await self._calls.run(operation, self)

    # -- what an operation runs on (OperationSite) -------------------------------------

    @property
    def last_step(self) -> int:
        """The last step applied (-1 before the first)."""
        return self._next_step - 1

    def loss_fn(self) -> MetricFn:
        loss_fn = self._recipe.loss_fn

        def loss(model: nn.Module, shard: Any) -> Any:
            return loss_fn(model, shard)

        return loss

    def first_calls_in_turn(self) -> bool:
        parts = self._parts
        return parts.context.first_step is not None and parts.server.steps_synced == 0

    async def collective(self, job: Callable[[], _T], what: str) -> _T:
        """``job`` in the communication thread, after anything it already holds, within ``sync_timeout``."""
        return await self._calls.collective_job(self._parts.server.comm, job, what, self.last_step)  # type: ignore[no-any-return]

    def split_one(self, batch: Any, rows: int) -> tuple[list[int], list[Any]]:
        """This process's devices' rows and shards of one batch."""
        topology = self._topology
        if self._process_local:
            # This process's own batch; every process's is as large (checked each step).
            return shard_rows(rows, topology.local_devices), split_batch(batch, topology.local_devices)
        return (
            shard_rows(rows, topology.world_devices)[topology.local_slice],
            split_batch(batch, topology.world_devices)[topology.local_slice],
        )

    def _operation(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._calls.operation(self.loop_handle())

    # -- between calls --------------------------------------------------------------

    def rewind_generators_for_replay(self) -> None:
        """Before a resumed fit replays its data: the generators as they were when the session opened.

        The replay draws what the interrupted run drew reading the same data
        (a shuffling DataLoader's seed at each ``iter``); the fit restores the
        checkpoint's generators where it continues the run.
        """
        state = self._life.take_rng_before_resume()
        if state is not None:
            restore_rng(state)

    def current_model(self) -> nn.Module:
        """A module holding the weights of the last step applied (see :attr:`gsync.Session.model`)."""
        operating = self._life.state is SessionState.OPERATING
        if not operating:  # a read while a step runs is refreshed after it
            self._calls.check_now("model")
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
        workers = self._life.workers.threads() + self._peers.threads()
        return list({id(worker): worker.thread for worker in workers}.values())

    def loop_handle(self) -> LoopHandle:
        """The loop the session runs on, for posting to it from threads."""
        loop = self._life.loop
        if loop is None:
            raise SessionClosed("the session is not open: use it inside `async with engine.session(...)`")
        return loop

    # -- what the peer link reads (SessionView) -----------------------------------------

    @property
    def opened(self) -> bool:
        """The start finished: what this rank reports to peers is the fit's, not the start's."""
        return self._life.opened

    @property
    def operations_done(self) -> int:
        """Steps, evaluations and all_reduces completed (across processes, the ranks' n-th meet)."""
        return self._calls.done

    def call_over(self) -> LoopEvent | None:
        """Set when the call in flight ends; ``None`` while no call runs."""
        return self._calls.over()

    def devices(self) -> list[DeviceActor]:
        return self._actors


@asynccontextmanager
async def run_generation(core: SessionCore) -> AsyncIterator[SessionCore]:
    """The life of the parts ``core`` runs now (one generation: the whole session outside an elastic run), as one
    anyio task group around the user's block; see :meth:`gsync.Engine.session`.

    Writing the trace file is left to whoever ends the session (the service), once for its whole life.
    """
    life, peers = core.life, core._peers
    raised: BaseException | None = None
    try:
        await life.start()
        core._describe_trace()
        async with anyio.create_task_group() as group:
            group.start_soon(life.serve)
            try:
                yield core
            except BaseException:
                raise  # the group cancels everything: nothing to end gracefully
            else:
                if life.failure is None:
                    life.end_of_data()
                else:
                    # Failed or cancelled: nothing it holds is to be finished, and a device thread stuck in
                    # native code would keep a graceful end waiting for its sync_timeout. It is left behind.
                    group.cancel_scope.cancel()
    except BaseExceptionGroup as errors:
        raised = raised_by_block(errors, life.failure)
    except BaseException as error:  # noqa: BLE001 - sorted below, re-raised unchanged
        raised = error
    try:
        if raised is None:
            if life.failure is None:
                await peers.announce_departure()
                await life.finish()
            else:
                # The session failed or was cancelled, and then closed: peers still learn of it.
                await peers.report(life.cancellation or life.failure)
        else:
            if isinstance(raised, GsyncError) and not isinstance(raised, SessionClosed) and raised is not life.failure:
                life.fail(raised)
            # A start interrupted in its collectives (a cancellation): the report below queues behind them.
            life.interrupted_start()
            # Whatever ended this rank's block (the user's own exception, a
            # cancellation), peers learn of it before the group goes down,
            # instead of waiting in a collective for a rank that has left.
            await peers.report(life.failure if isinstance(raised, SessionClosed) and life.failure else raised)
    finally:
        await life.close()
    if raised is not None:
        raise raised


def _added(before: FitStats, built: Assembly) -> FitStats:
    """``before`` (the generations that ended) and the counters of the parts ``built``; the buckets are theirs."""
    server, plan = built.server, built.server.plan
    return FitStats(
        steps=before.steps + server.steps_synced,
        buckets=len(plan.buckets),
        bucket_ready_messages=before.bucket_ready_messages + server.bucket_ready_received,
        bucket_sizes=tuple(b.nbytes for b in plan.buckets),
        bucket_params=tuple(tuple(plan.names[p] for p in b.params) for b in plan.buckets),
        rebuilt_buckets=before.rebuilt_buckets or built.rebuild.rebuilt,
        reduced_bytes=before.reduced_bytes + server.reduced_bytes,
    )
