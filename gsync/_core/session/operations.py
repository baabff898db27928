"""A session's collective calls as objects: what each checks, its local part, its collective part, whether it can be
redone, and how its result reaches the caller.

An :class:`Operation` is run by the session's one call gate
(:meth:`~gsync._core.session.calls.CallGate.run`), which refuses it on a
session that cannot take it, counts it (across processes the ranks' n-th
operations meet), and fails the session if it fails; an elastic run's carry
(:meth:`~gsync._core.session.service.SessionService.carried`) redoes it over
the next membership, or takes a peer's result, by what the operation says of
itself. The step is not an Operation yet: it passes the same gate's check
and is counted by the same ``operation()``, but a failure inside it is the
session's settled failure already, and a bad batch it finds must not fail the
session, which ``run``'s rule would.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from contextlib import aclosing
from typing import Any, Literal, Protocol, TypeVar

import anyio
import torch

from ...errors import ConfigError, DataFailed, InputTypeError
from ..data.batches import batch_rows
from ..data.feeder import BatchReader, check_batch_source
from ..distributed.runtime import ProcessGroupRuntime
from ..step.actor import DeviceActor, MetricFn
from ..threads import LoopHandle

__all__ = ("AllReduce", "Evaluate", "Operation", "OperationSite", "ReduceOp", "local_metric_sums", "reduced_as")

ReduceOp = Literal["sum", "mean", "max", "min"]
Split = Callable[[Any, int], tuple[list[int], list[Any]]]
_T = TypeVar("_T")
_R = TypeVar("_R")
_T_co = TypeVar("_T_co", covariant=True)
_Totals = tuple[list[str], torch.Tensor]


class OperationSite(Protocol):
    """What an operation runs on: the session's devices, its loop, and its collectives (the session core)."""

    @property
    def runtime(self) -> ProcessGroupRuntime | None:
        """The process group's side, across processes; ``None`` in one process."""

    @property
    def world_size(self) -> int: ...

    @property
    def last_step(self) -> int:
        """The last step applied (what errors name)."""

    def devices(self) -> Sequence[DeviceActor]: ...

    def loop_handle(self) -> LoopHandle: ...

    def split_one(self, batch: Any, rows: int) -> tuple[list[int], list[Any]]:
        """This process's devices' rows and shards of one batch."""

    def first_calls_in_turn(self) -> bool:
        """Before the first step, a CPU device's first calls into torch run one device at a time."""

    def loss_fn(self) -> MetricFn:
        """The recipe's loss, as an evaluation's default metric."""

    async def collective(self, job: Callable[[], _T], what: str) -> _T:
        """``job`` in the communication thread, within ``sync_timeout``."""


class Operation(Protocol[_R, _T_co]):
    """A call every rank makes together: the call gate runs it, an elastic run's carry redoes it or hands it over.

    ``_R`` is what :meth:`run` returns, the same on every rank (what an
    elastic run's log keeps and hands to a member one operation behind);
    ``_T_co`` is what the caller gets of it (:meth:`delivered`).
    """

    @property
    def what(self) -> str:
        """The call's name, in a refusal (``"evaluate"``)."""

    @property
    def kind(self) -> str:
        """What every rank must call alike at this point, arguments included (``"all_reduce(op='sum')"``)."""

    @property
    def redoable(self) -> bool:
        """Interrupted by a membership change, it is redone over the next membership (its input can be read again)."""

    @property
    def input_first(self) -> bool:
        """Its input is checked before the session is asked (else after: a failure the session settled while no
        call ran is what the call raises, with its checkpoint, rather than a complaint about the input)."""

    def check(self) -> None:
        """Refuse bad input before anything runs (the session stays open).

        :raises ~gsync.ConfigError, ~gsync.InputTypeError: what to change.
        """

    async def run(self, site: OperationSite) -> _R:
        """The local part on this process's devices, then the collective part across processes."""

    def delivered(self, result: _R) -> _T_co:
        """``result`` (its own, or one a peer handed over after a change) as the caller receives it; what is wrong
        with it (an evaluation that saw no rows) is raised here, on every rank alike, without failing the session.
        """


