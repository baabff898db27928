"""Liveness across ranks: every rank beats through the store, so a failed collective can name who stopped.

A collective that fails or times out says only that *some* peer is missing
(gloo: "Connection reset by peer"; NCCL: nothing at all). Each rank's
``gsync-heartbeat`` thread therefore writes a small beat to the store twice a
second, carrying where the rank is (step, phase, device, whether it is waiting
for its peers and for how long it has been there), and reads every peer's beat
in the same round trip. A step applied between two beats is published early,
once (:meth:`Heartbeat.nudge`): steps are often shorter than the interval. From those it can tell, without any clock shared
between machines:

- a peer whose beat has not changed for :data:`STALE_AFTER_S` stopped: it was
  killed, crashed, or its whole process is hung (SIGSTOP, a native call that
  holds the GIL);
- a peer that still beats but is not waiting in a collective while this rank
  waits for it is stuck in its own work (a loss function that never returns,
  a data loader that blocks), at the step and phase its beat names.

The beat runs in its own thread on its own store connection (with a short
store timeout), so neither the event loop nor the training threads ever wait
for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

import msgspec
import torch.distributed as dist

from ...errors import LostRank
from .membership import GroupMembership

__all__ = ("BEAT_INTERVAL_S", "LOST_AFTER_S", "STALE_AFTER_S", "Beat", "DevicePosition", "Heartbeat", "Whereabouts", "locate")

BEAT_INTERVAL_S = 0.5
STALE_AFTER_S = 3.0
"""A peer whose beat has not changed for this long has stopped (six missed beats: load alone does not do that)."""
LOST_AFTER_S = 10.0
"""Silence that ends a run even while no collective has failed (NCCL waits on a dead peer without error)."""
# Waits of the heartbeat's store connection give up after this long. Other
# store calls are bounded only by the server answering (torch 2.13): a store
# host that is frozen, not dead, can leave the thread inside one, and stop()
# then returns False rather than waiting for it.
_STORE_TIMEOUT = timedelta(seconds=2.0)


class Whereabouts(msgspec.Struct, frozen=True, array_like=True):
    """Where a rank is: ``phase`` of ``step`` (on ``device``, if one device is the furthest behind)."""

    step: int
    phase: str
    device: str = ""
    waiting: bool = False
    """Waiting for its peers in a collective (the gradient sync, an evaluate or all_reduce)."""


class Beat(msgspec.Struct, frozen=True, array_like=True):
    count: int
    where: Whereabouts
    held_s: float
    """How long the rank has been at ``where``, by its own clock."""
    left: bool = False
    """The rank closed its session: its silence from now on is not a failure."""


_T = TypeVar("_T")
# Store values are msgpack bytes: Store.set takes bytes, though torch's stubs say str (hence the ignores).
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Beat)


@dataclass
class _PeerView:
    beat: Beat
    changed_at: float
    """``time.monotonic()`` of this rank when the peer's beat count last changed (or was first read)."""
    changes: int = 0
    """How often its count was seen to change (a first read is not a change)."""


