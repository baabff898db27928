"""The heartbeat's verdicts, over a real TCPStore, with ranks played by Heartbeats in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
import pytest
import torch.distributed as dist

import gsync
from gsync._core.distributed.heartbeat import Beat, Heartbeat, Whereabouts, locate

INTERVAL = 0.05
STALE = 0.4


@dataclass
class Member:
    """The part of a GroupMembership a Heartbeat uses."""

    store: dist.Store
    rank: int
    world_size: int
    namespace: str = "gsync/run1"


@dataclass
class Device:
    name: str
    step: int
    site: str
    waiting: bool = False


@dataclass
class Ranks:
    store: dist.TCPStore
    beats: list[Heartbeat] = field(default_factory=list)

    def beat(self, rank: int, world_size: int, where: Whereabouts) -> Heartbeat:
        heartbeat = Heartbeat(Member(self.store, rank, world_size), interval_s=INTERVAL, stale_after_s=STALE, lost_after_s=STALE * 2)
        heartbeat.where = lambda: where
        heartbeat.start()
        self.beats.append(heartbeat)
        return heartbeat

    def dead(self, rank: int, where: Whereabouts) -> None:
        """A rank that beat once and was then killed: its key stays, never changing."""
        self.store.set(f"gsync/run1/beat/{rank}", msgspec.msgpack.encode(Beat(1, where, 0.0)))


@contextmanager
def beating() -> Iterator[Ranks]:
    """Ranks on one store; every heartbeat is stopped (and must end) before the test returns."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    made = Ranks(store)
    try:
        yield made
    finally:
        for heartbeat in made.beats:
            assert heartbeat.stop(), "a heartbeat thread did not end"


@pytest.mark.timeout(30)
def test_a_peer_that_stops_beating_is_named_with_where_it_was() -> None:
    with beating() as ranks:
        ranks.dead(1, Whereabouts(2, "backward", "cpu:1"))
        me = ranks.beat(0, 2, Whereabouts(2, "gradient sync", waiting=True))
        lost = me.diagnose(timeout_s=STALE * 10, during=2)
        assert [(r.rank, r.step, r.phase, r.device) for r in lost] == [(1, 2, "backward", "cpu:1")]
        assert lost[0].silent_for is not None and lost[0].silent_for >= STALE
        assert str(lost[0]).startswith("rank 1 stopped responding at step 2 (backward on cpu:1): no heartbeat for")


@pytest.mark.timeout(30)
def test_a_dead_peer_whose_last_beat_is_older_than_the_failed_step_is_placed_in_that_step() -> None:
    with beating() as ranks:
        ranks.dead(1, Whereabouts(0, "gradient sync", waiting=True))
        me = ranks.beat(0, 2, Whereabouts(2, "gradient sync", waiting=True))
        (lost,) = me.diagnose(timeout_s=STALE * 10, during=2)
        assert (lost.step, lost.phase, lost.heard) == (2, "", "step 0, gradient sync")
        assert "rank 1 stopped responding at step 2 or just before (last heard at step 0, gradient sync)" in str(lost)


@pytest.mark.timeout(30)
def test_a_live_peer_outside_any_collective_is_named_stuck_only_for_a_timeout() -> None:
    with beating() as ranks:
        ranks.beat(1, 2, Whereabouts(3, "forward", "cpu:0"))
        me = ranks.beat(0, 2, Whereabouts(3, "gradient sync", waiting=True))
        (stuck,) = me.diagnose(timeout_s=5.0, stuck_after_s=INTERVAL, during=3)
        assert (stuck.rank, stuck.step, stuck.phase, stuck.silent_for) == (1, 3, "forward", None)
        assert str(stuck).startswith("rank 1 is alive but stuck at step 3 (forward on cpu:0) for")
        # A collective that failed (rather than timed out) names only ranks that stopped.
        assert me.diagnose(timeout_s=5.0, during=3) == []


@pytest.mark.timeout(30)
def test_peers_waiting_in_the_collective_too_are_not_blamed() -> None:
    with beating() as ranks:
        ranks.beat(1, 3, Whereabouts(3, "gradient sync", waiting=True))
        ranks.beat(2, 3, Whereabouts(3, "gradient sync", waiting=True))
        me = ranks.beat(0, 3, Whereabouts(3, "gradient sync", waiting=True))
        assert me.diagnose(timeout_s=5.0, stuck_after_s=INTERVAL, during=3) == []


@pytest.mark.timeout(30)
def test_a_peer_that_left_its_session_is_not_a_lost_one() -> None:
    with beating() as ranks:
        peer = ranks.beat(1, 2, Whereabouts(4, "outside gsync"))
        me = ranks.beat(0, 2, Whereabouts(4, "outside gsync"))
        lost_calls: list[object] = []
        me.on_lost(lost_calls.append)
        assert peer.stop()
        # Long past the silence that would end the run: the peer's last beat says it left.
        assert me.diagnose(timeout_s=STALE * 4, during=4) == []
        assert me.stopped(STALE) == [] and lost_calls == []


