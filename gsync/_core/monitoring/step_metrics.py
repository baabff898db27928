"""What one step is logged as: the stable metric names of the monitoring page, from a step's result and trace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ("CommMeter", "step_metrics", "union_seconds")

# The trace's spans of the communication thread and of the devices' own work (gsync.trace names them).
_COMM_SPANS = frozenset({"all_reduce", "finish_step", "all_gather"})
_DEVICE_SPANS = frozenset({"data", "forward", "backward", "optimizer"})
_COMM_DEVICE = -1


class _Result(Protocol):
    step: int
    loss: float
    lr: float
    lrs: tuple[float, ...]
    rows: int
    seconds: float
    grad_norm: float | None
    skipped: bool
    world_size: int


def step_metrics(result: _Result, reduced_bytes: int, comm_exposed: float | None) -> dict[str, float]:
    """``loss``, ``lr`` (``lr/<group>`` with several groups), ``grad_norm`` when clipping, ``rows``,
    ``step_seconds``, ``samples_per_second``, ``reduced_bytes``, ``comm_exposed_seconds`` when traced,
    ``skipped`` (0 or 1) and ``world_size``."""
    metrics: dict[str, float] = {"loss": result.loss, "lr": result.lr}
    if len(result.lrs) > 1:
        for group, lr in enumerate(result.lrs):
            metrics[f"lr/{group}"] = lr
    if result.grad_norm is not None:
        metrics["grad_norm"] = result.grad_norm
    metrics["rows"] = float(result.rows)
    metrics["step_seconds"] = result.seconds
    metrics["samples_per_second"] = result.rows / result.seconds if result.seconds > 0 else 0.0
    metrics["reduced_bytes"] = float(reduced_bytes)
    if comm_exposed is not None:
        metrics["comm_exposed_seconds"] = comm_exposed
    metrics["skipped"] = 1.0 if result.skipped else 0.0
    metrics["world_size"] = float(result.world_size)
    return metrics


def union_seconds(spans: Sequence[tuple[float, float]], minus: Sequence[tuple[float, float]] = ()) -> float:
    """Seconds covered by ``spans`` (microseconds) and by none of ``minus``."""
    covered = _merged(spans)
    if minus:
        covered = _subtract(covered, _merged(minus))
    return sum(end - start for start, end in covered) / 1e6


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _subtract(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    left: list[tuple[float, float]] = []
    for start, end in spans:
        for hole_start, hole_end in holes:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                left.append((start, hole_start))
            start = max(start, hole_end)
            if start >= end:
                break
        if start < end:
            left.append((start, end))
    return left


class CommMeter:
    """Each step's exposed communication from a live trace: time the communication thread worked and no device did.

    The trace only grows, so each step reads the events recorded since the
    last one: a step costs the events of one step, however long the run.
    """

    def __init__(self, trace: Any) -> None:
        self._trace = trace
        self._seen = 0
        self._by_step: dict[int, list[Any]] = {}

    def exposed_seconds(self, step: int) -> float:
        events = self._trace.events
        if len(events) < self._seen:  # a Trace of the user's, emptied by them
            self._seen = 0
        fresh, self._seen = events[self._seen:], len(events)
        for event in fresh:
            if event.step >= step:
                self._by_step.setdefault(event.step, []).append(event)
        mine = self._by_step.pop(step, [])
        for older in [s for s in self._by_step if s < step]:
            del self._by_step[older]
        comm = [(e.start_us, e.end_us) for e in mine if e.device == _COMM_DEVICE and e.name in _COMM_SPANS]
        work = [(e.start_us, e.end_us) for e in mine if e.device >= 0 and e.name in _DEVICE_SPANS]
        return union_seconds(comm, work)