class Heartbeat:
    """This rank's beat and its view of every peer's, over the membership's store."""

    def __init__(
        self,
        member: GroupMembership,
        interval_s: float = BEAT_INTERVAL_S,
        stale_after_s: float = STALE_AFTER_S,
        lost_after_s: float = LOST_AFTER_S,
    ) -> None:
        self._store = member.store
        self._rank = member.rank
        self._peers = [rank for rank in range(member.world_size) if rank != member.rank]
        self._namespace = member.namespace
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.lost_after_s = lost_after_s
        self.where: Callable[[], Whereabouts] = lambda: Whereabouts(-1, "starting the session")
        """Called in the heartbeat thread each beat; the session points it at its actors once they exist."""
        self._held = (Whereabouts(-1, ""), time.monotonic())
        self._count = 0
        self._views: dict[int, _PeerView] = {}
        self._last_read = time.monotonic()
        self._call_started: float | None = None
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        """Set by :meth:`nudge` and :meth:`stop`: the beat thread does not wait out its interval."""
        self._thread: threading.Thread | None = None
        self._on_lost: Callable[[list[LostRank]], object] | None = None
        self.store_error: BaseException | None = None
        """Why the heartbeat stopped talking to the store, if it did (the store's host may be gone)."""

    def _key(self, rank: int) -> str:
        return f"{self._namespace}/beat/{rank}"

    def start(self) -> None:
        """Write the first beat (so peers can read it after the next collective) and start beating. Blocks once.

        The first beat uses the shared connection; the thread opens its own.
        """
        self._store.set(self._key(self._rank), _ENCODER.encode(self._next_beat()))  # type: ignore[arg-type]
        try:
            store = self._store.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        except Exception:  # noqa: BLE001 - stores that cannot clone raise various errors
            store = self._store
        else:
            store.set_timeout(_STORE_TIMEOUT)
        self._thread = threading.Thread(target=self._run, args=(store,), name="gsync-heartbeat", daemon=True)
        self._thread.start()

    def on_lost(self, callback: Callable[[list[LostRank]], object]) -> None:
        """Call ``callback(lost)`` once, from the heartbeat thread, when a peer has been silent for ``lost_after_s``."""
        self._on_lost = callback

    def nudge(self) -> None:
        """This rank moved on (a step applied): publish where it is now rather than at the next beat.

        Steps are often shorter than the interval, so without it a rank killed
        a few steps into a run would be last heard "starting the session".
        Only this rank's own beat is written early (peers are read at the
        interval, as before), and at most once between two beats.
        """
        self._wake.set()

    def _next_beat(self, left: bool = False) -> Beat:
        where = Whereabouts(self._held[0].step, "left the session") if left else self._where()
        held, since = self._held
        now = time.monotonic()
        if where != held:
            self._held = (where, now)
            since = now
        self._count += 1
        return Beat(self._count, where, now - since, left)

    def _where(self) -> Whereabouts:
        try:
            return self.where()
        except Exception:  # noqa: BLE001 - reading actors from another thread must never stop the beat
            return self._held[0]

    def _run(self, store: dist.Store) -> None:
        keys = [self._key(rank) for rank in self._peers]
        present = not keys
        reported = False
        next_beat = time.monotonic() + self.interval_s
        published_early = False
        try:
            while True:
                self._wake.wait(max(0.0, next_beat - time.monotonic()))
                self._wake.clear()
                if self._stopping.is_set():
                    break
                if time.monotonic() < next_beat:
                    # Nudged: one early write between two beats at most, so the store sees at most twice the
                    # writes of a rank that is never nudged, however short its steps.
                    if not published_early:
                        published_early = True
                        self._publish(store)
                    continue
                try:
                    present = self._beat(store, keys, present)
                except Exception as error:  # noqa: BLE001 - kept for diagnose(); the next beat tries again
                    # A store that failed once may answer the next time; one
                    # that is gone keeps failing fast. Peers judge this rank by
                    # its beats either way, so never stop trying.
                    self.store_error = error
                    continue
                finally:
                    # The interval counts from the end of a beat: a slow store is not written to back to back.
                    next_beat = time.monotonic() + self.interval_s
                    published_early = False
                self.store_error = None
                callback = self._on_lost
                if callback is not None and not reported:
                    lost = self.stopped(self.lost_after_s, during=self._held[0].step)
                    if lost:
                        reported = True
                        callback(lost)
            # A last beat that says this rank left, so no peer mistakes the silence for a failure.
            self._timed(store.set, self._key(self._rank), _ENCODER.encode(self._next_beat(left=True)))
        except Exception:  # noqa: BLE001 - the last beat is best effort: the store may be gone
            pass
        finally:
            with self._changed:
                self._changed.notify_all()

    def _publish(self, store: dist.Store) -> None:
        """Write this rank's beat only (a nudge); a failure is the next full beat's to find and report."""
        try:
            self._timed(store.set, self._key(self._rank), _ENCODER.encode(self._next_beat()))
        except Exception:  # noqa: BLE001 - one failed write says nothing a full beat would not say better
            pass

    def _beat(self, store: dist.Store, keys: list[str], present: bool) -> bool:
        """Write this rank's beat and read every peer's (one write and one read); whether all peers have beaten."""
        self._timed(store.set, self._key(self._rank), _ENCODER.encode(self._next_beat()))
        # A get of a key nobody wrote yet would block: peers still
        # joining have not beaten, so read only once all have.
        present = present or self._timed(store.check, keys)
        beats = [_DECODER.decode(raw) for raw in self._timed(store.multi_get, keys)] if present and keys else []
        now = time.monotonic()
        with self._changed:
            self._last_read = now
            for rank, beat in zip(self._peers, beats):
                view = self._views.get(rank)
                if view is None:
                    self._views[rank] = _PeerView(beat, now)
                elif view.beat.count != beat.count:
                    self._views[rank] = _PeerView(beat, now, view.changes + 1)
                else:
                    view.beat = beat
            self._changed.notify_all()
        return present

    def _timed(self, call: Callable[..., _T], *args: object) -> _T:
        self._call_started = time.monotonic()
        try:
            return call(*args)
        finally:
            self._call_started = None

    def store_trouble(self) -> str | None:
        """Why the store looks unreachable (a call failing, or one stuck for ``stale_after_s``), or ``None``."""
        started = self._call_started
        if started is not None and time.monotonic() - started >= self.stale_after_s:
            return f"a store call has not returned for {time.monotonic() - started:.1f} s"
        error = self.store_error
        return None if error is None else f"the store failed: {error}"

    def stopped(self, silent_for_s: float | None = None, during: int = -1) -> list[LostRank]:
        """The peers whose beat has not changed for ``silent_for_s`` (default: ``stale_after_s``).

        ``during`` is a step the peers are known to have reached (see :class:`~gsync.LostRank`).

        Silence counts up to this rank's last successful read, so a store that
        went away does not make every peer look stopped.
        """
        limit = self.stale_after_s if silent_for_s is None else silent_for_s
        with self._changed:
            now = self._last_read
            return [
                _lost(rank, view.beat, during, silent_for=now - view.changed_at)
                for rank, view in sorted(self._views.items())
                if now - view.changed_at >= limit and not view.beat.left
            ]

    def diagnose(
        self,
        timeout_s: float,
        found_elsewhere: Callable[[], bool] = lambda: False,
        stuck_after_s: float | None = None,
        during: int = -1,
    ) -> list[LostRank]:
        """The peers that stopped, or else (with ``stuck_after_s``) live ones stuck outside a collective.

        Called when a collective of this rank failed or timed out; ``[]`` when
        nobody can be named. Waits up to ``timeout_s`` for a verdict: a peer
        that died a moment ago is only known to have stopped once its beat is
        ``stale_after_s`` old, and a live peer's position is only trusted from
        a beat read after the failure, and no sooner than ``stuck_after_s``
        (a peer that failed itself reports within that grace, and its report
        says more). ``found_elsewhere`` is polled each beat; once it is true
        (a peer's own report arrived) this returns ``[]`` at once. ``during``
        is the step of the collective that failed: every peer reached it.

        Only a timeout should name stuck peers: a collective that *failed*
        lost a connection, which a live peer closes only after reporting.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        with self._changed:
            before = {rank: view.changes for rank, view in self._views.items()}
        while True:
            if found_elsewhere():
                return []
            stopped = self.stopped(during=during)
            if stopped:
                return stopped
            with self._changed:
                heard = len(self._views) == len(self._peers)
                live = {rank: view for rank, view in self._views.items() if not view.beat.left}
                # Alive now: two new beats since the failure. One could have been
                # written just before the peer died and read only afterwards.
                fresh = {rank: view.beat for rank, view in live.items() if view.changes - before.get(rank, 0) >= 2}
                beating = self._thread is not None and self._thread.is_alive()
            if heard and len(fresh) == len(live):
                # Every peer still beats: none stopped.
                if stuck_after_s is None:
                    return []
                if time.monotonic() - started >= stuck_after_s:
                    stuck = [_lost(rank, beat, during) for rank, beat in sorted(fresh.items()) if not beat.where.waiting]
                    # The longest-stuck first: the others may only be held up by it.
                    return sorted(stuck, key=lambda rank: -rank.held_for)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not beating or self.store_trouble() is not None:
                return []
            with self._changed:
                self._changed.wait(min(remaining, self.interval_s))

    def last_seen(self, rank: int, during: int = -1) -> LostRank | None:
        """``rank``'s last beat, silent since this rank last heard from it; ``None`` if never."""
        with self._changed:
            view = self._views.get(rank)
        return None if view is None else _lost(rank, view.beat, during, silent_for=time.monotonic() - view.changed_at)

    def stop(self) -> bool:
        """Stop beating; whether the thread ended (its store calls time out, so it does within a few seconds)."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(_STORE_TIMEOUT.total_seconds() + self.interval_s + 1.0)
        return not thread.is_alive()


def _lost(rank: int, beat: Beat, during: int, silent_for: float | None = None) -> LostRank:
    where = beat.where
    # A live rank's fresh beat is where it is; only a silent one's may be behind.
    if silent_for is None or where.step >= during:
        return LostRank(rank, where.step, where.phase, where.device, silent_for, beat.held_s)
    # Its last beat predates the step it must have reached: say which step, and what the beat said.
    return LostRank(rank, during, "", "", silent_for, beat.held_s, heard=f"step {where.step}, {where.phase}")


class DevicePosition(Protocol):
    """What a device actor shows of where it is (read from the heartbeat thread)."""

    step: int
    site: str
    waiting: bool

    @property
    def name(self) -> str: ...


_SITE_ORDER = {"data": 0, "forward": 1, "backward": 2, "evaluate": 2, "optimizer": 3}


def locate(devices: Sequence[DevicePosition], last_step: int) -> Whereabouts:
    """Where a rank inside an operation is: its furthest-behind device, or waiting if every device waits."""
    if not devices:
        return Whereabouts(last_step, "starting the session")
    if all(device.waiting for device in devices):
        return Whereabouts(max(device.step for device in devices), "gradient sync", waiting=True)
    working = [device for device in devices if not device.waiting]
    behind = min(working, key=lambda device: (device.step, _SITE_ORDER.get(device.site, 0)))
    return Whereabouts(behind.step, behind.site, behind.name)
