"""The CUDA :class:`~gsync._core.streams.StreamSync`: per-device compute and comm streams ordered by events.

Nothing CUDA is created at import time: this module is imported on CPU-only machines too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Protocol

import torch

from ..threads import FitAborted
from ...errors import ConfigError
from .base import StreamOrderError, positive_int
from .host import HostStreamSync

__all__ = ("CudaStreamSync", "cuda_devices", "on_device", "wait_on_host")


class Queryable(Protocol):
    """What :func:`wait_on_host` needs of an event: ``torch.cuda.Event.query``."""

    def query(self) -> bool: ...


_FIRST_POLL_S = 2e-5
_LAST_POLL_S = 1e-3


def wait_on_host(event: Queryable, abort: threading.Event | None) -> None:
    """Block the calling thread until ``event``'s work is done, leaving with :class:`~gsync._core.threads.FitAborted`
    once ``abort`` is set.

    ``Event.synchronize`` cannot be interrupted: behind a collective a dead
    peer never completes, a thread in it stays there until the process
    dies. It also spins a core at 100 % for the whole wait. So the event
    is polled, at first every 20 us (a short wait stays short), backing off
    to 1 ms (a long one costs next to nothing), and the abort flag is read
    between polls.

    :raises ~gsync._core.threads.FitAborted: when ``abort`` is set before the work is done.
    """
    delay = _FIRST_POLL_S
    while not event.query():
        if abort is not None and abort.is_set():
            raise FitAborted
        time.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)


@contextmanager
def on_device(stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` with ``stream``'s device selected around it.

    Leaving ``torch.cuda.stream`` restores the stream that was current on the
    device current at entry, with ``set_stream``, which selects that device:
    in a thread that never chose one, device 0, whose CUDA context (about
    0.5 GB on CUDA 12) is then created even in a process that only uses
    another GPU. ``torch.cuda.device`` restores the previous device only
    where it already has a context, so entering it first keeps the thread
    off devices it does not use.

    Where ``stream``'s device is already selected and ``stream`` already
    current on it, nothing is entered: leaving would restore just that. The
    sync server enters every comm stream around a collective, which enters
    its device's comm stream again for each bucket.
    """
    if (
        torch.cuda.current_device() == stream.device.index
        and torch.cuda.current_stream(stream.device).cuda_stream == stream.cuda_stream
    ):
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def cuda_devices(devices: Sequence[torch.device | str], what: str) -> tuple[torch.device, ...]:
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
    # Timing stays off (the default), which makes events cheaper to record.
    return torch.cuda.Event()


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
    It is recorded once per round, after the round's last reduction (and after
    the broadcast), not after every bucket: ``before_apply`` waits for the
    whole round, so the earlier records of a round would only be overwritten
    before anything waited on them.

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
        self._devices = cuda_devices(devices, "CudaStreamSync")
        self._num_buckets = positive_int("num_buckets", num_buckets)
        self._order = HostStreamSync(len(self._devices), num_buckets) if check_order else None
        self._compute = [torch.cuda.Stream(device=device) for device in self._devices]
        self._comm = [torch.cuda.Stream(device=device, priority=comm_priority) for device in self._devices]
        self._ready = [[_event() for _ in range(num_buckets)] for _ in self._devices]
        self._done = [_event() for _ in self._devices]
        self._entered = [_event() for _ in self._devices]
        self._exited = [_event() for _ in self._devices]
        # Recorded on the compute stream as each job enters it: what another stream writing the device's
        # buckets in that job must follow (see before_write).
        self._started = [_event() for _ in self._devices]
        # after_reduce calls of the round in progress: the round's last one records the done events. Each bucket is
        # reduced once per round, and no bucket of the next round before the last of this one (the next round's
        # marks follow every device's before_apply, which follows every reduction of this round).
        self._reduced_in_round = 0
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

    def before_write(self, device: int) -> None:
        self._check(device, 0)
        current = torch.cuda.current_stream(self._devices[device])
        if current.cuda_stream != self._compute[device].cuda_stream:
            current.wait_event(self._started[device])

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
        self._reduced_in_round += 1
        if self._reduced_in_round >= self._num_buckets:
            self._reduced_in_round = 0
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
                    # Behind the previous job's optimizer step and its before_apply wait on the reductions.
                    self._started[device].record(compute)
                    yield
            finally:
                # Also on failure: the engine reads a checkpoint from the replicas afterwards.
                if joined:
                    self._exited[device].record(compute)
                    caller.wait_event(self._exited[device])

    def comm_stream(self, device: int) -> AbstractContextManager[None]:
        self._check(device, 0)
        return on_device(self._comm[device])

    def comm_streams(self) -> AbstractContextManager[None]:
        self._check(0, 0)
        if len(self._comm) == 1:
            return on_device(self._comm[0])  # the same, without an ExitStack per bucket
        return self._all_comm_context()

    @contextmanager
    def _all_comm_context(self) -> Iterator[None]:
        with ExitStack() as stack:
            for comm in self._comm:
                stack.enter_context(on_device(comm))
            yield

    def rebuild(self, num_buckets: int) -> None:
        num_buckets = positive_int("num_buckets", num_buckets)
        self._check(0, 0)
        if self._order is not None:
            self._order.rebuild(num_buckets)
        # The old events' last records were all waited on by the round's
        # before_reduce calls, so they can simply be dropped.
        self._ready = [[_event() for _ in range(num_buckets)] for _ in self._devices]
        self._num_buckets = num_buckets
        self._reduced_in_round = 0

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
