"""What every operation of a session goes through, and the operations that are collectives across processes.

A step, an evaluation and an all_reduce each run as one operation
(:meth:`SessionOperations._operation`): across processes the ranks' n-th
operations meet in collectives, so an operation refuses to start on a
session that cannot take part, and a cancelled one closes the session.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal

import anyio
import torch
from torch import nn

from ..threads import FitAborted
from ..step.actor import DeviceActor, MetricFn
from ..data.batches import batch_rows, shard_rows, split_batch
from ..distributed import peer_failed
from ...errors import ConfigError, DataFailed, GsyncError, InputTypeError, SessionClosed, SyncFailed, SyncTimeout
from ..data.feeder import BatchReader, check_batch_source
from .lifecycle import SessionLife, _built
from .outcome import first_failure, is_cancellation
from .state import SessionState

__all__ = ("ReduceOp", "SessionOperations")

ReduceOp = Literal["sum", "mean", "max", "min"]


class SessionOperations(SessionLife):
    """Operations and their checks; :class:`~gsync._core.session.core.SessionCore` adds the step."""

    # The session's state this part reads and writes (SessionCore sets every one in its __init__).
    _process_local: bool
    _cancellation: BaseException | None

    def cancelled(self, cancellation: BaseException) -> None:
        """A call was cancelled: the session closes, and peers are told of the cancellation."""
        if self._cancellation is None:
            self._cancellation = cancellation
        self._fail(SessionClosed("a call of this session was cancelled midway, so the session is closed"))

    def close_operation(self, reason: str) -> None:
        """End the call in flight with :class:`~gsync.SessionClosed` (``reason``), closing the session as failed.

        The call may be between operations (a fit waiting for its data): the
        session fails all the same, so that the model is left as it was.
        """
        if self.failing or self._failure is not None:
            return  # a failing operation raises that failure itself
        self._fail(SessionClosed(reason))
        if self._op_scope is not None:
            self._op_scope.cancel()

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
        reader = BatchReader(data, _built(self._loop))
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
        return _reduced_as(value, reduced, op, self._topology.world_size)

    def _split_one(self, batch: Any, rows: int) -> tuple[list[int], list[Any]]:
        topology = self._topology
        if self._process_local:
            # This process's own batch; every process's is as large (checked each step).
            return shard_rows(rows, topology.local_devices), split_batch(batch, topology.local_devices)
        return (
            shard_rows(rows, topology.world_devices)[topology.local_slice],
            split_batch(batch, topology.world_devices)[topology.local_slice],
        )

    # -- state checks ------------------------------------------------------------

    @property
    def failing(self) -> bool:
        """The session's task group failed: the failure is being settled, or has been."""
        return self._life.state in (SessionState.FAILING, SessionState.FAILED)

    async def _settle_first(self) -> None:
        """A call made while a failure is being settled waits for it, and then raises it (not a closed session)."""
        if self._life.state is SessionState.FAILING:
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
        state = self._life.state
        if state in (SessionState.FAILING, SessionState.FAILED):
            raise SessionClosed(f"{what}() while the session closes after a failure; the next call (or aclose) raises it")
        if state in (SessionState.CLOSING, SessionState.CLOSED):
            raise SessionClosed(f"{what}() after the session was closed; open a new session")
        if state is SessionState.OPENING:
            raise SessionClosed(f"{what}() on a session that is not open yet: `session = await engine.session(...)` opens it")
        if state is SessionState.OPERATING:
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
        over = _built(self._loop).event()
        scope = anyio.CancelScope()
        self._life.move(SessionState.OPERATING)
        self._op_scope = scope
        self._operation_over = over
        symptom = False
        try:
            with scope:
                yield
        except BaseException as error:
            if not self.failing:
                if is_cancellation(error):
                    self.cancelled(error)
                raise
            # A symptom of the failure being settled (a stopped thread, a closed
            # mailbox): wait for the failure itself and raise it instead.
            with anyio.CancelScope(shield=True):
                await self._settled.wait()
            symptom = True
        finally:
            self._life.operation_over()
            self._op_scope = None
            over.set()
        if symptom or scope.cancelled_caught:
            raise self._failure or SessionClosed("the session closed during an operation")
        self._operations_done += 1

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


def _reduced_as(value: float | torch.Tensor, reduced: float | torch.Tensor, op: str, world_size: int) -> float | torch.Tensor:
    """``all_reduce``'s result for ``value``: its own type, or a float (a floating tensor) for a mean."""
    if isinstance(value, torch.Tensor):
        return reduced / world_size if op == "mean" else reduced
    total = reduced.item() if isinstance(reduced, torch.Tensor) else reduced
    if op == "mean":
        return total / world_size  # a Python division: an int64 sum is divided exactly, not in float32
    return int(total) if isinstance(value, int) else float(total)
