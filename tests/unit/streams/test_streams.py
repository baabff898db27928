"""The StreamSync ordering contract and the CUDA stream/event wiring (the NCCL collective: tests/unit/transports).

Three layers:

* ``HostStreamSync`` (runs everywhere): the contract is enforced, violations
  raise, rounds reset per device, marks from many threads are not lost.
* ``CudaStreamSync`` against a fake ``torch.cuda`` (runs everywhere): the fake
  keeps a vector clock per stream, so each test asserts which kernels are
  ordered before which, exactly as CUDA would order them, and that nothing
  synchronizes the host before ``close``.
* Real CUDA (skipped without a GPU): the same ordering on a GPU with a long
  kernel in flight.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import gsync
from gsync._core.streams import CudaStreamSync, HostStreamSync, StreamOrderError, StreamSync, make_stream_sync
from gsync._core.streams.cuda import on_device
from tests.support.cuda import cuda_devices, in_thread, long_kernel, needs_cuda, warm_kernels


# --------------------------------------------------------------------------------------------------
# HostStreamSync: the contract
# --------------------------------------------------------------------------------------------------


def run_round(sync: StreamSync, devices: int, buckets: int, broadcast: bool = False) -> None:
    for bucket in range(buckets):
        for device in range(devices):
            sync.mark_ready(device, bucket)
        sync.before_reduce(bucket)
        sync.after_reduce(bucket)
    if broadcast:
        sync.after_broadcast()
    for device in range(devices):
        sync.before_apply(device)


def test_host_is_a_stream_sync_and_chosen_for_cpu() -> None:
    sync = make_stream_sync(["cpu:0", "cpu:1", torch.device("cpu")], 4)
    assert isinstance(sync, HostStreamSync)
    assert isinstance(sync, StreamSync)
    assert (sync.num_devices, sync.num_buckets) == (3, 4)


@pytest.mark.parametrize(
    "devices", [[], ["cpu", "cuda:0"], ["meta"], ["nonsense:device"], "cpu"], ids=["empty", "mixed", "meta", "bad", "str"]
)
def test_make_stream_sync_rejects_bad_device_lists(devices: Any) -> None:
    with pytest.raises(gsync.ConfigError):
        make_stream_sync(devices, 1)


@pytest.mark.parametrize("sizes", [(0, 1), (1, 0), (True, 1), (2, 1.5)])
def test_host_rejects_bad_sizes(sizes: tuple[Any, Any]) -> None:
    with pytest.raises(gsync.ConfigError):
        HostStreamSync(*sizes)


def test_host_accepts_the_contract_order_for_many_steps() -> None:
    sync = HostStreamSync(3, 4)
    for _ in range(5):
        run_round(sync, 3, 4, broadcast=True)
    assert [sync.rounds_applied(d) for d in range(3)] == [5, 5, 5]


def test_reducing_before_every_device_is_ready_raises() -> None:
    sync = HostStreamSync(3, 2)
    sync.mark_ready(0, 0)
    sync.mark_ready(2, 0)
    with pytest.raises(StreamOrderError, match=r"bucket 0 .* before devices \[1\] marked it ready"):
        sync.before_reduce(0)
    sync.mark_ready(1, 0)
    sync.before_reduce(0)


def test_marking_a_bucket_twice_in_one_round_raises() -> None:
    sync = HostStreamSync(2, 2)
    sync.mark_ready(1, 1)
    with pytest.raises(StreamOrderError, match="twice"):
        sync.mark_ready(1, 1)


def test_marking_after_the_reduction_began_raises() -> None:
    sync = HostStreamSync(1, 1)
    sync.mark_ready(0, 0)
    sync.before_reduce(0)
    with pytest.raises(StreamOrderError):
        sync.mark_ready(0, 0)
    sync.after_reduce(0)
    with pytest.raises(StreamOrderError, match="after that bucket's reduction"):
        sync.mark_ready(0, 0)


def test_reduce_calls_must_pair() -> None:
    sync = HostStreamSync(1, 2)
    with pytest.raises(StreamOrderError, match="without a matching before_reduce"):
        sync.after_reduce(0)
    sync.mark_ready(0, 0)
    sync.before_reduce(0)
    with pytest.raises(StreamOrderError, match="again before after_reduce"):
        sync.before_reduce(0)


def test_applying_before_every_bucket_is_reduced_raises() -> None:
    sync = HostStreamSync(2, 3)
    for bucket in range(3):
        sync.mark_ready(0, bucket)
        sync.mark_ready(1, bucket)
    for bucket in (0, 2):
        sync.before_reduce(bucket)
        sync.after_reduce(bucket)
    with pytest.raises(StreamOrderError, match=r"before buckets \[1\] were reduced"):
        sync.before_apply(0)
    sync.before_reduce(1)
    with pytest.raises(StreamOrderError, match=r"buckets \[1\]"):
        sync.before_apply(1)  # in flight is not reduced
    sync.after_reduce(1)
    sync.before_apply(0)
    sync.before_apply(1)


def test_broadcast_comes_after_every_reduction_and_before_apply() -> None:
    sync = HostStreamSync(2, 2)
    with pytest.raises(StreamOrderError, match="before every bucket"):
        sync.after_broadcast()
    for device in range(2):
        sync.mark_ready(device, 0)
    sync.before_reduce(0)
    with pytest.raises(StreamOrderError, match="still being reduced"):
        sync.after_broadcast()
    sync.after_reduce(0)
    with pytest.raises(StreamOrderError, match=r"buckets \[1\] are behind"):
        sync.after_broadcast()
    for device in range(2):
        sync.mark_ready(device, 1)
    sync.before_reduce(1)
    sync.after_reduce(1)
    sync.after_broadcast()
    sync.after_broadcast()  # one per dtype group is fine
    sync.before_apply(0)
    with pytest.raises(StreamOrderError, match=r"after devices \[0\] already applied"):
        sync.after_broadcast()


def test_rounds_are_per_device_so_a_fast_device_may_run_ahead() -> None:
    sync = HostStreamSync(2, 2)
    run_round_without_apply(sync, 2, 2)
    sync.before_apply(0)
    # Device 0 starts step 1 while device 1 has not applied step 0 yet.
    sync.mark_ready(0, 0)
    sync.mark_ready(0, 1)
    with pytest.raises(StreamOrderError, match=r"devices \[1\]"):
        sync.before_reduce(0)
    with pytest.raises(StreamOrderError, match="twice"):
        sync.mark_ready(0, 0)
    # Device 1 still belongs to step 0 until it applies: a mark now is a late step-0 mark.
    with pytest.raises(StreamOrderError, match="round 0"):
        sync.mark_ready(1, 0)
    sync.before_apply(1)
    sync.mark_ready(1, 0)
    sync.before_reduce(0)
    sync.after_reduce(0)
    assert [sync.rounds_applied(d) for d in range(2)] == [1, 1]


def run_round_without_apply(sync: StreamSync, devices: int, buckets: int) -> None:
    for bucket in range(buckets):
        for device in range(devices):
            sync.mark_ready(device, bucket)
        sync.before_reduce(bucket)
        sync.after_reduce(bucket)


def test_a_skipped_step_still_ends_the_round_with_before_apply() -> None:
    sync = HostStreamSync(1, 1)
    run_round_without_apply(sync, 1, 1)
    # Skipping the optimizer without before_apply leaves the device in step 0.
    with pytest.raises(StreamOrderError, match="after that bucket's reduction"):
        sync.mark_ready(0, 0)
    sync.before_apply(0)
    sync.mark_ready(0, 0)


def test_rebuild_between_the_last_reduction_and_step_synced() -> None:
    sync = HostStreamSync(2, 2)
    run_round_without_apply(sync, 2, 2)
    sync.rebuild(5)
    assert sync.num_buckets == 5
    sync.before_apply(0)
    sync.before_apply(1)
    run_round(sync, 2, 5)
    with pytest.raises(IndexError, match="bucket 5"):
        sync.mark_ready(0, 5)


def test_rebuild_mid_round_or_after_the_next_round_started_raises() -> None:
    sync = HostStreamSync(2, 2)
    for device in range(2):
        sync.mark_ready(device, 0)
    sync.before_reduce(0)
    sync.after_reduce(0)
    with pytest.raises(StreamOrderError, match="middle of a round"):
        sync.rebuild(3)
    for device in range(2):
        sync.mark_ready(device, 1)
    sync.before_reduce(1)
    sync.after_reduce(1)
    sync.before_apply(0)
    sync.mark_ready(0, 0)
    with pytest.raises(StreamOrderError, match=r"devices \[0\] already marked"):
        sync.rebuild(3)


def test_indices_are_checked() -> None:
    sync = HostStreamSync(2, 3)
    with pytest.raises(IndexError, match="device 2"):
        sync.mark_ready(2, 0)
    with pytest.raises(IndexError, match="bucket -1"):
        sync.before_reduce(-1)
    with pytest.raises(IndexError):
        sync.compute_stream(5)
    with pytest.raises(IndexError):
        sync.comm_stream(-1)


def test_close_is_idempotent_and_final() -> None:
    sync = HostStreamSync(1, 1)
    with sync.compute_stream(0), sync.comm_stream(0), sync.comm_streams():
        pass
    sync.close()
    sync.close(timeout=1.0)
    for call in (
        lambda: sync.mark_ready(0, 0),
        lambda: sync.before_reduce(0),
        lambda: sync.before_apply(0),
        lambda: sync.compute_stream(0),
        lambda: sync.comm_streams(),
    ):
        with pytest.raises(StreamOrderError, match="closed"):
            call()


def test_marks_from_many_threads_at_once_are_all_counted() -> None:
    devices, buckets, rounds = 8, 16, 10
    sync = HostStreamSync(devices, buckets)
    for _ in range(rounds):
        start = threading.Barrier(devices)

        def mark_all(device: int) -> None:
            start.wait()
            order = list(range(buckets))
            random.Random(device).shuffle(order)
            for bucket in order:
                sync.mark_ready(device, bucket)

        threads = [threading.Thread(target=mark_all, args=(d,)) for d in range(devices)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        for bucket in range(buckets):
            sync.before_reduce(bucket)
            sync.after_reduce(bucket)
        for device in range(devices):
            sync.before_apply(device)
    assert {sync.rounds_applied(d) for d in range(devices)} == {rounds}


def test_an_engine_shaped_pipeline_of_threads_follows_the_contract() -> None:
    """Device threads, a comm thread reducing in bucket order, messages between them, as gsync wires it."""
    devices, buckets, steps = 4, 6, 25
    sync = HostStreamSync(devices, buckets)
    ready: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
    synced = [queue.SimpleQueue[int]() for _ in range(devices)]
    failures: list[BaseException] = []

    def device_loop(device: int) -> None:
        jitter = random.Random(device)
        try:
            for step in range(steps):
                with sync.compute_stream(device):
                    for bucket in range(buckets):
                        if jitter.random() < 0.2:
                            time.sleep(0.0005)
                        sync.mark_ready(device, bucket)
                        ready.put((step, bucket, device))  # BucketReady, posted after the mark
                assert synced[device].get(timeout=10) == step  # StepSynced
                with sync.compute_stream(device):
                    sync.before_apply(device)
        except BaseException as error:  # noqa: BLE001 - checked below
            failures.append(error)

    def comm_loop() -> None:
        try:
            for step in range(steps):
                count = [0] * buckets
                launched = 0
                while launched < buckets:
                    at, bucket, _ = ready.get(timeout=10)
                    assert at == step
                    count[bucket] += 1
                    while launched < buckets and count[launched] == devices:
                        sync.before_reduce(launched)
                        with sync.comm_streams():
                            pass  # the collective
                        sync.after_reduce(launched)
                        launched += 1
                sync.after_broadcast()
                for mailbox in synced:
                    mailbox.put(step)
        except BaseException as error:  # noqa: BLE001 - checked below
            failures.append(error)

    threads = [threading.Thread(target=device_loop, args=(d,)) for d in range(devices)]
    threads.append(threading.Thread(target=comm_loop))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert {sync.rounds_applied(d) for d in range(devices)} == {steps}


# --------------------------------------------------------------------------------------------------
# CudaStreamSync against a fake torch.cuda that models stream ordering with vector clocks
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """A kernel on a fake stream; ``clock`` is what it is ordered after."""

    name: str
    stream: int
    seq: int
    clock: dict[int, int]

    def before(self, other: Op) -> bool:
        return other.clock.get(self.stream, 0) >= self.seq


class FakeStream:
    _ids = itertools.count(1)

    def __init__(self, cuda: FakeCuda, index: int, priority: int = 0) -> None:
        self.cuda = cuda
        self.index = index
        self.device = torch.device("cuda", index)
        self.priority = priority
        self.cuda_stream = next(self._ids)
        self.clock: dict[int, int] = {}
        self.busy = False

    def enqueue(self, name: str) -> Op:
        with self.cuda.lock:
            self.clock[self.cuda_stream] = self.clock.get(self.cuda_stream, 0) + 1
            return Op(name, self.cuda_stream, self.clock[self.cuda_stream], dict(self.clock))

    def wait_event(self, event: FakeEvent) -> None:
        event.wait(self)

    def query(self) -> bool:
        return not self.busy

    def synchronize(self) -> None:
        self.cuda.synchronized.append(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.index: int | None = None
        self.clock: dict[int, int] | None = None
        self.records = 0

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        if self.index is not None and self.index != stream.index:
            raise RuntimeError("only streams on the event's device may record it")
        self.index = stream.index
        with self.cuda.lock:
            self.clock = dict(stream.clock)
            self.records += 1
        self.cuda.recorded.append(self)

    def wait(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        if self.clock is None:
            return  # like cudaStreamWaitEvent on a never-recorded event
        with self.cuda.lock:
            for key, value in self.clock.items():
                stream.clock[key] = max(stream.clock.get(key, 0), value)


@dataclass
class _ThreadState(threading.local):
    device: int = 0
    streams: dict[int, FakeStream] = field(default_factory=dict)


class FakeCuda:
    """Just enough of torch.cuda for CudaStreamSync: per-thread current streams, legacy default streams, events.

    Device selection follows torch's own Python code, because it decides which
    devices get a CUDA context: ``torch.cuda.device`` selects its device on
    entry (``cudaSetDevice``, which creates the device's context) and on exit
    restores the previous one only where that has a context already
    (``MaybeSetDevice``); ``torch.cuda.stream`` restores, on exit, the stream
    that was current on the device current at entry, with ``set_stream``,
    which selects that device (creating its context). :attr:`contexts` are
    the devices that got one.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.lock = threading.Lock()
        self.local = _ThreadState()
        self.defaults = {i: FakeStream(self, i) for i in range(count)}
        self.streams: list[FakeStream] = []
        self.synchronized: list[FakeStream] = []
        self.recorded: list[FakeEvent] = []
        self.contexts: set[int] = set()

    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.local.device
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.local.device if device.index is None else device.index

    def current_device(self) -> int:
        return self.local.device

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        return self.local.streams.get(index, self.defaults[index])

    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        stream = FakeStream(self, self._index(device), priority)
        self.streams.append(stream)
        return stream

    def _select(self, index: int) -> None:
        """``cudaSetDevice``: the device gets its context."""
        with self.lock:
            self.contexts.add(index)
        self.local.device = index

    def _set_stream(self, stream: FakeStream) -> None:
        """``torch.cuda.set_stream``: selects the stream's device, then makes the stream current there."""
        if stream.index != self.local.device:
            self._select(stream.index)
        self.local.streams[stream.index] = stream

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        previous = self.local.device
        index = self._index(device)
        if index != previous:
            self._select(index)
        try:
            yield
        finally:
            # MaybeSetDevice: a previous device without a context is remembered as current, not selected.
            self.local.device = previous

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        source = self.current_stream()
        destination = None
        if source.index != stream.index:
            with self.device(stream.index):
                destination = self.current_stream(stream.index)
        self._set_stream(stream)
        try:
            yield
        finally:
            if destination is not None:
                self._set_stream(destination)
            self._set_stream(source)

    def launch(self, name: str, device: int | None = None) -> Op:
        """A kernel queued by the calling thread on its current stream."""
        return self.current_stream(device).enqueue(name)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "Stream", fake.new_stream)
    # Built with no arguments, as torch.cuda.Event allows none that gsync would need
    # (it has no `disable_timing`: passing one failed only on a real GPU).
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(fake))

    def no_host_sync(*_: object) -> None:
        raise AssertionError("torch.cuda.synchronize() called")

    monkeypatch.setattr(torch.cuda, "synchronize", no_host_sync)
    return fake


