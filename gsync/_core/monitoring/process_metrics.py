"""This process's training counters, kept by every session and read by :mod:`gsync.metrics`' endpoint.

Plain numbers under a lock, with no dependency: a session pays a few additions
per step whether or not anything serves them, and the endpoint (another
thread) reads a consistent copy whenever it is scraped.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

__all__ = ("DURATION_BUCKETS", "PROCESS", "ProcessMetrics", "RankMetrics")

# Seconds: a CPU step of a small model takes milliseconds, a large model's on a slow link seconds to a minute.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class RankMetrics:
    """The counters of the sessions this process ran as one rank."""

    steps: int = 0
    duration_counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    """Steps per duration bucket (not cumulative); the last is beyond the largest bound."""
    duration_sum: float = 0.0
    reduced_bytes: int = 0
    loss: float | None = None
    membership_changes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    world_size: int = 1


class ProcessMetrics:
    """Every rank's counters this process has had (an elastic run renumbers its ranks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, RankMetrics] = {}

    def _of(self, rank: int) -> RankMetrics:
        found = self._ranks.get(rank)
        if found is None:
            found = self._ranks[rank] = RankMetrics()
        return found

    def stepped(self, rank: int, seconds: float, reduced_bytes: int, loss: float, world_size: int) -> None:
        with self._lock:
            counters = self._of(rank)
            counters.steps += 1
            counters.duration_counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
            counters.duration_sum += seconds
            counters.reduced_bytes += reduced_bytes
            counters.loss = loss
            counters.world_size = world_size

    def opened(self, rank: int, world_size: int) -> None:
        with self._lock:
            self._of(rank).world_size = world_size

    def membership_changed(self, rank: int, changes: int, world_size: int) -> None:
        with self._lock:
            counters = self._of(rank)
            counters.membership_changes += changes
            counters.world_size = world_size

    def failed(self, rank: int, kind: str) -> None:
        with self._lock:
            failures = self._of(rank).failures
            failures[kind] = failures.get(kind, 0) + 1

    def snapshot(self) -> dict[int, RankMetrics]:
        """A copy, taken under the lock: what one scrape reports."""
        with self._lock:
            return {
                rank: RankMetrics(
                    m.steps, list(m.duration_counts), m.duration_sum, m.reduced_bytes, m.loss,
                    m.membership_changes, dict(m.failures), m.world_size,
                )
                for rank, m in self._ranks.items()
            }


PROCESS = ProcessMetrics()
"""The one instance every session of this process feeds."""
