"""A run's series for a picture, read from a fit's history and trace, or from a Chrome trace file gsync wrote."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .plotting import RunSeries
from .step_metrics import union_seconds

__all__ = ("series_of_chrome", "series_of_fit")

_COMM_SPANS = frozenset({"all_reduce", "finish_step", "all_gather"})
_DEVICE_SPANS = frozenset({"data", "forward", "backward", "optimizer"})


def series_of_fit(history: Sequence[Any], trace: Any, membership: Sequence[Any], title: str) -> RunSeries:
    """From ``FitResult.history`` (and its trace, when traced, for the communication part and phases)."""
    series = RunSeries(
        title=title,
        steps=[r.step for r in history],
        losses=[r.loss for r in history],
        lrs=[r.lr for r in history],
        step_seconds=[r.seconds for r in history],
        skipped=[r.step for r in history if r.skipped],
        membership=[(change.step, str(change)) for change in membership],
    )
    if trace is not None:
        comm: dict[int, list[tuple[float, float]]] = defaultdict(list)
        work: dict[int, list[tuple[float, float]]] = defaultdict(list)
        phases: dict[str, dict[str, float]] = {}
        for event in list(trace.events):
            if event.device == -1 and event.name in _COMM_SPANS:
                comm[event.step].append((event.start_us, event.end_us))
            elif event.device >= 0:
                if event.name in _DEVICE_SPANS:
                    work[event.step].append((event.start_us, event.end_us))
                devices = trace.devices
                device = devices[event.device] if event.device < len(devices) else f"device {event.device}"
                per_phase = phases.setdefault(device, {})
                per_phase[event.name] = per_phase.get(event.name, 0.0) + (event.end_us - event.start_us) / 1e6
        series.comm_seconds = [union_seconds(comm[s], work[s]) for s in series.steps]
        series.phases = dict(sorted(phases.items()))
    return series


def series_of_chrome(doc: dict[str, Any], metrics: Sequence[dict[str, str]] = ()) -> RunSeries:
    """From a trace file (``Trace.to_chrome``), and from a ``metrics.csv`` (CSVLogger's) for loss and lr.

    A trace holds the timeline, not the losses: those come from ``metrics`` when given.
    """
    other = doc.get("otherData", {})
    events = doc.get("traceEvents", [])
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    outcome = other.get("outcome", "running")
    title = f"gsync run, rank {other.get('rank', 0)} of {other.get('world_size', 1)}: {outcome}"
    series = RunSeries(title=title)
    spans: dict[int, float] = {}
    comm: dict[int, list[tuple[float, float]]] = defaultdict(list)
    work: dict[int, list[tuple[float, float]]] = defaultdict(list)
    phases: dict[str, dict[str, float]] = {}
    for event in events:
        kind, args = event.get("ph"), event.get("args", {})
        step = args.get("step")
        if kind == "X" and event.get("cat") == "step":
            spans[step] = event["dur"] / 1e6
        elif kind == "X" and event.get("cat") == "communication":
            if event["name"].split(" ")[0] in _COMM_SPANS:
                comm[step].append((event["ts"], event["ts"] + event["dur"]))
        elif kind == "X" and event.get("cat") == "device":
            if event["name"] in _DEVICE_SPANS:
                work[step].append((event["ts"], event["ts"] + event["dur"]))
            track = tracks.get(event["tid"], str(event["tid"]))
            if track.endswith(")") and " (" in track:  # "device 0 (cpu:0)": the device's name, as a fit's plot has
                track = track[track.index(" (") + 2 : -1]
            per_phase = phases.setdefault(track, {})
            per_phase[event["name"]] = per_phase.get(event["name"], 0.0) + event["dur"] / 1e6
        elif kind == "i" and event.get("cat") == "membership":
            series.membership.append((step, args.get("message", "")))
        elif kind == "i" and event.get("cat") == "failure" and series.failure is None:
            series.failure = (step, args.get("error", event["name"]))
    series.steps = sorted(spans)
    series.step_seconds = [spans[s] for s in series.steps]
    series.comm_seconds = [union_seconds(comm[s], work[s]) for s in series.steps]
    series.phases = dict(sorted(phases.items()))
    rows = [row for row in metrics if row.get("loss")]
    if rows:
        logged = {int(row["step"]): row for row in rows}
        # Steps the trace has and the log has: a failed run's last step may be in one and not the other.
        steps = [s for s in series.steps if s in logged] or sorted(logged)
        if steps != series.steps:
            series.steps = steps
            series.step_seconds = [spans.get(s, float(logged[s].get("step_seconds") or 0.0)) for s in steps]
            series.comm_seconds = [union_seconds(comm[s], work[s]) for s in steps]
        series.losses = [float(logged[s]["loss"]) for s in steps]
        series.lrs = [float(logged[s]["lr"]) for s in steps if logged[s].get("lr")]
        if len(series.lrs) != len(steps):
            series.lrs = []
        series.skipped = [s for s in steps if logged[s].get("skipped") in ("1", "1.0")]
    return series