def test_fake_cuda_sync_is_a_stream_sync(fake_cuda: FakeCuda) -> None:
    sync = make_stream_sync(["cuda:0", "cuda:1"], 3)
    assert isinstance(sync, CudaStreamSync)
    assert isinstance(sync, StreamSync)
    assert sync.devices == (torch.device("cuda", 0), torch.device("cuda", 1))
    comm = [sync.comm_cuda_stream(d) for d in range(2)]
    compute = [sync.compute_cuda_stream(d) for d in range(2)]
    assert [s.priority for s in comm] == [-1, -1] and [s.priority for s in compute] == [0, 0]
    assert len({s.cuda_stream for s in comm + compute}) == 4


@pytest.mark.parametrize(
    "devices, message",
    [
        (["cuda:0", "cuda:0"], "distinct"),
        (["cuda:0", "cuda"], "distinct"),  # bare "cuda" is the current device, cuda:0
        (["cuda:2"], "does not exist"),
        (["cpu"], "CUDA devices only"),
        ([], "non-empty"),
    ],
)
def test_cuda_sync_rejects_bad_devices(fake_cuda: FakeCuda, devices: list[str], message: str) -> None:
    with pytest.raises(gsync.ConfigError, match=message):
        CudaStreamSync(devices, 1)


@dataclass
class StepOps:
    grads: list[list[Op]]
    """[device][bucket]"""
    late: list[Op]
    """[device] a kernel queued after the device's last mark"""
    reduces: list[list[Op]]
    """[bucket][device]"""
    broadcasts: list[Op]
    applies: list[Op]
    forwards: list[Op]