class Evaluate:
    """``session.evaluate``: row-weighted metric sums over every global batch, as global means."""

    what = "evaluate"
    kind = "evaluate()"
    input_first = False

    def __init__(self, data: Iterable[Any] | AsyncIterable[Any], metric_fn: MetricFn | None, *, redoable: bool) -> None:
        self._data = data
        self._metric_fn = metric_fn
        self.redoable = redoable
        """An iterable that can be read again: over a membership change the evaluation restarts from its first batch."""

    def check(self) -> None:
        check_batch_source(self._data)
        if self._metric_fn is not None and not callable(self._metric_fn):
            raise InputTypeError("metric_fn must be callable as metric_fn(model, shard) -> scalar or dict of scalars")

    async def run(self, site: OperationSite) -> _Totals:
        """The metrics' names and their sums over every process, the rows seen last."""
        fn = self._metric_fn if self._metric_fn is not None else site.loss_fn()
        sums, rows_seen = await local_metric_sums(
            list(site.devices()), self._data, site.loop_handle(), site.split_one, fn, site.last_step,
            in_turn=site.first_calls_in_turn(),
        )
        names = sorted(sums)
        runtime = site.runtime
        if runtime is not None:
            # A rank whose devices saw no rows, or a metric whose keys depend on
            # the data, knows other names: reduce over the union, in one order.
            local = names
            names = await site.collective(lambda: runtime.union_of_names(local), "evaluate")
        totals = torch.tensor([sums.get(name, 0.0) for name in names] + [float(rows_seen)], dtype=torch.float64)
        if runtime is not None:
            totals = await site.collective(lambda: runtime.all_reduce(totals, "sum"), "evaluate")
        return names, totals

    def delivered(self, result: _Totals) -> dict[str, float]:
        names, totals = result
        total_rows = float(totals[-1])
        if total_rows == 0:
            raise ConfigError("evaluate() got no rows: data yielded nothing")
        return {name: float(value) / total_rows for name, value in zip(names, totals[:-1].tolist())}


class AllReduce:
    """``session.all_reduce``: one number or tensor per process, combined over every process."""

    what = "all_reduce"
    redoable = True  # every survivor still holds its value
    input_first = True

    def __init__(self, value: float | torch.Tensor, op: ReduceOp) -> None:
        self._value = value
        self._op = op
        self.kind = f"all_reduce(op={op!r})"

    def check(self) -> None:
        op, value = self._op, self._value
        if op not in ("sum", "mean", "max", "min"):
            raise ConfigError(f"op must be 'sum', 'mean', 'max' or 'min', got {op!r}")
        if not isinstance(value, torch.Tensor) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputTypeError(f"all_reduce takes a number or a tensor, got {type(value).__name__}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ConfigError(f"all_reduce reduces an int as int64; {value} does not fit: pass a float, or scale it")

    async def run(self, site: OperationSite) -> float | torch.Tensor:
        value, op = self._value, self._op
        if op == "mean" and isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex():
            # Averaged as float64: an integer or bool sum would overflow, and a bool sum is an OR on some backends.
            value = value.to(torch.float64)
        runtime = site.runtime
        if runtime is None:
            return reduced_as(value, value, op, 1)
        if isinstance(value, torch.Tensor):
            tensor = value.detach().clone()
        else:
            tensor = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
        reduced = await site.collective(lambda: runtime.all_reduce(tensor, "sum" if op == "mean" else op), "all_reduce")
        return reduced_as(value, reduced, op, site.world_size)

    def delivered(self, result: float | torch.Tensor) -> float | torch.Tensor:
        if isinstance(self._value, torch.Tensor) and isinstance(result, torch.Tensor):
            return result.to(self._value.device)  # a result handed over by a peer after a change arrives on the CPU
        return result


async def local_metric_sums(
    actors: list[DeviceActor],
    data: Iterable[Any] | AsyncIterable[Any],
    loop: LoopHandle,
    split: Split,
    fn: MetricFn,
    after: int,
    *,
    in_turn: bool,
) -> tuple[dict[str, float], int]:
    """Row-weighted sums of ``fn`` over every batch of ``data`` and every local device, and the rows seen.

    ``split(batch, rows)``: this process's devices' rows and shards of a
    batch. ``after``: the last step applied (for errors). ``in_turn``: before
    the session's first step, a CPU device's first shard makes its first
    calls into torch's kernels: one device at a time, as in that step
    (FirstStepInTurn), until each has had rows to evaluate.
    """
    sums: dict[str, float] = {}
    rows_seen = 0
    reader = BatchReader(data, loop)
    first_calls = set(range(len(actors))) if in_turn else set()
    try:
        async with aclosing(reader.batches(lambda read: DataFailed(after, site="evaluate", batch=read))) as batches:
            number = 0
            async for batch in batches:
                rows = batch_rows(batch, f"evaluate's batch {number} (from 0)")
                number += 1
                counts, shards = split(batch, rows)
                results: list[dict[str, float]] = [{} for _ in actors]

                async def run(index: int, actor: DeviceActor, shard: Any, count: int) -> None:
                    results[index] = await actor.evaluate(shard, count, fn, after)

                work = list(enumerate(zip(actors, shards, counts)))
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
    return sums, rows_seen


def reduced_as(value: float | torch.Tensor, reduced: float | torch.Tensor, op: str, world_size: int) -> float | torch.Tensor:
    """``all_reduce``'s result for ``value``: its own type, or a float (a floating tensor) for a mean."""
    if isinstance(value, torch.Tensor):
        return reduced / world_size if op == "mean" else reduced
    total = reduced.item() if isinstance(reduced, torch.Tensor) else reduced
    if op == "mean":
        return total / world_size  # a Python division: an int64 sum is divided exactly, not in float32
    return int(total) if isinstance(value, int) else float(total)
