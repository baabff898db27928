"""The local halves of a session's evaluate and all_reduce: the devices' metric sums, and a reduction's result type.

Across processes each is then one collective (run by
:class:`~gsync._core.session.core.SessionCore` through its call gate); what
is here runs on this process's devices only.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable
from contextlib import aclosing
from typing import Any, Literal

import anyio
import torch

from ...errors import DataFailed
from ..data.batches import batch_rows
from ..data.feeder import BatchReader
from ..step.actor import DeviceActor, MetricFn
from ..threads import LoopHandle

__all__ = ("ReduceOp", "local_metric_sums", "reduced_as")

ReduceOp = Literal["sum", "mean", "max", "min"]
Split = Callable[[Any, int], tuple[list[int], list[Any]]]


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