@pytest.mark.timeout(30)
def test_a_long_silence_is_reported_once_without_any_failed_collective() -> None:
    with beating() as ranks:
        ranks.dead(1, Whereabouts(5, "optimizer", "cpu"))
        me = ranks.beat(0, 2, Whereabouts(5, "gradient sync", waiting=True))
        called = threading.Event()
        reports: list[list[gsync.LostRank]] = []
        me.on_lost(lambda lost: (reports.append(lost), called.set()))
        assert called.wait(10), "the silent peer was never reported"
        assert [r.rank for r in reports[0]] == [1] and reports[0][0].silent_for >= STALE * 2
        error = gsync.PeerLost(reports[0])
        assert isinstance(error, gsync.PeerFailed)
        assert (error.rank, error.step, error.site, error.device) == (1, 5, "optimizer", "cpu")


def test_locate_names_the_device_furthest_behind_or_waiting() -> None:
    devices = [Device("cpu:0", 3, "optimizer"), Device("cpu:1", 3, "backward")]
    assert locate(devices, 2) == Whereabouts(3, "backward", "cpu:1")
    devices = [Device("cpu:0", 3, "optimizer", waiting=True), Device("cpu:1", 3, "backward", waiting=True)]
    assert locate(devices, 2) == Whereabouts(3, "gradient sync", waiting=True)
    devices = [Device("cpu:0", 4, "data"), Device("cpu:1", 3, "optimizer", waiting=True)]
    assert locate(devices, 3) == Whereabouts(4, "data", "cpu:0")


@pytest.mark.timeout(30)
def test_a_nudge_publishes_where_the_rank_is_before_its_next_beat() -> None:
    # Steps are shorter than the beat's interval: a rank killed a few steps in must not be last heard "starting
    # the session". Here the interval is a minute, so only the nudge can have written the new step.
    with beating() as ranks:
        heartbeat = Heartbeat(Member(ranks.store, 0, 1), interval_s=60.0, stale_after_s=STALE, lost_after_s=STALE * 2)
        where = [Whereabouts(-1, "starting the session")]
        heartbeat.where = lambda: where[0]
        heartbeat.start()
        ranks.beats.append(heartbeat)
        where[0] = Whereabouts(2, "outside gsync")
        heartbeat.nudge()
        deadline = time.monotonic() + 10.0
        published = msgspec.msgpack.decode(ranks.store.get("gsync/run1/beat/0"), type=Beat)
        while published.where.step != 2 and time.monotonic() < deadline:
            threading.Event().wait(0.005)  # polls the store, which has no way to wait for a key to change
            published = msgspec.msgpack.decode(ranks.store.get("gsync/run1/beat/0"), type=Beat)
        assert (published.where.step, published.where.phase) == (2, "outside gsync")


class CountingStore:
    """A store that records each call (it cannot be cloned, so the beat thread uses it too)."""

    def __init__(self, peer_beat: bytes) -> None:
        self.calls: list[str] = []
        self._peer_beat = peer_beat
        self._lock = threading.Lock()

    def _note(self, call: str) -> None:
        with self._lock:
            self.calls.append(call)

    def set(self, key: str, value: bytes) -> None:
        self._note("set")

    def check(self, keys: list[str]) -> bool:
        self._note("check")
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._note("read")
        return [self._peer_beat for _ in keys]

    def clone(self) -> None:
        raise RuntimeError("not a real store")


@pytest.mark.timeout(30)
def test_nudges_write_at_most_once_between_two_beats() -> None:
    # A rank whose steps are far shorter than the interval nudges after every one: the store must not see a write
    # per step, only one early write between two beats (the shared store serves every rank, quorum and report).
    store = CountingStore(msgspec.msgpack.encode(Beat(1, Whereabouts(0, "gradient sync"), 0.0)))
    heartbeat = Heartbeat(Member(store, 0, 2), interval_s=0.2, stale_after_s=5.0, lost_after_s=10.0)  # type: ignore[arg-type]
    heartbeat.where = lambda: Whereabouts(1, "outside gsync")
    heartbeat.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            heartbeat.nudge()
            threading.Event().wait(0.005)  # a step of 5 ms
    finally:
        assert heartbeat.stop()
    beats = "".join("r" if call == "read" else "s" if call == "set" else "" for call in store.calls)
    between = [part.count("s") for part in beats.split("r")[1:-1]]  # writes between two full beats' reads
    assert len(between) >= 3 and max(between) <= 2, beats  # the full beat's own write, and one early write
