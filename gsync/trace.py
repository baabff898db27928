"""A timeline of one session or ``fit``: every device's phases, every bucket's reduction, and how the run ended.

Enabled with ``Engine(trace=True)`` (or ``trace=`` a :class:`Trace` of your
own, e.g. a subclass whose :meth:`Trace.record` forwards events live); the
result's ``trace`` then holds one event per phase. Events are msgspec structs, so they encode to msgpack or
JSON as they are; :meth:`Trace.to_chrome` writes the Chrome / Perfetto trace
format (open it at ui.perfetto.dev or chrome://tracing).

``Engine(trace="run.json")`` also writes that file when each session (and so
each ``fit``) ends, however it ends: after a failure or a cancellation the
file has the failure marked on the track where it happened, and the error's
message ends with the file's path. Across processes (``world_size`` > 1) each
rank writes its own file, named with its rank: ``run.rank0.json``,
``run.rank1.json``, ...
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec

from .errors import (
    FitError,
    GsyncError,
    PeerFailed,
    SessionClosed,
    SyncFailed,
    SyncTimeout,
)
from ._core.base.outcome import is_cancellation

__all__ = ("Trace", "TraceEvent")

logger = logging.getLogger("gsync")

# The kinds of events the communication thread records; device phases are all other span names.
_COMM_SPANS = frozenset({"all_reduce", "finish_step", "all_gather"})
# The spans that belong to an optimizer step (not ``evaluate``, whose step is the last one trained).
_STEP_SPANS = frozenset({"data", "forward", "backward", "optimizer", "all_reduce", "finish_step", "all_gather"})
# Marks: instants recorded when a session ends other than normally.
_MARKS = frozenset({"failed", "cancelled", "membership"})
# Device index of the communication thread's events; of marks on the steps track.
_COMM = -1
_STEPS = -2
MARK_TRACK = _STEPS
"""The device index of a mark that belongs to no device or thread (a failure elsewhere, a membership change)."""
# Chrome thread ids are unique across ranks (rank r's tracks are 1000 * (r + 1) + slot), so the
# files of several ranks can be merged into one timeline without their tracks colliding.
_TIDS_PER_RANK = 1000


class TraceEvent(msgspec.Struct, frozen=True, gc=False):
    """One phase, reduction or mark of a :class:`Trace`: what, at which step, on which device, from when to when."""

    name: str
    """``data``, ``forward``, ``backward``, ``optimizer``, ``evaluate`` (per device), ``all_reduce`` and
    ``finish_step`` (buffer broadcast and cross-process agreement) on the communication thread (and with
    ``shard_optimizer=True``, ``all_gather``: a bucket's updated shards back into every replica), or a mark:
    ``failed``, ``cancelled`` or ``membership`` (an elastic run's change: ``error`` is its reason, ``message``
    says who left and joined; an instant: ``start_us == end_us``)."""
    step: int
    device: int
    """Device index, -1 for the communication thread, or -2 for a mark that belongs to no device or thread
    (a failure of another rank, of the data, of your own code; a cancellation)."""
    bucket: int
    """Bucket index for ``all_reduce`` and ``all_gather``, else -1."""
    start_us: float
    end_us: float
    """Microseconds since the trace started (``time.perf_counter``)."""
    nbytes: int = 0
    """Bytes of the bucket reduced (per device) for ``all_reduce``, else 0."""
    error: str = ""
    """For a mark: the error's type name (``"WorkerFailed"``), or ``"cancelled"``."""
    message: str = ""
    """For a mark: the error's message."""


class Trace:
    """A run's timeline: ``events``, one :class:`TraceEvent` per phase, reduction and mark, from every thread.

    ``Engine(trace=True)`` makes one per fit or session (``FitResult.trace``, ``Session.trace``); pass one of
    your own to record into it, or a subclass whose :meth:`record` forwards each event as it comes.
    """

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        """Every event, in the order recorded (:meth:`select` picks by name and step)."""
        self._origin = time.perf_counter()
        self._origin_monotonic = time.monotonic()
        self._origin_unix = time.time()
        self.rank = 0
        """This process's rank; set, with ``world_size`` and ``devices``, when a session starts."""
        self.world_size = 1
        self.devices: tuple[str, ...] = ()
        """This process's device names, by device index."""
        self.outcome: str | None = None
        """How the last session ended: ``"ok"``, ``"failed"`` or ``"cancelled"`` (``None`` while it runs)."""
        self._ended_with = ""
        self.path: Path | None = None
        """The file gsync last wrote this trace to (with ``Engine(trace=path)``), else ``None``."""

    def now_us(self) -> float:
        return (time.perf_counter() - self._origin) * 1e6

    @contextmanager
    def span(self, name: str, step: int, device: int = _COMM, bucket: int = -1, nbytes: int = 0) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            self.record(TraceEvent(name, step, device, bucket, start, self.now_us(), nbytes))

    def record(self, event: TraceEvent) -> None:
        """Store one finished event; called from whichever thread ran the phase."""
        self.events.append(event)

    def select(self, name: str, step: int | None = None) -> list[TraceEvent]:
        return [e for e in self.events if e.name == name and (step is None or e.step == step)]

    def describe(self, rank: int, world_size: int, devices: Sequence[str]) -> None:
        """Say which process the events come from (gsync calls this when a session starts)."""
        self.rank, self.world_size, self.devices = rank, world_size, tuple(devices)

    def to_chrome(self) -> dict[str, object]:
        """The trace as a Chrome trace-event document (JSON object format).

        One process per rank, named with the rank and its devices; in it one
        track (thread) per device, one for the sync server's communication
        thread, and one of steps (a span per optimizer step, from its first
        phase anywhere to its last); failures and cancellations are instant
        marks on the track where they happened. Timestamps are microseconds
        since the trace started.
        """
        events = list(self.events)
        pid = self.rank + 1  # pid 0 is the idle process to some viewers
        device_count = max([len(self.devices)] + [e.device + 1 for e in events])
        base = pid * _TIDS_PER_RANK
        tracks: dict[int, tuple[int, str]] = {_STEPS: (base, "steps")}
        for index in range(device_count):
            named = f" ({self.devices[index]})" if index < len(self.devices) else ""
            tracks[index] = (base + 1 + index, f"device {index}{named}")
        tracks[_COMM] = (base + 1 + device_count, "sync server / communication")

        devices = ", ".join(self.devices) or f"{device_count} device(s)"
        process = f"gsync rank {self.rank} of {self.world_size}: {devices}"
        chrome: list[dict[str, object]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": self.rank}},
        ]
        for tid, label in tracks.values():
            chrome.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
            chrome.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid - base}}
            )

        timed: list[dict[str, object]] = []
        for event in events:
            tid = tracks[event.device if event.device in tracks else _STEPS][0]
            args: dict[str, object] = {"step": event.step}
            if event.name in _MARKS:
                args.update(error=event.error, message=event.message)
                timed.append(
                    {"name": f"{event.name}: {event.error}" if event.name in ("failed", "membership") else event.name,
                     "cat": "membership" if event.name == "membership" else "failure",
                     "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": _us(event.start_us), "args": args}
                )
                continue
            label = event.name
            if event.bucket >= 0:
                label = f"{event.name} b{event.bucket}"
                args["bucket"] = event.bucket
            if event.name in ("all_reduce", "all_gather"):
                args["bytes"] = event.nbytes
            timed.append(
                {"name": label, "cat": "communication" if event.device == _COMM else "device", "ph": "X", "pid": pid,
                 "tid": tid, "ts": _us(event.start_us), "dur": _us(event.end_us - event.start_us), "args": args}
            )
        for step, start, end in _step_bounds(events):
            timed.append(
                {"name": f"step {step}", "cat": "step", "ph": "X", "pid": pid, "tid": tracks[_STEPS][0],
                 "ts": _us(start), "dur": _us(end - start), "args": {"step": step}}
            )
        timed.sort(key=lambda e: e["ts"])  # type: ignore[arg-type,return-value]
        return {
            "traceEvents": chrome + timed,
            "displayTimeUnit": "ms",
            "otherData": {
                "rank": self.rank,
                "world_size": self.world_size,
                "devices": list(self.devices),
                "outcome": self.outcome or "running",
                "error": self._ended_with,
                "started_unix_s": self._origin_unix,
            },
        }

    def save_chrome(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_chrome` to ``path`` (atomically: a reader never sees half a file)."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        with open(partial, "w") as handle:
            json.dump(self.to_chrome(), handle)
        os.replace(partial, target)

    def _mark_end(self, error: BaseException | None) -> None:
        """Record how the session ended: nothing more for a clean end, else one mark per failure (or cancellation)."""
        self._ended_with = ""
        if error is None:
            self.outcome = "ok"
            return
        if is_cancellation(error):
            self.outcome = "cancelled"
            now = self.now_us()
            self.record(
                TraceEvent("cancelled", _last_step(self.events), _STEPS, -1, now, now, error="cancelled",
                           message="the session was cancelled by its caller")
            )
            return
        self.outcome = "failed"
        self._ended_with = f"{type(error).__name__}: {error}"
        failures = [error, *getattr(error, "others", ())]
        if isinstance(error, SessionClosed) and isinstance(error.__cause__, GsyncError):
            failures.append(error.__cause__)  # the failure that closed the session
        now = self.now_us()
        for failure in failures:
            at = now
            if isinstance(failure, FitError):
                at = min(max((failure.at - self._origin_monotonic) * 1e6, 0.0), now)
            step = getattr(failure, "step", None)
            self.record(
                TraceEvent(
                    "failed",
                    step if isinstance(step, int) else _last_step(self.events),
                    self._track_of(failure),
                    -1,
                    at,
                    at,
                    error=type(failure).__name__,
                    message=str(failure),
                )
            )

    def _track_of(self, failure: BaseException) -> int:
        """The track a failure happened on: its device's, the communication thread's, or the steps track."""
        if isinstance(failure, PeerFailed):
            return _STEPS  # its device index is the other rank's
        index = getattr(failure, "device_index", None)
        if isinstance(index, int) and index >= 0:
            return index
        device_sites = ("optimizer step", "evaluate")
        if isinstance(failure, SyncTimeout) and failure.site in device_sites and len(failure.stalled_devices) == 1:
            # Raised by the device whose optimizer step (or share of an evaluation) stalled.
            name = failure.stalled_devices[0]
            return self.devices.index(name) if name in self.devices else _STEPS
        if isinstance(failure, (SyncFailed, SyncTimeout)):
            return _COMM
        return _STEPS


def _us(value: float) -> float:
    return round(value, 3)


def _last_step(events: Sequence[TraceEvent]) -> int:
    return max((e.step for e in events if e.name in _STEP_SPANS), default=-1)


def _step_bounds(events: Sequence[TraceEvent]) -> list[tuple[int, float, float]]:
    """(step, start, end) per optimizer step, from its first phase to its last, never overlapping the next step."""
    bounds: dict[int, tuple[float, float]] = {}
    for event in events:
        if event.name in _STEP_SPANS:
            start, end = bounds.get(event.step, (event.start_us, event.end_us))
            bounds[event.step] = (min(start, event.start_us), max(end, event.end_us))
    ordered = sorted(bounds.items())
    spans = []
    for position, (step, (start, end)) in enumerate(ordered):
        if position + 1 < len(ordered):
            end = min(end, ordered[position + 1][1][0])
        spans.append((step, start, max(end, start)))
    return spans
