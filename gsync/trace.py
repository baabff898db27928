"""A timeline of one ``fit``: every device's phases and every bucket's reduction.

Enabled with ``Engine(trace=True)`` (or ``trace=`` a :class:`Trace` of your
own, e.g. a subclass whose :meth:`Trace.record` forwards events live); the
result's ``trace`` then holds one event per phase. Events are msgspec structs, so they encode to msgpack or
JSON as they are; :meth:`Trace.to_chrome` writes the Chrome / Perfetto trace
format (open it at ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

__all__ = ("Trace", "TraceEvent")


class TraceEvent(msgspec.Struct, frozen=True, gc=False):
    name: str
    """``data``, ``forward``, ``backward``, ``optimizer`` (per device), or ``all_reduce`` and ``finish_step``
    (buffer broadcast and cross-process agreement) on the communication thread."""
    step: int
    device: int
    """Device index, or -1 for the communication thread."""
    bucket: int
    """Bucket index for ``all_reduce``, else -1."""
    start_us: float
    end_us: float


class Trace:
    """Collects events from any thread (appends to a list are atomic in CPython)."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self._origin = time.perf_counter()

    def now_us(self) -> float:
        return (time.perf_counter() - self._origin) * 1e6

    @contextmanager
    def span(self, name: str, step: int, device: int = -1, bucket: int = -1) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            self.record(TraceEvent(name, step, device, bucket, start, self.now_us()))

    def record(self, event: TraceEvent) -> None:
        """Store one finished event; called from whichever thread ran the phase."""
        self.events.append(event)

    def select(self, name: str, step: int | None = None) -> list[TraceEvent]:
        return [e for e in self.events if e.name == name and (step is None or e.step == step)]

    def to_chrome(self) -> dict[str, object]:
        """The trace as a Chrome trace-event document (one row per device, one for communication)."""
        rows = {-1: "communication"}
        events: list[dict[str, object]] = []
        for event in self.events:
            rows.setdefault(event.device, f"device {event.device}")
            label = f"{event.name} b{event.bucket}" if event.bucket >= 0 else event.name
            events.append(
                {
                    "name": label,
                    "ph": "X",
                    "pid": 0,
                    "tid": event.device,
                    "ts": event.start_us,
                    "dur": event.end_us - event.start_us,
                    "args": {"step": event.step, "bucket": event.bucket},
                }
            )
        for tid, label in rows.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": label}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as handle:
            json.dump(self.to_chrome(), handle)
