"""The failure side channel: a failed rank tells the others through the store, as msgpack messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch.distributed as dist

from ...errors import (
    SESSION_START,
    ConfigError,
    DataFailed,
    GsyncError,
    NonFiniteLoss,
    PeerFailed,
    PeerLost,
    SyncFailed,
    SyncTimeout,
    WorkerFailed,
)
from .membership import GroupMembership

__all__ = ("FailureBoard", "FailureReport", "failure_report", "peer_failed")

_MAX_MESSAGE_CHARS = 4000


class FailureReport(msgspec.Struct, frozen=True, tag=True):
    """What one rank tells the others when its fit failed; msgpack-encoded in the store.

    ``device`` is empty (and ``device_index`` -1) for a failure not tied to
    one device; ``step`` is -1 when no step was involved.
    """

    rank: int
    device: str
    device_index: int
    step: int
    site: str
    error_type: str
    message: str
    operations: int = -1
    """For a rank that left its session normally: how many steps, evaluates and all_reduces it completed."""


# Store values are msgpack bytes: Store.set takes bytes, though torch's stubs say str (hence the ignores).
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(FailureReport)


def failure_report(rank: int, error: BaseException, fallback_site: str = "fit") -> FailureReport:
    """The report a rank publishes for the error that ends its fit.

    ``WorkerFailed`` reports its device, step and site with its cause's type
    and message; ``SyncFailed``, ``SyncTimeout`` and ``DataFailed`` report
    the step and their site (a collective, ``"evaluate"``, ...); other errors
    that name a device and step (``NonFiniteLoss``) report those; anything
    else is reported with its type and message, at ``fallback_site``. A
    :class:`PeerFailed` is a consequence of another rank's report: do not
    report it again; a :class:`PeerLost` is reported (the lost ranks cannot
    report themselves), and peers read it as :class:`PeerFailed` with
    ``error_type`` ``"PeerLost"``.
    """
    device = getattr(error, "device", "")
    device = device if isinstance(device, str) else ""
    device_index = getattr(error, "device_index", -1) if device else -1
    step = getattr(error, "step", -1)
    step = step if isinstance(step, int) else -1
    site = getattr(error, "site", "")
    site = site if isinstance(site, str) else ""
    root: BaseException = error
    if isinstance(error, (WorkerFailed, SyncFailed, DataFailed)):
        root = error.__cause__ or error  # each names its site itself; the cause is what went wrong
    elif isinstance(error, NonFiniteLoss):
        site = "loss check"
    elif isinstance(error, PeerLost):
        # Reported by the rank that named them; the device and step are its own collective's, not the lost rank's.
        cause = error.__cause__
        device, device_index = "", -1
        # A timeout names what it waited for; a failed collective of a step is "collective", of a start its site.
        site = getattr(cause, "site", "") if isinstance(cause, SyncTimeout) else "collective"
        if getattr(cause, "site", None) == SESSION_START:
            site = SESSION_START
        step = getattr(cause, "step", step)
    message = str(root)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " [truncated]"
    return FailureReport(rank, device, int(device_index), step, site or fallback_site, type(root).__name__, message)


def peer_failed(report: FailureReport) -> PeerFailed:
    """The error this rank raises for another rank's report."""
    return PeerFailed(
        report.rank, report.device, report.step, report.site, report.error_type, report.message, report.device_index
    )


# The watcher blocks in store.wait for this long per call when it has its own
# store connection; stop() wakes it through the store at once, so the slice
# only bounds how often TCPStore logs its "wait timed out" warning. Without
# its own connection (a store that cannot be cloned) the watcher would hold
# the shared connection's lock while waiting, so it waits in short slices.
_WATCH_SLICE = timedelta(seconds=3600)
_SHARED_WATCH_SLICE = timedelta(seconds=0.2)
_STOP = b"stop"


