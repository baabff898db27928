"""Reading a gsync trace: per-step times, phase means, overlap and the critical path.

Works on any objects with ``name, step, device, bucket, start_us, end_us``
(``gsync.TraceEvent``). Step numbers are the fit's global step indices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from .common import mean, median

PHASES = ("forward", "backward", "all_reduce", "optimizer", "broadcast_buffers")


def _by_step(events: Iterable[Any], name: str) -> dict[int, list[Any]]:
    grouped: dict[int, list[Any]] = defaultdict(list)
    for event in events:
        if event.name == name:
            grouped[event.step].append(event)
    return grouped


def step_periods_us(events: Sequence[Any], skip: int = 1) -> list[float]:
    """Per-step time: the last optimizer end of step s minus that of step s-1.

    The first ``skip`` periods (allocator and cache warm-up of a fresh fit) are dropped.
    """
    ends = {step: max(e.end_us for e in evs) for step, evs in _by_step(events, "optimizer").items()}
    steps = sorted(ends)
    periods = [ends[s] - ends[s - 1] for s in steps[1:] if s - 1 in ends]
    return periods[skip:]


def measured_steps(events: Sequence[Any], skip: int = 1) -> list[int]:
    steps = sorted(_by_step(events, "optimizer"))
    return steps[1 + skip :]


def phase_means_us(events: Sequence[Any], steps: Sequence[int]) -> dict[str, dict[str, float]]:
    """Mean duration of each phase (per device for device phases, per bucket for all_reduce),
    and the total per step."""
    keep = set(steps)
    out: dict[str, dict[str, float]] = {}
    for name in PHASES:
        durations = [e.end_us - e.start_us for e in events if e.name == name and e.step in keep]
        if not durations:
            continue
        per_step = defaultdict(float)
        for e in events:
            if e.name == name and e.step in keep:
                per_step[e.step] += e.end_us - e.start_us
        out[name] = {
            "mean_us": mean(durations),
            "count_per_step": len(durations) / max(len(keep), 1),
            "total_per_step_us": mean(list(per_step.values())),
        }
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(span: tuple[float, float], union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in union)


def overlap(events: Sequence[Any], steps: Sequence[int]) -> dict[str, float]:
    """How much all_reduce time ran while some device was still in backward.

    Per step: sum over buckets of |all_reduce span ∩ union of every device's backward span|,
    divided by the step's total all_reduce time. Returns the median and mean of the
    per-step fractions and the fraction over all steps pooled.
    """
    backward = _by_step(events, "backward")
    reduces = _by_step(events, "all_reduce")
    fractions: list[float] = []
    hidden_total = reduce_total = 0.0
    for step in steps:
        spans = [(e.start_us, e.end_us) for e in reduces.get(step, [])]
        if not spans:
            continue
        union = _union([(e.start_us, e.end_us) for e in backward.get(step, [])])
        hidden = sum(_overlap(span, union) for span in spans)
        total = sum(end - start for start, end in spans)
        hidden_total += hidden
        reduce_total += total
        if total > 0:
            fractions.append(hidden / total)
    return {
        "median_fraction": median(fractions),
        "mean_fraction": mean(fractions),
        "pooled_fraction": hidden_total / reduce_total if reduce_total else float("nan"),
    }


def critical_path(events: Sequence[Any], steps: Sequence[int], shared_thread: bool = False) -> dict[str, float]:
    """Where a step's wall time goes, averaged over ``steps`` (all in µs).

    ``shared_thread``: the devices took turns on one thread (``Engine(device_threads="shared")``), so
    their compute adds up, and the time between steps is the thread's, not each device's.

    - ``compute``: forward + backward + optimizer of the slowest device (of all devices, on a shared thread)
    - ``exposed_reduce``: last all_reduce end minus last backward end (reduction not hidden)
    - ``sync_notify``: first optimizer start minus max(last reduce end, last backward end):
      event-loop hops from "reduced" to "optimizer running"
    - ``between_steps``: per device, next forward start minus previous optimizer end
      (thread/loop hops, shard hand-off, zeroing the gradient buckets), mean over devices; on a shared
      thread, the first forward start minus the last optimizer end
    - ``device_skew``: last backward end minus first backward end
    """
    by = {name: _by_step(events, name) for name in ("forward", "backward", "optimizer", "all_reduce")}
    rows: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        fwd, bwd, opt = by["forward"].get(step), by["backward"].get(step), by["optimizer"].get(step)
        prev_opt = by["optimizer"].get(step - 1)
        if not fwd or not bwd or not opt:
            continue
        bwd_end = max(e.end_us for e in bwd)
        reduce_end = max((e.end_us for e in by["all_reduce"].get(step, [])), default=bwd_end)
        opt_start = min(e.start_us for e in opt)
        per_device = defaultdict(float)
        for e in fwd + bwd + opt:
            per_device[e.device] += e.end_us - e.start_us
        rows["compute"].append(sum(per_device.values()) if shared_thread else max(per_device.values()))
        rows["exposed_reduce"].append(max(0.0, reduce_end - bwd_end))
        rows["sync_notify"].append(opt_start - max(reduce_end, bwd_end))
        rows["device_skew"].append(bwd_end - min(e.end_us for e in bwd))
        if prev_opt and shared_thread:
            rows["between_steps"].append(min(e.start_us for e in fwd) - max(e.end_us for e in prev_opt))
        elif prev_opt:
            prev_end = {e.device: e.end_us for e in prev_opt}
            gaps = [e.start_us - prev_end[e.device] for e in fwd if e.device in prev_end]
            if gaps:
                rows["between_steps"].append(mean(gaps))
        rows["span"].append(max(e.end_us for e in opt) - min(e.start_us for e in fwd))
    return {key: mean(values) for key, values in rows.items()}


def summarize_trace(events: Sequence[Any], skip: int = 1, shared_thread: bool = False) -> dict[str, Any]:
    steps = measured_steps(events, skip)
    periods = step_periods_us(events, skip)
    return {
        "step_periods_us": periods,
        "phases": phase_means_us(events, steps),
        "overlap": overlap(events, steps),
        "critical_path_us": critical_path(events, steps, shared_thread),
        "measured_steps": len(steps),
    }
