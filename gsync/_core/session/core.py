"""The session's core: what one open session holds and does, from its start to its teardown.

:class:`SessionCore` is the engine room behind the public
:class:`gsync.Session` handle: it starts the session (replicas, actors,
server, threads, the process group), runs its operations (a step, an
evaluation, an all_reduce, a checkpoint) and turns whatever fails into one
error with a checkpoint; starting, serving and closing are
:class:`~gsync._core.session.lifecycle.SessionLife`'s, which it extends.
:func:`open_session` is its life as one anyio task
group; :mod:`gsync._core.session.service` runs that life in a task of its own, so
that the handle can be used from any task of the loop.

A failure raised to a caller of an operation is *delivered*; one settled
while no operation runs (a peer lost between steps, a late device error) is
kept as :attr:`SessionCore.undelivered` until a call or the close raises it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_thread
import torch
from torch import nn

from ..threads import FitAborted, LoopEvent, LoopHandle, WorkerThread
from ..step.actor import DeviceActor, MetricFn
from ..data.batches import batch_rows, shard_rows, split_batch
from ..gradients.buffers import BufferSync
from ...checkpoint import Checkpoint
from ...comm.base import Collective
from ..step.context import ActorContext, Recipe, Shard
from ..distributed import FailureReport, peer_failed
from ..distributed.runtime import ProcessGroupRuntime
from ..elastic.watcher import ReformWatcher
from ...errors import (
    ConfigError,
    DataFailed,
    GsyncError,
    InputTypeError,
    LostRank,
    MailboxClosed,
    SessionClosed,
    SyncFailed,
    SyncTimeout,
)
from ..data.feeder import BatchReader, check_batch_source
from ..step.mailbox import Mailbox
from ..step.messages import ServerMessage, SessionMessage, StepApplied, StepDispatched, StepLoss
from .outcome import first_failure, is_cancellation, raised_by_block
from .lifecycle import SessionLife, _built
from ..gradients.rebuild import PlanRebuild
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

ReduceOp = Literal["sum", "mean", "max", "min"]
logger = logging.getLogger("gsync")


class SessionCore(SessionLife):
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
    ) -> None:
        self._settings = settings
        self._elastic = elastic
        self._watcher: ReformWatcher | None = None
        self.change_due = False
        """Every rank agreed to change the elastic run's membership after the last step: the next call changes it."""
        self.data_position: tuple[int, int] | None = None
        """``(epoch, batches)`` of the fit's data consumed through the last step (set by the fit loop), for a joiner."""
        self.last_applied_at: float | None = None
        """When the last step was applied (``time.monotonic()``)."""
        self.model = model
        """The module passed in; it receives the trained weights when the block ends and the session did not fail."""
        self._recipe = recipe
        self._resume = resume
        self._process_local = bool(process_local_data)
        self.first_step = 0 if resume is None else resume.next_step
        """The global index of this session's first step (> 0 when resuming)."""
        self._next_step = self.first_step
        self._abort = threading.Event()
        self._open = False
        self._started = False
        self._ended = False
        self._stepping = False
        self._operations_done = 0
        self._operation_over: LoopEvent | None = None
        self._op_scope: anyio.CancelScope | None = None
        self._failing = False
        self._settled = anyio.Event()
        self._checkpoint_attempted: set[int] = set()
        self._failure: BaseException | None = None
        self._reported: BaseException | None = None
        self._peer_left: FailureReport | None = None
        # What the failure watcher and the heartbeat heard of other ranks, first news first.
        self._peer_news: list[FailureReport | list[LostRank] | str] = []
        self._peer_news_arrived = anyio.Event()
        self._torn_down = False
        self._collective_what: str | None = None
        self.undelivered: BaseException | None = None
        """A failure settled while no operation ran, not yet raised to anyone (the next call or the close raises it)."""
        self.end_requested = anyio.Event()
        """Set when the session should end: closed by its user, or failed (the service then leaves the task group)."""
        self.on_idle_failure: Callable[[], None] | None = None
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

    async def evaluate(self, data: Iterable[Any] | AsyncIterable[Any], *, metric_fn: MetricFn | None = None) -> dict[str, float]:
        """Row-weighted metric sums over every global batch of ``data``, as global means (see :meth:`gsync.Session.evaluate`)."""
        await self._settle_first()
        self._check_usable("evaluate")
        check_batch_source(data)
        if metric_fn is not None and not callable(metric_fn):
            raise InputTypeError("metric_fn must be callable as metric_fn(model, shard) -> scalar or dict of scalars")
        loss_fn = self._recipe.loss_fn

        def loss(model: nn.Module, shard: Any) -> Any:
            return loss_fn(model, shard)

        fn = metric_fn if metric_fn is not None else loss
        failure: BaseException | None = None
        try:
            async with self._operation():
                names, totals = await self._evaluate(data, fn)
        except BaseExceptionGroup as errors:
            failure = first_failure(errors)
        except GsyncError as error:
            failure = error
        if failure is not None:
            raise self._fail(failure)
        total_rows = float(totals[-1])
        if total_rows == 0:
            raise ConfigError("evaluate() got no rows: data yielded nothing")
        return {name: float(value) / total_rows for name, value in zip(names, totals[:-1].tolist())}

    async def _evaluate(self, data: Iterable[Any] | AsyncIterable[Any], fn: MetricFn) -> tuple[list[str], torch.Tensor]:
        """Row-weighted metric sums over every batch and local device, then over every process."""
        sums: dict[str, float] = {}
        rows_seen = 0
        after = self._next_step - 1
        reader = BatchReader(data, self.loop_handle())
        # Before the session's first step, a CPU device's first shard makes its first calls into torch's kernels:
        # one device at a time, as in that step (FirstStepInTurn), until each has had rows to evaluate.
        in_turn = _built(self._context).first_step is not None and _built(self._server).steps_synced == 0
        first_calls = set(range(len(self._actors))) if in_turn else set()
        try:
            async with aclosing(reader.batches(lambda read: DataFailed(after, site="evaluate", batch=read))) as batches:
                number = 0
                async for batch in batches:
                    rows = batch_rows(batch, f"evaluate's batch {number} (from 0)")
                    number += 1
                    counts, shards = self._split_one(batch, rows)
                    results: list[dict[str, float]] = [{} for _ in self._actors]

                    async def run(index: int, actor: DeviceActor, shard: Any, count: int) -> None:
                        results[index] = await actor.evaluate(shard, count, fn, after)

                    work = list(enumerate(zip(self._actors, shards, counts)))
                    with_rows = {index for index, count in enumerate(counts) if count > 0}
                    if first_calls & with_rows:
                        first_calls -= with_rows
                        for index, (actor, shard, count) in work:
                            await run(index, actor, shard, count)
                    else:
                        async with anyio.create_task_group() as group:
                            for index, (actor, shard, count) in work:
                                group.start_soon(run, index, actor, shard, count)
                    for values in results:
                        for name, value in values.items():
                            sums[name] = sums.get(name, 0.0) + value
                    rows_seen += sum(counts)
        finally:
            await reader.close()
        names = sorted(sums)
        runtime = self._runtime
        if runtime is not None:
            # A rank whose devices saw no rows, or a metric whose keys depend on
            # the data, knows other names: reduce over the union, in one order.
            local = names
            names = await self._collective_job(lambda: runtime.union_of_names(local), "evaluate")
        totals = torch.tensor([sums.get(name, 0.0) for name in names] + [float(rows_seen)], dtype=torch.float64)
        if runtime is not None:
            totals = await self._collective_job(lambda: runtime.all_reduce(totals, "sum"), "evaluate")
        return names, totals

    async def all_reduce(self, value: float | torch.Tensor, op: ReduceOp = "sum") -> float | torch.Tensor:
        """One value per process combined over every process (see :meth:`gsync.Session.all_reduce`)."""
        if op not in ("sum", "mean", "max", "min"):
            raise ConfigError(f"op must be 'sum', 'mean', 'max' or 'min', got {op!r}")
        is_tensor = isinstance(value, torch.Tensor)
        if not is_tensor and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputTypeError(f"all_reduce takes a number or a tensor, got {type(value).__name__}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ConfigError(f"all_reduce reduces an int as int64; {value} does not fit: pass a float, or scale it")
        if op == "mean" and isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex():
            # Averaged as float64: an integer or bool sum would overflow, and a bool sum is an OR on some backends.
            value = value.to(torch.float64)
        await self._settle_first()
        self._check_usable("all_reduce")
        runtime = self._runtime
        if runtime is None:
            return _reduced_as(value, value, op, 1)
        if is_tensor:
            tensor = value.detach().clone()  # type: ignore[union-attr]
        else:
            tensor = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
        failure: GsyncError | None = None
        try:
            async with self._operation():
                reduced = await self._collective_job(
                    lambda: runtime.all_reduce(tensor, "sum" if op == "mean" else op), "all_reduce"
                )
        except GsyncError as error:
            failure = error
        if failure is not None:
            raise self._fail(failure)
        return _reduced_as(value, reduced, op, self.world_size)

    def checkpoint(self) -> Checkpoint:
        """The consistent state as of the last step, copied to the CPU (see :meth:`gsync.Session.checkpoint`)."""
        self._check_usable("checkpoint")
        actor = self._actors[0]
        checkpoint = Checkpoint.capture(
            self._next_step - 1, actor.replica, actor.optimizer, scheduler=actor.scheduler, scaler=actor.scaler
        )
        # Between steps, the generators are where the next step starts from.
        return replace(checkpoint, rng_state=self.generators())

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
        if self._failing:
            await self._settle_first()
        self._check_usable("step")
        if not batches:
            raise ConfigError("step() needs at least one batch: step(batch), or step(b1, ..., bN) to accumulate")
        step = self._next_step
        shards, total_rows = self._split(batches, step)
        weights = tuple(shard.weight for shard in shards)
        local_rows = sum(sum(shard.rows) for shard in shards)
        started = time.perf_counter()
        async with self._operation():
            _built(self._server_mailbox).post(StepDispatched(step, weights, local_rows, last))
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
        )

    def _split(self, batches: Sequence[Any], step: int) -> tuple[list[Shard], int]:
        """Every local device's shard of the step, after validating every batch; and the step's global rows."""
        per_device: list[tuple[list[int], list[int], list[Any]]] = [([], [], []) for _ in self._actors]
        global_rows = 0
        for batch in batches:
            rows = batch_rows(batch, f"the batch of step {step}")
            counts, shards = self._split_one(batch, rows)
            total = rows * self._topology.world_size if self._process_local else rows
            global_rows += total
            for (device_rows, totals, data), count, shard in zip(per_device, counts, shards):
                device_rows.append(count)
                totals.append(total)
                data.append(shard)
        return [Shard(step, tuple(r), tuple(t), tuple(d)) for r, t, d in per_device], global_rows

    def _split_one(self, batch: Any, rows: int) -> tuple[list[int], list[Any]]:
        topology = self._topology
        if self._process_local:
            # This process's own batch; every process's is as large (checked each step).
            return shard_rows(rows, topology.local_devices), split_batch(batch, topology.local_devices)
        return (
            shard_rows(rows, topology.world_devices)[topology.local_slice],
            split_batch(batch, topology.world_devices)[topology.local_slice],
        )

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

    # -- state checks ------------------------------------------------------------

    async def _settle_first(self) -> None:
        """A call made while a failure is being settled waits for it, and then raises it (not a closed session)."""
        if self._failing:
            with anyio.CancelScope(shield=True):
                await self._settled.wait()

    def _check_usable(self, what: str) -> None:
        undelivered = self.undelivered
        if undelivered is not None:
            # The failure itself, once, with its checkpoint: nothing has raised it yet.
            self.undelivered = None
            raise undelivered
        failure = self._failure
        if failure is not None:
            closed = SessionClosed(
                f"{what}() on a session that failed ({type(failure).__name__}: {failure}); "
                "open a new session, with resume=error.checkpoint to continue"
            )
            # The state to resume from travels with every later refusal, not only with the failure itself.
            closed.last_step = getattr(failure, "last_step", None)
            closed.checkpoint = getattr(failure, "checkpoint", None)
            raise closed from failure
        if not self._open:
            if self._failing:
                raise SessionClosed(f"{what}() while the session closes after a failure; the next call (or aclose) raises it")
            if self._ended:
                raise SessionClosed(f"{what}() after the session was closed; open a new session")
            raise SessionClosed(f"{what}() on a session that is not open yet: `session = await engine.session(...)` opens it")
        if self._stepping:
            raise ConfigError(
                f"{what}() while another task is inside step(), evaluate() or all_reduce() of this session; a "
                "session does one thing at a time: await each call before the next"
            )

    @asynccontextmanager
    async def _operation(self) -> AsyncIterator[None]:
        """One step, evaluate or all_reduce; across processes the ranks' n-th operations meet in collectives.

        - A peer that left its session after ``n`` operations makes this
          rank's next one, if it is the (n+1)-th or later, raise :class:`~gsync.PeerFailed`.
        - If the session fails meanwhile (a device, a collective, a peer), the
          operation is cancelled and raises that failure.
        - If the caller cancels it midway, the session is closed: devices may
          be inside the step, and across processes the ranks' collectives
          would no longer match.
        """
        left = self._peer_left
        if left is not None and self._operations_done >= left.operations:
            raise self._fail(peer_failed(left))
        over = self.loop_handle().event()
        scope = anyio.CancelScope()
        self._op_scope = scope
        self._operation_over = over
        self._stepping = True
        symptom = False
        try:
            with scope:
                yield
        except BaseException as error:
            if not self._failing:
                if is_cancellation(error):
                    self.cancelled(error)
                raise
            # A symptom of the failure being settled (a stopped thread, a closed
            # mailbox): wait for the failure itself and raise it instead.
            with anyio.CancelScope(shield=True):
                await self._settled.wait()
            symptom = True
        finally:
            self._stepping = False
            self._op_scope = None
            over.set()
        if symptom or scope.cancelled_caught:
            raise self._failure or SessionClosed("the session closed during an operation")
        self._operations_done += 1

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
    def usable(self) -> bool:
        """Open and not failed: operations may run."""
        return self._open and self._failure is None

    @property
    def busy(self) -> bool:
        """A step, evaluate or all_reduce runs."""
        return self._stepping

    def rewind_generators_for_replay(self) -> None:
        """Before a resumed fit replays its data: the generators as they were when the session opened.

        The replay draws what the interrupted run drew reading the same data
        (a shuffling DataLoader's seed at each ``iter``); the fit restores the
        checkpoint's generators where it continues the run.
        """
        state, self._rng_before_resume = self._rng_before_resume, None
        if state is not None:
            restore_rng(state)

    def cancelled(self, cancellation: BaseException) -> None:
        """A call was cancelled: the session closes, and peers are told of the cancellation."""
        if self._cancellation is None:
            self._cancellation = cancellation
        self._fail(SessionClosed("a call of this session was cancelled midway, so the session is closed"))

    def close_operation(self, reason: str) -> None:
        """End the operation in flight with :class:`~gsync.SessionClosed` (``reason``), closing the session."""
        scope = self._op_scope
        if scope is not None and not self._failing:  # a failing operation raises that failure itself
            self._fail(SessionClosed(reason))
            scope.cancel()

    def current_model(self) -> nn.Module:
        """A module holding the weights of the last step applied (see :attr:`gsync.Session.model`)."""
        if not (self._stepping and self._failure is None):  # a read while a step runs is refreshed after it
            self._check_usable("model")
        if self._snapshot is None:
            # Made once: the user's model is left as it was until the session closes.
            self._snapshot = copy.deepcopy(self.model)
        if self._stepping:
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

    async def _collective_job(self, job: Callable[[], Any], what: str) -> Any:
        """Run a collective in the communication thread, after anything it already holds, within ``sync_timeout``.

        :raises ~gsync.SyncFailed: when the collective raises (a peer's
            reported failure, if any, is raised instead: :class:`~gsync.PeerFailed`).
        :raises ~gsync.SyncTimeout: when it does not complete in time.
        """
        server = _built(self._server)
        timeout = self._settings.sync_timeout
        step = self._next_step - 1
        failure: GsyncError | None = None
        # Stays set if the collective fails: this rank was waiting in it (its heartbeat says so while it blames).
        self._collective_what = what
        with anyio.move_on_after(timeout):
            try:
                result = await server.comm.run(job)
            except (GsyncError, FitAborted):
                raise
            except Exception as error:  # noqa: BLE001 - the transport's error becomes gsync's, chained
                failure = SyncFailed(step, None, site=what)
                failure.__cause__ = error
            else:
                self._collective_what = None
                return result
        if failure is None:
            self._abort.set()  # the collective's thread leaves its wait
            failure = SyncTimeout(step, timeout, site=what)
        runtime = self._runtime
        if runtime is not None:
            blamed = failure
            failure = await self._in_setup(lambda: runtime.blame_peer(blamed), failure)
        raise failure


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
) -> AsyncIterator[SessionCore]:
    """The life of one session around the user's block; see :meth:`gsync.Engine.session`.

    ``replay``: a fit replays its data up to ``resume`` (default: whenever
    resuming; an elastic generation after the first continues the fit in
    place). ``elastic``: the run this session is one generation of.
    """
    session = SessionCore(settings, model, recipe, resume, process_local_data, replay=replay, elastic=elastic)
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
                    session._stop_serving()
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
            if not session._started:
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


def _reduced_as(value: float | torch.Tensor, reduced: float | torch.Tensor, op: str, world_size: int) -> float | torch.Tensor:
    """``all_reduce``'s result for ``value``: its own type, or a float (a floating tensor) for a mean."""
    if isinstance(value, torch.Tensor):
        return reduced / world_size if op == "mean" else reduced
    total = reduced.item() if isinstance(reduced, torch.Tensor) else reduced
    if op == "mean":
        return total / world_size  # a Python division: an int64 sum is divided exactly, not in float32
    return int(total) if isinstance(value, int) else float(total)