class FailureBoard:
    """The failure side channel of one group membership (one run), over its store.

    Keys live under the membership's namespace:
    ``<ns>/failures`` counts reports, ``<ns>/failure/<n>`` holds the n-th
    (msgpack), and ``<ns>/wake/<rank>`` is set to wake ``rank``'s watcher.
    """

    def __init__(self, member: GroupMembership, name: int | None = None) -> None:
        self._store = member.store
        self._rank = member.rank
        # The rank reports name this member by: its launch rank in an elastic run (its group rank changes).
        self._name = member.rank if name is None else name
        self._world_size = member.world_size
        self._namespace = member.namespace
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.report_error: BaseException | None = None
        """Why the last :meth:`report` could not be published, if it could not."""
        self.watch_error: BaseException | None = None
        """Why the watcher ended without a report (the store went away, or the callback raised)."""

    def _key(self, *parts: object) -> str:
        return "/".join((self._namespace, *(str(p) for p in parts)))

    def report(self, report: FailureReport) -> bool:
        """Publish ``report`` to every other rank; ``False`` if the store could not be reached.

        Blocks for ``world_size + 1`` small store writes. It never raises for
        store trouble: the local failure is what the caller is raising, and a
        store that is gone means the peers are ending anyway (the error is
        kept in :attr:`report_error`).

        :raises ~gsync.ConfigError: when ``report.rank`` is not this member's rank.
        """
        if report.rank != self._name:
            raise ConfigError(f"a FailureReport for rank {report.rank} cannot be published by rank {self._name}")
        try:
            sequence = self._store.add(self._key("failures"), 1)
            self._store.set(self._key("failure", sequence), _ENCODER.encode(report))  # type: ignore[arg-type]
            # Wake keys go last: a woken watcher always finds the report.
            for rank in range(self._world_size):
                if rank != self._rank:
                    self._store.set(self._key("wake", rank), str(sequence))
        except Exception as error:  # noqa: BLE001 - kept for the caller, see docstring
            self.report_error = error
            return False
        return True

    def peer_report(self, timeout_s: float = 0.0) -> FailureReport | None:
        """The first report of another rank, waiting up to ``timeout_s`` for one; ``None`` if none.

        Blocks up to ``timeout_s`` (call it from a worker thread, not the
        event loop). Use it to name the root cause when a collective failed
        or timed out: a peer that failed may have closed its connections
        before this rank's watcher heard of the report.
        """
        found = self._scan(self._store)
        if found is not None or timeout_s <= 0:
            return found
        try:
            self._store.wait([self._key("wake", self._rank)], timedelta(seconds=timeout_s))
        except dist.DistError:
            return None
        return self._scan(self._store)

    def _scan(self, store: dist.Store) -> FailureReport | None:
        # A rank's own failure is the root cause; another survivor's verdict
        # on lost peers ("PeerLost") is returned only when there is none.
        count = store.add(self._key("failures"), 0)
        verdict: FailureReport | None = None
        for sequence in range(1, count + 1):
            key = self._key("failure", sequence)
            # The counter is bumped before the report is written.
            if not store.check([key]):
                continue
            report = _DECODER.decode(store.get(key))
            if report.rank == self._name:
                continue
            if report.error_type != "PeerLost":
                return report
            verdict = verdict or report
        return verdict

    def start_watching(self, callback: Callable[[FailureReport], object]) -> None:
        """Start the ``gsync-failure-watch`` daemon thread; it calls ``callback(report)`` once.

        The callback runs in the watcher thread, for the first report from
        another rank (never for this rank's own); hand it to the event loop
        from there, and tolerate a call that races with :meth:`stop`. The
        thread ends after the callback, on :meth:`stop`, or when the store
        goes away (see :attr:`watch_error`).

        The watcher blocks in ``store.wait`` on its own store connection and
        is woken through the store (by a report, or by :meth:`stop`) rather
        than polling: TCPStore logs two C++ warnings for every wait that
        times out, so waking every 0.2 s would flood stderr.

        :raises ~gsync.GsyncError: if this board is already watching or was stopped.
        """
        if self._thread is not None or self._stopping.is_set():
            raise GsyncError("this FailureBoard is already watching or was stopped; make a new board per run")
        store, slice_ = _own_connection(self._store)
        self._thread = threading.Thread(
            target=self._watch, args=(store, slice_, callback), name="gsync-failure-watch", daemon=True
        )
        self._thread.start()

    def _watch(self, store: dist.Store, slice_: timedelta, callback: Callable[[FailureReport], object]) -> None:
        wake = self._key("wake", self._rank)
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    store.wait([wake], slice_)
                except dist.DistStoreError:
                    # A wait that ran its slice is a timeout: wait again. One
                    # that failed early is the store failing: give up below.
                    if time.monotonic() - started < slice_.total_seconds() / 2:
                        raise
                    continue
                if self._stopping.is_set():
                    return
                report = self._scan(store)
                if report is not None:
                    callback(report)
                # Woken means a peer's report exists (or stop() woke us): either way, done.
                return
        except Exception as error:  # noqa: BLE001 - a watcher has no caller; the board keeps the error
            if not self._stopping.is_set():
                self.watch_error = error

    def stop(self, timeout_s: float = 2.0, wake: bool = True) -> bool:
        """Stop the watcher and join it for up to ``timeout_s``; whether it has ended. Idempotent.

        Wakes the watcher through the store (one write, which blocks only as
        long as the store takes to answer), so it ends at once rather than at
        its next timeout. If the store server is gone, the watcher's wait has
        already failed and it has ended; only a server that is alive but
        unresponsive leaves the daemon thread waiting, and then this returns
        ``False`` after ``timeout_s``. ``wake=False`` is for a store that looks
        unresponsive: the write goes to a daemon thread of its own and this
        returns at once (``False``), so a store that was only slow for a
        moment still ends the watcher now, not after its hour-long wait.
        """
        self._stopping.set()
        thread = self._thread
        if thread is None:
            return True
        if not thread.is_alive():
            return True
        if not wake:
            threading.Thread(target=self._wake, name="gsync-failure-watch-wake", daemon=True).start()
            return False
        self._wake()
        thread.join(timeout_s)
        return not thread.is_alive()

    def _wake(self) -> None:
        try:
            self._store.set(self._key("wake", self._rank), _STOP)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a store that is gone has already ended the watcher's wait
            pass


def _own_connection(store: dist.Store) -> tuple[dist.Store, timedelta]:
    # A TCPStore client serialises its operations; a watcher blocked on the
    # shared client would stall report() and everyone else using the store.
    try:
        return store.clone(), _WATCH_SLICE  # type: ignore[attr-defined]  # in torch, not in its stubs
    except Exception:  # noqa: BLE001 - stores that cannot clone raise various errors
        return store, _SHARED_WATCH_SLICE
