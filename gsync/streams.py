"""Ordering between gradient producers, the communication thread and the optimizer step.

Three kinds of thread touch a step's gradient buckets:

* the thread where backward runs (autograd's; on CUDA, autograd's per-device
  thread) writes them, and calls :meth:`StreamSync.mark_ready` once a bucket is
  final on that device;
* gsync's communication thread reduces them, between
  :meth:`~StreamSync.before_reduce` and :meth:`~StreamSync.after_reduce`;
* each device's worker thread reads them in ``optimizer.step``, after
  :meth:`~StreamSync.before_apply`.

gsync's messages already order these calls on the host (``BucketReady`` is
posted after ``mark_ready``, a reduction is launched after every device's
``BucketReady``, ``StepSynced`` after every reduction). On CPU a call's work is
done when it returns, so host order is data order and :class:`HostStreamSync`
only *checks* that the calls come in the contract's order. On CUDA a call only
queues kernels, so :class:`CudaStreamSync` turns the same host order into
device order with events: a stream waits on an event (``cudaStreamWaitEvent``),
the host never does, and the event loop and the device threads never block on
the GPU.

The contract, per device and per step (a *round*):

1. ``mark_ready(device, bucket)`` once per bucket, in the thread where that
   bucket's gradients became final, *before* ``BucketReady`` is posted.
2. ``before_reduce(bucket)`` in the communication thread once every device
   marked the bucket, before the bucket's collective is enqueued;
   ``after_reduce(bucket)`` right after it, in the same job.
3. ``after_broadcast()`` in the communication thread after the buffer
   broadcast, when there is one (every bucket reduced, before ``StepSynced``).
4. ``before_apply(device)`` in the device's worker thread after ``StepSynced``
   and before the device touches its buckets or parameters again: before
   ``optimizer.step``, and on a skipped step too (the next step zeroes the
   buckets, which must wait for the reduction as much as the optimizer does).

A device's round ends with its ``before_apply``, so rounds are tracked per
device: a fast device may mark buckets of step ``k + 1`` while a slow one has
not yet applied step ``k``, which a single global "new step" reset could not
express without a barrier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Protocol, runtime_checkable

import torch

from .errors import ConfigError, GsyncError

__all__ = (
    "StreamSync",
    "StreamOrderError",
    "HostStreamSync",
    "CudaStreamSync",
    "make_stream_sync",
)


class StreamOrderError(GsyncError, RuntimeError):
    """A :class:`StreamSync` method was called out of the contract's order.

    This is a bug in the caller (gsync's engine or a custom loop), not in the
    training code: on CUDA the same call sequence would be a data race.
    """


@runtime_checkable
class StreamSync(Protocol):
    """Orders gradient production, reduction and application without blocking the host.

    ``device`` is a position in the device list the object was built with
    (gsync's local device index), ``bucket`` a bucket index of the current plan.
    No method blocks the calling thread on device work except :meth:`close`.
    Methods raise :class:`StreamOrderError` when called out of order or after
    :meth:`close`, and :class:`IndexError` for a device or bucket out of range.
    """

    @property
    def num_devices(self) -> int:
        """How many devices this object orders."""
        ...

    @property
    def num_buckets(self) -> int:
        """How many buckets the current plan has."""
        ...

    def mark_ready(self, device: int, bucket: int) -> None:
        """Bucket ``bucket`` is final on ``device`` for this round.

        Called in the thread where backward runs (the gradient hook), or in the
        device's worker thread for buckets zero-filled after backward, before
        ``BucketReady`` is posted. CUDA: records the bucket's ready event on
        the caller's current stream for that device (the compute stream, when
        backward runs under :meth:`compute_stream`).
        """
        ...

    def before_reduce(self, bucket: int) -> None:
        """The communication thread is about to enqueue ``bucket``'s collective.

        CUDA: each device's comm stream waits on that device's ready event for
        the bucket (a stream wait, no host sync).
        """
        ...

    def after_reduce(self, bucket: int) -> None:
        """The communication thread has enqueued ``bucket``'s collective.

        CUDA: records each device's done event on its comm stream.
        """
        ...

    def after_broadcast(self) -> None:
        """The communication thread has enqueued the step's buffer broadcast (after every bucket).

        CUDA: records each device's done event on its comm stream, so
        ``before_apply`` orders the next forward after the broadcast too.
        """
        ...

    def before_apply(self, device: int) -> None:
        """``device``'s worker thread is about to use the reduced buckets (``optimizer.step``), or to skip the step.

        Ends the device's round. CUDA: the caller's current stream for that
        device (the compute stream, under :meth:`compute_stream`) waits on the
        device's done event, which the in-order comm stream recorded after the
        round's last reduction (and broadcast).
        """
        ...

    def compute_stream(self, device: int) -> AbstractContextManager[None]:
        """Context for ``device``'s worker thread: forward, backward and the optimizer step run inside it.

        CUDA: selects the device and its compute stream; on entry the compute
        stream waits for the work the caller queued before (replicas, loaded
        state, bucket buffers made on the default stream), on exit the
        caller's stream waits for the compute stream (so state read there
        afterwards is current). Both are stream waits, not host syncs.
        """
        ...

    def comm_stream(self, device: int) -> AbstractContextManager[None]:
        """Context for the communication thread: ``device``'s comm stream is current inside it."""
        ...

    def comm_streams(self) -> AbstractContextManager[None]:
        """Context for the communication thread: every device's comm stream is current inside it.

        Wrap work that touches several devices' tensors outside a collective
        (the buffer broadcast's concatenation and copy-back) in it.
        """
        ...

    def rebuild(self, num_buckets: int) -> None:
        """Switch to a plan of ``num_buckets`` buckets.

        Called on the event loop between a round's last reduction (and
        broadcast) and ``StepSynced``, where the engine rebuilds the plan after
        the first step. CUDA: allocates the new plan's ready events (once per fit).
        """
        ...

    def close(self, timeout: float | None = None) -> None:
        """Wait until every stream's queued work is done; later calls raise. Idempotent.

        The only host sync here: call it after the worker and communication
        threads have stopped and before bucket buffers are freed or replica
        state is read outside :meth:`compute_stream`. Blocks the calling thread
        (so not the event loop for long runs).

        :raises TimeoutError: if ``timeout`` seconds pass first (the streams
            are left running; the object counts as closed).
        """
        ...


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


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
        self._num_devices = _positive_int("num_devices", num_devices)
        self._num_buckets = _positive_int("num_buckets", num_buckets)
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
            marked = self._ready.setdefault((round_, bucket), set())
            if device in marked:
                raise StreamOrderError(
                    f"device {device} marked bucket {bucket} ready twice in round {round_}; each bucket is marked "
                    "once per step, and a device's round ends with before_apply"
                )
            marked.add(device)

    def before_reduce(self, bucket: int) -> None:
        with self._lock:
            self._check_open()
            self._check_bucket(bucket)
            if bucket in self._reducing:
                raise StreamOrderError(f"before_reduce({bucket}) called again before after_reduce({bucket})")
            round_ = self._reduced[bucket]
            marked = self._ready.get((round_, bucket), set())
            missing = [d for d in range(self._num_devices) if d not in marked]
            if missing:
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
            pending = [b for b, reduced in enumerate(self._reduced) if reduced <= round_]
            if pending:
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
        num_buckets = _positive_int("num_buckets", num_buckets)
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


