"""The CPU :class:`~gsync._core.streams.StreamSync`: nothing to wait for, so it checks the ordering contract."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

from .base import StreamOrderError, positive_int

__all__ = ("HostStreamSync",)


class HostStreamSync:
    """The CPU :class:`StreamSync`: work is complete when each call returns, so nothing waits.

    It enforces the ordering contract instead, raising :class:`StreamOrderError`
    at the first call that would be a race on a device with queued work:

    * a bucket marked twice by one device in one round, or marked after its
      reduction in that round already began;
    * ``before_reduce(b)`` before every device marked ``b`` in the bucket's
      current round, or twice without ``after_reduce(b)`` between;
    * ``after_reduce(b)`` without ``before_reduce(b)``;
    * ``after_broadcast()`` while a reduction is in flight, before every
      bucket of the round is reduced, or after a device already applied it;
    * ``before_apply(d)`` before every bucket of ``d``'s round was reduced.

    Rounds reset per device on ``before_apply``; nothing needs to be called
    between steps. Thread-safe: every method takes one lock, for a few set
    operations, and never blocks otherwise.
    """

    def __init__(self, num_devices: int, num_buckets: int) -> None:
        self._num_devices = positive_int("num_devices", num_devices)
        self._num_buckets = positive_int("num_buckets", num_buckets)
        self._lock = threading.Lock()
        self._applied = [0] * self._num_devices
        """Per device: rounds it has finished (``before_apply`` calls)."""
        self._reduced = [0] * self._num_buckets
        """Per bucket: rounds in which it has been reduced."""
        self._reducing: set[int] = set()
        self._ready: dict[tuple[int, int], set[int]] = {}
        """(round, bucket) -> devices that marked it; kept until every device finished that round."""
        self._closed = False

    @property
    def num_devices(self) -> int:
        return self._num_devices

    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    def rounds_applied(self, device: int) -> int:
        """How many rounds ``device`` has finished (for diagnostics and tests)."""
        with self._lock:
            self._check_device(device)
            return self._applied[device]

    def mark_ready(self, device: int, bucket: int) -> None:
        with self._lock:
            self._check_open()
            self._check_device(device)
            self._check_bucket(bucket)
            round_ = self._applied[device]
            if self._reduced[bucket] > round_ or (bucket in self._reducing and self._reduced[bucket] == round_):
                raise StreamOrderError(
                    f"device {device} marked bucket {bucket} ready in round {round_}, after that bucket's "
                    "reduction in the round began: the gradient written since would be lost or race the collective"
                )
            key = (round_, bucket)
            marked = self._ready.get(key)
            if marked is None:
                # Made once per bucket and round, not per mark (setdefault would build a set every call).
                marked = self._ready[key] = set()
            elif device in marked:
                raise StreamOrderError(
                    f"device {device} marked bucket {bucket} ready twice in round {round_}; each bucket is marked "
                    "once per step, and a device's round ends with before_apply"
                )
            marked.add(device)

    def before_write(self, device: int) -> None:
        with self._lock:
            self._check_open()
            self._check_device(device)

    def before_reduce(self, bucket: int) -> None:
        with self._lock:
            self._check_open()
            self._check_bucket(bucket)
            if bucket in self._reducing:
                raise StreamOrderError(f"before_reduce({bucket}) called again before after_reduce({bucket})")
            round_ = self._reduced[bucket]
            marked = self._ready.get((round_, bucket))
            # Marks are distinct valid devices, so a full count is every device: who is missing is worked out
            # only for the error, not per bucket.
            if marked is None or len(marked) < self._num_devices:
                missing = [d for d in range(self._num_devices) if marked is None or d not in marked]
                raise StreamOrderError(
                    f"bucket {bucket} is being reduced in round {round_} before devices {missing} marked it "
                    "ready: the collective would read gradients still being written"
                )
            self._reducing.add(bucket)

    def after_reduce(self, bucket: int) -> None:
        with self._lock:
            self._check_open()
            self._check_bucket(bucket)
            if bucket not in self._reducing:
                raise StreamOrderError(f"after_reduce({bucket}) without a matching before_reduce({bucket})")
            self._reducing.discard(bucket)
            self._reduced[bucket] += 1

    def after_broadcast(self) -> None:
        with self._lock:
            self._check_open()
            if self._reducing:
                raise StreamOrderError(
                    f"after_broadcast() while buckets {sorted(self._reducing)} are still being reduced"
                )
            rounds = set(self._reduced)
            if len(rounds) != 1 or self._reduced[0] == 0:
                behind = [b for b, r in enumerate(self._reduced) if r < max(self._reduced)]
                raise StreamOrderError(
                    f"after_broadcast() before every bucket of the round was reduced (buckets {behind or 'all'} "
                    "are behind): the buffer broadcast follows the last reduction of a step"
                )
            round_ = self._reduced[0] - 1
            ahead = [d for d, applied in enumerate(self._applied) if applied > round_]
            if ahead:
                raise StreamOrderError(
                    f"after_broadcast() for round {round_} after devices {ahead} already applied it: "
                    "StepSynced must follow the broadcast"
                )

    def before_apply(self, device: int) -> None:
        with self._lock:
            self._check_open()
            self._check_device(device)
            round_ = self._applied[device]
            if min(self._reduced) <= round_:
                pending = [b for b, reduced in enumerate(self._reduced) if reduced <= round_]
                raise StreamOrderError(
                    f"device {device} applies round {round_} before buckets {pending} were reduced: "
                    "before_apply follows StepSynced, which follows every bucket's after_reduce"
                )
            self._applied[device] = round_ + 1
            if min(self._applied) > round_:
                # The last device to finish this round: nobody can mark it again.
                for key in [key for key in self._ready if key[0] <= round_]:
                    del self._ready[key]

    def compute_stream(self, device: int) -> AbstractContextManager[None]:
        with self._lock:
            self._check_open()
            self._check_device(device)
        return nullcontext()

    def comm_stream(self, device: int) -> AbstractContextManager[None]:
        with self._lock:
            self._check_open()
            self._check_device(device)
        return nullcontext()

    def comm_streams(self) -> AbstractContextManager[None]:
        with self._lock:
            self._check_open()
        return nullcontext()

    def rebuild(self, num_buckets: int) -> None:
        num_buckets = positive_int("num_buckets", num_buckets)
        with self._lock:
            self._check_open()
            if self._reducing or len(set(self._reduced)) != 1:
                raise StreamOrderError(
                    "rebuild() in the middle of a round's reductions; rebuild between the round's last "
                    "after_reduce and StepSynced"
                )
            round_ = self._reduced[0]
            early = sorted({d for (r, _), devices in self._ready.items() if r >= round_ for d in devices})
            if early:
                raise StreamOrderError(
                    f"rebuild() after devices {early} already marked buckets of round {round_} under the old plan"
                )
            self._num_buckets = num_buckets
            self._reduced = [round_] * num_buckets

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closed = True
            self._ready.clear()
            self._reducing.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise StreamOrderError("this stream sync is closed; build a new one for another fit")

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self._num_devices:
            raise IndexError(f"device {device} out of range: this stream sync orders {self._num_devices} device(s)")

    def _check_bucket(self, bucket: int) -> None:
        if not 0 <= bucket < self._num_buckets:
            raise IndexError(f"bucket {bucket} out of range: the plan has {self._num_buckets} bucket(s)")