def fake_step(
    fake: FakeCuda,
    sync: CudaStreamSync,
    buckets: int,
    broadcast: bool = True,
    rebuild: int | None = None,
    reduce_order: list[int] | None = None,
) -> StepOps:
    """One step as gsync wires it, each role in its own thread, in the host order messages enforce.

    ``reduce_order``: the buckets' reductions in another order than gsync's (which is bucket order), as the
    contract allows."""
    devices = sync.num_devices

    def backward(device: int) -> tuple[Op, list[Op], Op]:
        with sync.compute_stream(device):
            forward = fake.launch("forward")
            grads = []
            for bucket in range(buckets):
                grads.append(fake.launch(f"grad {bucket}"))
                sync.mark_ready(device, bucket)
            return forward, grads, fake.launch("after backward")

    produced = [in_thread(lambda d=d: backward(d)) for d in range(devices)]  # type: ignore[misc]

    def communicate() -> tuple[list[list[Op]], list[Op]]:
        reduces: list[list[Op]] = [[] for _ in range(buckets)]
        for bucket in reduce_order or range(buckets):
            sync.before_reduce(bucket)
            with sync.comm_streams():
                reduces[bucket] = [fake.launch(f"reduce {bucket}", d) for d in range(devices)]
            sync.after_reduce(bucket)
        broadcasts: list[Op] = []
        if broadcast:
            with sync.comm_streams():
                broadcasts = [fake.launch("broadcast", d) for d in range(devices)]
            sync.after_broadcast()
        return reduces, broadcasts

    reduces, broadcasts = in_thread(communicate)
    if rebuild is not None:
        sync.rebuild(rebuild)

    def apply(device: int) -> Op:
        with sync.compute_stream(device):
            sync.before_apply(device)
            return fake.launch("optimizer")

    applies = [in_thread(lambda d=d: apply(d)) for d in range(devices)]  # type: ignore[misc]
    return StepOps(
        grads=[grads for _, grads, _ in produced],
        late=[late for _, _, late in produced],
        reduces=reduces,
        broadcasts=broadcasts,
        applies=applies,
        forwards=[forward for forward, _, _ in produced],
    )