def _cuda_devices(devices: Sequence[torch.device | str], what: str) -> tuple[torch.device, ...]:
    """Canonical, distinct ``cuda:N`` devices.

    :raises ~gsync.ConfigError: if CUDA is unavailable, or a device is not
        CUDA, does not exist, or is listed twice.
    """
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ConfigError(f"{what} needs a non-empty list of CUDA devices, got {devices!r}")
    try:
        parsed = [torch.device(device) for device in devices]
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"{what}: cannot parse devices {list(devices)!r}: {error}") from None
    not_cuda = [str(device) for device in parsed if device.type != "cuda"]
    if not_cuda:
        raise ConfigError(f"{what} works on CUDA devices only, got {not_cuda}; CPU devices use HostStreamSync")
    if not torch.cuda.is_available():
        raise ConfigError(f"{what} needs CUDA, but torch.cuda.is_available() is False on this machine")
    count = torch.cuda.device_count()
    canonical = []
    for device in parsed:
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise ConfigError(f"{what}: device cuda:{index} does not exist; this machine has {count} CUDA device(s)")
        canonical.append(torch.device("cuda", index))
    if len(set(canonical)) != len(canonical):
        raise ConfigError(
            f"{what} needs distinct CUDA devices, got {[str(d) for d in canonical]}; each device holds one replica"
        )
    return tuple(canonical)


def _event() -> torch.cuda.Event:
    # The CUDA event behind it is created lazily, on the first record.
    return torch.cuda.Event(disable_timing=True)


class CudaStreamSync:
    """The CUDA :class:`StreamSync`: per device, a compute stream, a comm stream and reusable events.

    Events are made once per (device, bucket) for readiness, plus one done
    event per device, and re-recorded every step: no per-step allocation.
    Reuse is safe because a stream wait captures the event's *latest record at
    the time of the wait call*, and the host order of the calls is fixed: a
    bucket's ready event of step ``k + 1`` is recorded only after the device's
    ``before_apply`` of step ``k``, which follows the ``before_reduce`` that
    waited on step ``k``'s record; the done event of step ``k + 1`` is
    recorded only after a reduction that needed step ``k + 1``'s readiness,
    which follows the device's ``before_apply`` (the wait) of step ``k``.

    One done event per device is enough: the comm stream is in order, so its
    last record of a round follows every reduction and broadcast of the round.

    Bucket buffers need no ``record_stream``: they live for the whole fit and
    are freed only after :meth:`close` drained every stream. (A plan rebuild
    replaces the first plan's buffers mid-fit; build them under
    :meth:`compute_stream`, so their allocation stream is the compute stream,
    which has waited on the comm stream in ``before_apply`` before it frees them.)

    With ``check_order`` (the default) every call is also checked against the
    contract by a :class:`HostStreamSync`, for a lock and a few set operations
    per call, so an ordering bug raises instead of racing on the GPU.

    Streams come from PyTorch's per-device stream pool; the comm stream is
    taken at a higher priority (``comm_priority``, lower is higher) so
    reductions are scheduled ahead of the backward kernels they overlap with.

    :raises ~gsync.ConfigError: without CUDA, or for devices that are not
        distinct existing CUDA devices, or a bad ``num_buckets``.
    """

    def __init__(
        self,
        devices: Sequence[torch.device | str],
        num_buckets: int,
        *,
        check_order: bool = True,
        comm_priority: int = -1,
    ) -> None:
        self._devices = _cuda_devices(devices, "CudaStreamSync")
        self._num_buckets = _positive_int("num_buckets", num_buckets)
        self._order = HostStreamSync(len(self._devices), num_buckets) if check_order else None
        self._compute = [torch.cuda.Stream(device=device) for device in self._devices]
        self._comm = [torch.cuda.Stream(device=device, priority=comm_priority) for device in self._devices]
        self._ready = [[_event() for _ in range(num_buckets)] for _ in self._devices]
        self._done = [_event() for _ in self._devices]
        self._entered = [_event() for _ in self._devices]
        self._exited = [_event() for _ in self._devices]
        self._closed = False

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self._devices

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    def compute_cuda_stream(self, device: int) -> torch.cuda.Stream:
        """``device``'s compute stream itself (for collectives and tests)."""
        return self._compute[self._index(device)]

    def comm_cuda_stream(self, device: int) -> torch.cuda.Stream:
        """``device``'s comm stream itself (collectives enqueue on it)."""
        return self._comm[self._index(device)]

    def mark_ready(self, device: int, bucket: int) -> None:
        if self._order is not None:
            self._order.mark_ready(device, bucket)
        else:
            self._check(device, bucket)
        # The current stream, not self._compute: in autograd's thread it is the
        # stream autograd ran this gradient's kernels on, which is the one to order after.
        self._ready[device][bucket].record(torch.cuda.current_stream(self._devices[device]))

    def before_reduce(self, bucket: int) -> None:
        if self._order is not None:
            self._order.before_reduce(bucket)
        else:
            self._check(0, bucket)
        for comm, ready in zip(self._comm, self._ready):
            comm.wait_event(ready[bucket])

    def after_reduce(self, bucket: int) -> None:
        if self._order is not None:
            self._order.after_reduce(bucket)
        else:
            self._check(0, bucket)
        self._record_done()

    def after_broadcast(self) -> None:
        if self._order is not None:
            self._order.after_broadcast()
        else:
            self._check(0, 0)
        self._record_done()

    def before_apply(self, device: int) -> None:
        if self._order is not None:
            self._order.before_apply(device)
        else:
            self._check(device, 0)
        torch.cuda.current_stream(self._devices[device]).wait_event(self._done[device])

    def compute_stream(self, device: int) -> AbstractContextManager[None]:
        self._check(device, 0)
        return self._compute_context(device)

    @contextmanager
    def _compute_context(self, device: int) -> Iterator[None]:
        target = self._devices[device]
        compute = self._compute[device]
        with torch.cuda.device(target):
            caller = torch.cuda.current_stream(target)
            joined = caller.cuda_stream != compute.cuda_stream
            if joined:
                self._entered[device].record(caller)
                compute.wait_event(self._entered[device])
            try:
                with torch.cuda.stream(compute):
                    yield
            finally:
                # Also on failure: the engine reads a checkpoint from the replicas afterwards.
                if joined:
                    self._exited[device].record(compute)
                    caller.wait_event(self._exited[device])

    def comm_stream(self, device: int) -> AbstractContextManager[None]:
        self._check(device, 0)
        return torch.cuda.stream(self._comm[device])

    def comm_streams(self) -> AbstractContextManager[None]:
        self._check(0, 0)
        return self._all_comm_context()

    @contextmanager
    def _all_comm_context(self) -> Iterator[None]:
        with ExitStack() as stack:
            for comm in self._comm:
                stack.enter_context(torch.cuda.stream(comm))
            yield

    def rebuild(self, num_buckets: int) -> None:
        num_buckets = _positive_int("num_buckets", num_buckets)
        self._check(0, 0)
        if self._order is not None:
            self._order.rebuild(num_buckets)
        # The old events' last records were all waited on by the round's
        # before_reduce calls, so they can simply be dropped.
        self._ready = [[_event() for _ in range(num_buckets)] for _ in self._devices]
        self._num_buckets = num_buckets

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._order is not None:
            self._order.close()
        streams = [*self._comm, *self._compute]
        if timeout is None:
            for stream in streams:
                stream.synchronize()
            return
        deadline = time.monotonic() + timeout
        delay = 1e-4
        # Polled rather than synchronized, so a stuck kernel cannot hold teardown forever.
        while not all(stream.query() for stream in streams):
            if time.monotonic() >= deadline:
                busy = sorted({str(s.device) for s in streams if not s.query()})
                raise TimeoutError(f"CUDA streams on {busy} still busy {timeout:g} s after close()")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _record_done(self) -> None:
        for comm, done in zip(self._comm, self._done):
            done.record(comm)

    def _index(self, device: int) -> int:
        if not 0 <= device < len(self._devices):
            raise IndexError(f"device {device} out of range: this stream sync orders {len(self._devices)} device(s)")
        return device

    def _check(self, device: int, bucket: int) -> None:
        if self._closed:
            raise StreamOrderError("this stream sync is closed; build a new one for another fit")
        self._index(device)
        if not 0 <= bucket < self._num_buckets:
            raise IndexError(f"bucket {bucket} out of range: the plan has {self._num_buckets} bucket(s)")


def make_stream_sync(devices: Sequence[torch.device | str], num_buckets: int) -> StreamSync:
    """The :class:`StreamSync` for ``devices``: :class:`CudaStreamSync` for CUDA, :class:`HostStreamSync` for CPU.

    CPU devices may repeat (gsync's virtual ``cpu:N`` devices all live on
    ``torch.device("cpu")``).

    :raises ~gsync.ConfigError: for an empty list, a mix of CPU and CUDA
        devices, another device type, or (CUDA) what :class:`CudaStreamSync` rejects.
    """
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ConfigError(f"make_stream_sync needs a non-empty list of devices, got {devices!r}")
    try:
        types = {torch.device(device).type for device in devices}
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"make_stream_sync: cannot parse devices {list(devices)!r}: {error}") from None
    if types == {"cuda"}:
        return CudaStreamSync(devices, num_buckets)
    if types == {"cpu"}:
        return HostStreamSync(len(devices), num_buckets)
    raise ConfigError(
        f"devices {[str(d) for d in devices]} mix device types {sorted(types)}; gsync trains on all-CPU or all-CUDA devices"
    )