def test_cuda_reductions_wait_for_their_gradients_and_the_optimizer_for_the_reductions(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0", "cuda:1"], 3)
    setup = [fake_cuda.launch("replicate", d) for d in range(2)]  # the engine, on the default stream
    first = fake_step(fake_cuda, sync, 3)
    second = fake_step(fake_cuda, sync, 3)
    readback = [fake_cuda.launch("load_state_dict", d) for d in range(2)]  # the engine, after fit

    for device in range(2):
        assert setup[device].before(first.forwards[device])
        for step in (first, second):
            for bucket in range(3):
                # Each reduction waits for that bucket's gradients on its device...
                assert step.grads[device][bucket].before(step.reduces[bucket][device])
                # ...and only for what was queued before the mark: backward keeps overlapping.
                if bucket + 1 < 3:
                    assert not step.grads[device][bucket + 1].before(step.reduces[bucket][device])
                assert not step.late[device].before(step.reduces[bucket][device])
                assert step.reduces[bucket][device].before(step.applies[device])
            assert step.broadcasts[device].before(step.applies[device])
        # The next step's forward (which zeroes the buckets) follows the last step's reductions.
        assert first.reduces[2][device].before(second.forwards[device])
        # Reused events: step 2's reductions wait for step 2's gradients, not just step 1's.
        assert second.grads[device][2].before(second.reduces[2][device])
        assert second.applies[device].before(readback[device])
        # A device's comm stream only waits on its own device; NCCL orders across devices itself.
        assert not first.grads[1 - device][0].before(first.reduces[0][device])
    assert fake_cuda.synchronized == []
    sync.close()
    assert set(fake_cuda.synchronized) == set(fake_cuda.streams)


def test_cuda_events_are_allocated_once_not_per_step(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0", "cuda:1"], 2)
    fake_step(fake_cuda, sync, 2)
    events = {id(event) for event in fake_cuda.recorded}
    for _ in range(3):
        fake_step(fake_cuda, sync, 2)
    assert {id(event) for event in fake_cuda.recorded} == events
    sync.close()


@pytest.mark.parametrize("check_order", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("devices", [1, 2])
def test_cuda_done_events_are_recorded_once_per_round_and_still_order_every_reduction(
    fake_cuda: FakeCuda, check_order: bool, devices: int
) -> None:
    """The done event a device's optimizer waits on is recorded after the round's last reduction only (one record
    per round, not one per bucket), whatever order the buckets are reduced in: every reduction and broadcast of a
    round stays ordered before each device's optimizer step and its next forward."""
    names = [f"cuda:{d}" for d in range(devices)]
    sync = CudaStreamSync(names, 5, check_order=check_order)
    done = list(sync._done)  # white box: what before_apply waits on
    shuffled = random.Random(3)
    steps = []
    for step in range(4):
        order = list(range(5))
        if step:
            shuffled.shuffle(order)
        steps.append(fake_step(fake_cuda, sync, 5, broadcast=step % 2 == 1, reduce_order=order))
        # One record for the reductions, one more after a broadcast.
        assert [event.records for event in done] == [sum(1 + s % 2 for s in range(step + 1))] * devices
    for ops in steps:
        for device in range(devices):
            for bucket in range(5):
                assert ops.reduces[bucket][device].before(ops.applies[device])
            for broadcast in ops.broadcasts[device : device + 1]:
                assert broadcast.before(ops.applies[device])
    for earlier, later in itertools.pairwise(steps):
        for device in range(devices):
            for bucket in range(5):
                assert earlier.reduces[bucket][device].before(later.forwards[device])
                assert not later.reduces[bucket][device].before(earlier.applies[device])
    sync.close()


def test_cuda_mark_ready_records_on_the_current_stream(fake_cuda: FakeCuda) -> None:
    """Autograd may run a gradient's kernels on a side stream: the reduction must wait for that stream."""
    sync = CudaStreamSync(["cuda:0"], 1)
    side = fake_cuda.new_stream(0)

    def backward() -> Op:
        with sync.compute_stream(0), fake_cuda.stream(side):
            grad = fake_cuda.launch("grad on side stream")
            sync.mark_ready(0, 0)
            return grad

    grad = in_thread(backward)
    sync.before_reduce(0)
    with sync.comm_stream(0):
        reduce = fake_cuda.launch("reduce")
    assert grad.before(reduce)
    sync.close()


def test_cuda_side_stream_bucket_writes_wait_for_the_last_round(fake_cuda: FakeCuda) -> None:
    """A model that runs part of forward on its own stream gets its gradient hooks run there by autograd: the
    hook's copy into the bucket must follow the previous step's reduction and optimizer step."""
    sync = CudaStreamSync(["cuda:0"], 1)
    side = fake_cuda.new_stream(0)

    def backward() -> Op:
        with sync.compute_stream(0):
            fake_cuda.launch("forward")
            with fake_cuda.stream(side):  # where autograd runs the hook
                sync.before_write(0)
                write = fake_cuda.launch("hook copies the gradient into its bucket")
                sync.mark_ready(0, 0)
            return write

    def communicate() -> Op:
        sync.before_reduce(0)
        with sync.comm_streams():
            reduce = fake_cuda.launch("reduce", 0)
        sync.after_reduce(0)
        return reduce

    def apply() -> Op:
        with sync.compute_stream(0):
            sync.before_apply(0)
            return fake_cuda.launch("optimizer")

    first_write = in_thread(backward)
    first_reduce = in_thread(communicate)
    first_apply = in_thread(apply)
    second_write = in_thread(backward)
    assert first_write.before(first_reduce)
    assert first_reduce.before(second_write) and first_apply.before(second_write)
    # On the compute stream itself the order is the stream's own: no wait recorded.
    with sync.compute_stream(0):
        waited = dict(sync.compute_cuda_stream(0).clock)
        sync.before_write(0)
        assert sync.compute_cuda_stream(0).clock == waited
    sync.close()


def test_cuda_threads_gsync_owns_get_no_context_on_a_device_they_do_not_use(fake_cuda: FakeCuda) -> None:
    """A process training on cuda:1 only must not create a CUDA context on cuda:0 (about 0.5 GB each, one per
    process under torchrun): leaving a stream context in a thread that never chose a device selects device 0."""
    sync = CudaStreamSync(["cuda:1"], 1)

    def backward() -> None:
        with sync.compute_stream(0):
            fake_cuda.launch("gradient")
            sync.mark_ready(0, 0)

    def communicate() -> None:
        sync.before_reduce(0)
        with sync.comm_streams():
            fake_cuda.launch("reduce")
        with sync.comm_stream(0):
            fake_cuda.launch("copy back")
        sync.after_reduce(0)

    def apply() -> None:
        with sync.compute_stream(0):
            sync.before_apply(0)
            fake_cuda.launch("optimizer")

    for role in (backward, communicate, apply):
        in_thread(role)
    assert fake_cuda.contexts == {1}
    sync.close()


@pytest.mark.parametrize("devices", [1, 2])
def test_a_comm_stream_entered_again_inside_comm_streams_is_left_as_it_is(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, devices: int
) -> None:
    """The collective enters each device's comm stream again inside the server's comm_streams(): where that device
    is still the selected one, nothing is entered twice, and the work lands on the comm streams all the same."""
    sync = CudaStreamSync([f"cuda:{d}" for d in range(devices)], 1)
    entered: list[FakeStream] = []
    stream_context = fake_cuda.stream

    def counted(stream: FakeStream) -> Any:
        entered.append(stream)
        return stream_context(stream)

    monkeypatch.setattr(torch.cuda, "stream", counted)

    def communicate() -> list[Op]:
        with sync.comm_streams():
            launched = []
            for device in range(devices):
                with on_device(sync.comm_cuda_stream(device)):  # type: ignore[arg-type]
                    launched.append(fake_cuda.launch("prepare", device))
            return launched

    launched = in_thread(communicate)
    comm = [sync.comm_cuda_stream(d) for d in range(devices)]
    assert [op.stream for op in launched] == [stream.cuda_stream for stream in comm]
    # comm_streams() enters each device's comm stream; then only the devices it left unselected are entered again:
    # none of one, the first of two (it selects each in turn, the last stays selected).
    assert entered == comm + comm[: devices - 1]
    assert fake_cuda.contexts <= set(range(devices))
    sync.close()


def test_a_bare_stream_context_is_what_creates_the_context(fake_cuda: FakeCuda) -> None:
    """The fake's device bookkeeping does model the failure the test above guards against."""
    stream = fake_cuda.new_stream(1)

    def bare() -> None:
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            fake_cuda.launch("kernel")

    in_thread(bare)
    assert fake_cuda.contexts == {0, 1}


def test_host_before_write_checks_its_device() -> None:
    sync = HostStreamSync(2, 1)
    sync.before_write(1)
    with pytest.raises(IndexError):
        sync.before_write(2)
    sync.close()
    with pytest.raises(StreamOrderError, match="closed"):
        sync.before_write(0)


def test_cuda_skip_step_and_rebuild(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0", "cuda:1"], 2)
    first = fake_step(fake_cuda, sync, 2, broadcast=False, rebuild=4)
    second = fake_step(fake_cuda, sync, 4)
    assert sync.num_buckets == 4
    for device in range(2):
        assert first.reduces[1][device].before(second.forwards[device])
        for bucket in range(4):
            assert second.grads[device][bucket].before(second.reduces[bucket][device])
    sync.close()


def test_cuda_order_is_checked(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0", "cuda:1"], 1)
    with pytest.raises(StreamOrderError, match=r"devices \[0, 1\]"):
        sync.before_reduce(0)  # no device has marked it at all
    sync.mark_ready(0, 0)
    with pytest.raises(StreamOrderError, match=r"devices \[1\]"):
        sync.before_reduce(0)
    unchecked = CudaStreamSync(["cuda:0", "cuda:1"], 1, check_order=False)
    unchecked.before_reduce(0)  # no host check: only indices
    with pytest.raises(IndexError):
        unchecked.before_reduce(1)
    sync.close()
    unchecked.close()
    with pytest.raises(StreamOrderError, match="closed"):
        unchecked.mark_ready(0, 0)


def test_cuda_compute_stream_joins_the_caller_stream_even_on_failure(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0"], 1)
    with pytest.raises(ValueError, match="training code"):
        with sync.compute_stream(0):
            work = fake_cuda.launch("half an optimizer step")
            raise ValueError("training code")
    assert fake_cuda.current_stream(0) is fake_cuda.defaults[0]
    assert work.before(fake_cuda.launch("checkpoint read", 0))
    sync.close()


def test_cuda_close_with_timeout_polls_and_gives_up(fake_cuda: FakeCuda) -> None:
    sync = CudaStreamSync(["cuda:0"], 1)
    sync.comm_cuda_stream(0).busy = True
    with pytest.raises(TimeoutError, match="cuda:0"):
        sync.close(timeout=0.05)
    assert fake_cuda.synchronized == []
    sync.close()  # already closed: returns at once


# --------------------------------------------------------------------------------------------------
# Real CUDA
# --------------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_sync_orders_streams_without_blocking_the_host() -> None:
    devices = cuda_devices()
    sync = CudaStreamSync(devices, 1)
    grads = [torch.zeros(1 << 20, device=d) for d in devices]
    received = [torch.zeros_like(g) for g in grads]

    def every_kernel_of_the_window() -> None:
        # A kernel's first launch may wait for the long kernel (lazy loading, see warm_kernels): without this the
        # first add_ of the process stalled the host for the whole 0.5 s on an H200. Zeroed again afterwards, so a
        # comm stream that did not wait still reads stale zeros.
        for grad, got in zip(grads, received):
            grad.fill_(1.0)
            got.copy_(grad)
            grad.add_(got)
            grad.zero_()
            got.zero_()

    warm_kernels(every_kernel_of_the_window)

    def backward(device: int) -> None:
        with sync.compute_stream(device):
            long_kernel()
            grads[device].fill_(float(device + 1))
            sync.mark_ready(device, 0)

    for device in range(len(devices)):
        in_thread(lambda d=device: backward(d))  # type: ignore[misc]
    started = time.perf_counter()
    sync.before_reduce(0)
    for device in range(len(devices)):
        with sync.comm_stream(device):
            received[device].copy_(grads[device])  # stale zeros if the comm stream did not wait
    sync.after_reduce(0)

    def apply(device: int) -> None:
        with sync.compute_stream(device):
            sync.before_apply(device)
            grads[device].add_(received[device])

    for device in range(len(devices)):
        in_thread(lambda d=device: apply(d))  # type: ignore[misc]
    host_time = time.perf_counter() - started
    still_running = [not sync.compute_cuda_stream(d).query() for d in range(len(devices))]
    sync.close()
    assert all(still_running), f"a stream finished within {host_time:.3f} s: something synchronized the host"
    for device, (grad, got) in enumerate(zip(grads, received)):
        assert torch.all(got == device + 1)
        assert torch.all(grad == 2 * (device + 1))


@needs_cuda
def test_cuda_sync_raises_on_order_violations() -> None:
    sync = CudaStreamSync([torch.device("cuda", 0)], 2)
    with pytest.raises(StreamOrderError):
        sync.before_reduce(0)
    with pytest.raises(StreamOrderError):
        sync.before_apply(0)
    sync.close()
