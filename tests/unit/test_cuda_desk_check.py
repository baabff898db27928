"""What a desk check of the CUDA path found (issue 35), tested on the CPU where the logic allows it.

Each CPU case runs the real code on real torch objects; the few stand-ins
refuse what torch refuses (a collective that rejects complex tensors as NCCL
does, an event with exactly ``torch.cuda.Event.query``'s signature). What
only a GPU can tell is in the CUDA cases at the end (skipped here) and in
``tools/gpu_check.py``, whose own logic (its plan, what it skips on one GPU
and why, how its ``nosync`` part tells a step's synchronizations from those
at open and close) is tested here too, so the script works when a GPU comes.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gsync
from tests.support.gates import InfGradOnMarkedRows
from tests.support.rank_threads import in_rank_threads
from tests.support.models import TiedNet, make_batches, sgd
from gsync._core.threads import FitAborted
from gsync._core.base.agreement import AgreedStep, StepFacts
from gsync._core.gradients.buffers import BufferSync
from gsync._core.transports.nccl import prepare_for_nccl
from gsync._core.distributed.membership import GroupMembership
from gsync._core.distributed.runtime import agree_over, host_all_reduce, host_group
from gsync._core.step.readout import LossReadout, ScalarReadout
from gsync._core.streams.cuda import wait_on_host
from tests.support.cuda import long_kernel, needs_cuda, warm_kernels

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)

COMPLEX = [torch.complex64, torch.complex128]


# --------------------------------------------------------------------------------------------------
# Complex tensors travel as their real views (NCCL has no complex type)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("weight", [0.25, 1.0, 0.0, None])
@pytest.mark.parametrize("strided", [False, True])
def test_a_complex_tensor_goes_to_nccl_as_its_real_view(dtype: torch.dtype, weight: float | None, strided: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(6, 8, dtype=dtype, generator=generator)
    tensor = whole[:, ::2] if strided else whole
    if weight == 0:
        tensor[0, 0] = complex(float("inf"), 1.0)  # a zero weight must not turn it into NaN
    original = tensor.clone()
    target, wire = prepare_for_nccl(tensor, weight)
    assert not wire.is_complex() and wire.dtype == torch.view_as_real(original).dtype
    assert wire.is_contiguous() and wire.numel() == 2 * tensor.numel()
    assert wire.data_ptr() == target.data_ptr() and target.is_complex() and target.is_contiguous()
    assert (target is tensor) == (not strided)
    expected = torch.zeros_like(original) if weight == 0 else original if weight is None else original * weight
    torch.testing.assert_close(target, expected)
    # What NCCL writes into the wire is what the target holds.
    wire.mul_(2.0)
    torch.testing.assert_close(target, expected * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_a_real_tensor_goes_to_nccl_as_itself(dtype: torch.dtype) -> None:
    tensor = torch.arange(12).to(dtype).view(3, 4).t()  # strided
    target, wire = prepare_for_nccl(tensor, 2.0 if dtype.is_floating_point else None)
    assert wire is target and target.is_contiguous() and target.dtype == dtype
    expected = tensor * 2 if dtype.is_floating_point else tensor
    torch.testing.assert_close(target, expected)


class RefusesComplex(gsync.LocalCollective):
    """LocalCollective that refuses complex tensors the way torch.cuda.nccl does, and counts broadcasts."""

    def __init__(self, num_devices: int) -> None:
        super().__init__(num_devices)
        self.broadcasts: list[torch.dtype] = []

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.is_complex():
                raise TypeError(f"Unconvertible NCCL type {tensor.dtype}")
        self.broadcasts.append(tensors[0].dtype)
        super().broadcast(tensors)


class ComplexBuffers(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("phase", torch.randn(3, 2, dtype=torch.complex64, generator=generator))
        self.register_buffer("scalar", torch.randn((), dtype=torch.complex64, generator=generator))
        self.register_buffer("mean", torch.randn(4, generator=generator))
        self.register_buffer("wide", torch.randn(2, dtype=torch.complex128, generator=generator))
        self.register_buffer("count", torch.tensor(seed))


def test_complex_buffers_are_broadcast_as_real_views() -> None:
    replicas = [ComplexBuffers(seed) for seed in range(3)]
    source = {name: buffer.clone() for name, buffer in replicas[0].named_buffers()}
    sync = BufferSync(replicas)
    collective = RefusesComplex(3)
    sync.broadcast(collective, step=0)
    # complex64 rides with float32, complex128 alone as float64, the int buffer as int64.
    assert sorted(map(str, collective.broadcasts)) == ["torch.float32", "torch.float64", "torch.int64"]
    for replica in replicas:
        for name, buffer in replica.named_buffers():
            assert buffer.dtype == source[name].dtype and buffer.shape == source[name].shape
            assert torch.equal(buffer, source[name]), name
    snapshot = sync.snapshot(0)
    assert snapshot is not None
    for name, value in source.items():
        assert snapshot[name].dtype == value.dtype and torch.equal(snapshot[name], value), name


# --------------------------------------------------------------------------------------------------
# Host waits poll the event against the abort flag
# --------------------------------------------------------------------------------------------------


class CountingEvent:
    """Completes after ``polls`` queries; ``query`` has torch.cuda.Event.query's signature and nothing else."""

    def __init__(self, polls: int, on_poll: Callable[[int], None] | None = None) -> None:
        self.polls = polls
        self.queries = 0
        self.on_poll = on_poll

    def query(self) -> bool:
        self.queries += 1
        if self.on_poll is not None:
            self.on_poll(self.queries)
        return self.queries > self.polls


def test_the_stand_in_event_has_torchs_query_signature() -> None:
    ours = inspect.signature(CountingEvent.query).parameters
    torchs = inspect.signature(torch.cuda.Event.query).parameters
    assert list(ours) == list(torchs) == ["self"]
    assert not hasattr(CountingEvent, "synchronize")  # the wait must not fall back to it


def test_a_host_wait_polls_until_the_event_is_done() -> None:
    event = CountingEvent(5)
    wait_on_host(event, threading.Event())
    assert event.queries == 6
    done = CountingEvent(0)
    wait_on_host(done, None)
    assert done.queries == 1


def test_a_host_wait_leaves_once_the_run_aborts() -> None:
    abort = threading.Event()
    # The event never completes (a stream behind a collective a dead peer never finishes).
    never = CountingEvent(10**9, on_poll=lambda count: abort.set() if count == 3 else None)
    with pytest.raises(FitAborted):
        wait_on_host(never, abort)
    assert never.queries == 3


def test_cpu_readouts_read_directly() -> None:
    losses = LossReadout(torch.device("cpu"), threading.Event())
    losses.start(2)
    losses.add(torch.tensor(1.5, requires_grad=True) * 2, 0.5)
    losses.add(torch.tensor(float("nan")), 0.5)
    (first, _), (second, _) = losses.read()
    assert first == 3.0 and second != second
    norm = ScalarReadout(torch.device("cpu"), threading.Event())
    norm.put(torch.tensor(2.5, dtype=torch.float64))
    assert norm.get() == 2.5
    with pytest.raises(gsync.GsyncError, match="without a put"):
        norm.get()


# --------------------------------------------------------------------------------------------------
# An NCCL run's per-step agreement runs on a gloo group over the same ranks
# --------------------------------------------------------------------------------------------------


def _membership(store: dist.Store, rank: int, device: str) -> GroupMembership:
    return GroupMembership(
        group=None,  # type: ignore[arg-type]  # host_group reads the store, the ranks and the device only
        store=store,
        rank=rank,
        world_size=2,
        created=False,
        backend="nccl",
        device=torch.device(device),
        run_id=7,
    )


def _in_ranks(fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for ranks 0 and 1, each in its own thread (gloo connects them over loopback); a rank's error is
    raised."""
    results = in_rank_threads(fn)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_a_cuda_membership_gets_a_gloo_host_group_and_a_cpu_one_none() -> None:
    assert host_group(_membership(dist.HashStore(), 0, "cpu"), 5.0) is None
    store = dist.HashStore()
    groups = _in_ranks(lambda rank: host_group(_membership(store, rank, "cuda:0"), 20.0))
    assert all(isinstance(group, dist.ProcessGroupGloo) for group in groups)
    assert [group.rank() for group in groups] == [0, 1] and {group.size() for group in groups} == {2}


def test_the_step_agreement_over_the_host_group() -> None:
    store = dist.HashStore()
    groups = _in_ranks(lambda rank: host_group(_membership(store, rank, "cuda:0"), 20.0))
    abort = threading.Event()
    facts = [
        StepFacts(step=4, unused=(0, 2), skip=False, rows=8, loss=0.25, last=False),
        StepFacts(step=4, unused=(2,), skip=True, rows=8, loss=0.5, last=False),
    ]

    def agree(rank: int) -> AgreedStep:
        return agree_over(
            lambda values: host_all_reduce(groups[rank], values, "sum", abort), 2, 3, facts[rank], True
        )

    agreed = _in_ranks(agree)
    assert agreed[0] == agreed[1] == AgreedStep((2,), True, 0.75)
    maxima = _in_ranks(lambda rank: host_all_reduce(groups[rank], torch.tensor([rank, -rank]), "max", abort))
    assert all(torch.equal(m, torch.tensor([1, 0])) for m in maxima)

    uneven = [StepFacts(4, (), False, 8, 0.0, False), StepFacts(4, (), False, 6, 0.0, False)]
    errors = _in_ranks(
        lambda rank: _error(
            lambda: agree_over(lambda v: host_all_reduce(groups[rank], v, "sum", abort), 2, 3, uneven[rank], True)
        )
    )
    assert all(error is not None and "different sizes" in error for error in errors)


def _error(fn: Callable[[], object]) -> str | None:
    try:
        fn()
    except gsync.ConfigError as error:
        return str(error)
    return None


def test_a_host_group_wait_leaves_on_abort_while_a_peer_is_missing() -> None:
    store = dist.HashStore()
    groups = _in_ranks(lambda rank: host_group(_membership(store, rank, "cuda:0"), 20.0))
    abort = threading.Event()
    left = threading.Event()

    def alone() -> None:
        try:
            host_all_reduce(groups[0], torch.ones(3), "sum", abort)
        except FitAborted:
            left.set()

    waiter = threading.Thread(target=alone)
    waiter.start()
    abort.set()
    waiter.join(timeout=10)
    assert left.is_set() and not waiter.is_alive()
    # The peer comes late: the abandoned reduction completes in gloo's threads, and the groups can be dropped.
    host_all_reduce(groups[1], torch.ones(3), "sum", None)


# --------------------------------------------------------------------------------------------------
# The GradScaler's skip is known without GradScaler.get_scale() (a host sync per call on CUDA)
# --------------------------------------------------------------------------------------------------


def inf_on_marked(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    marked = bool((x[:, 0] == 1000.0).any())
    return nn.functional.cross_entropy(InfGradOnMarkedRows.apply(model(x.clamp(max=10.0)), marked), y)


@pytest.mark.asyncio
@pytest.mark.parametrize("fused", [False, True])
async def test_a_scaled_step_reports_its_skip_without_reading_the_scale(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    batches = make_batches(4, 8)
    x, y = batches[1]
    x = x.clone()
    x[-1, 0] = 1000.0  # an inf gradient on device 1 at step 1
    batches[1] = (x, y)
    reads: list[int] = []
    get_scale = torch.amp.GradScaler.get_scale

    def counted(self: torch.amp.GradScaler) -> float:
        reads.append(1)
        return get_scale(self)

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, fused=True) if fused else sgd(params)

    engine = gsync.Engine(["cpu:0", "cpu:1"])
    async with engine.session(TiedNet(), optimizer=optimizer, loss_fn=inf_on_marked, autocast=torch.float16) as session:
        monkeypatch.setattr(torch.amp.GradScaler, "get_scale", counted)
        results = [await session.step(batch) for batch in batches]
        monkeypatch.undo()
        checkpoint = session.checkpoint()
    assert [r.skipped for r in results] == [False, True, False, False]
    assert checkpoint.scaler_state is not None and checkpoint.scaler_state["scale"] == 32768.0
    # A fused optimizer runs its step either way (it skips inside): only then is the scale read.
    assert len(reads) == (2 * 2 * len(batches) if fused else 0)


# --------------------------------------------------------------------------------------------------
# The GPU check's own logic (tools/gpu_check.py), which must work before a GPU is at hand
# --------------------------------------------------------------------------------------------------


def test_the_gpu_check_runs_as_a_script_and_explains_itself() -> None:
    import subprocess
    import sys

    from tools.gpu_check import PARTS, ROOT

    completed = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    for part in PARTS:
        assert f"  {part} " in completed.stdout


def test_the_gpu_check_plans_what_one_gpu_skips_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.gpu_check import DEFAULT_BUDGET, GATES, PARTS, main

    assert sum(PARTS.values()) <= DEFAULT_BUDGET, "a hung part would leave the last parts no time"
    assert main(["--plan", "--gpus", "1"]) == 0
    one = capsys.readouterr().out
    for label in GATES:
        assert f"{label}: SKIPPED (needs 2 GPUs, this machine has 1)" in one
    assert main(["--plan", "--gpus", "2"]) == 0
    assert "SKIPPED" not in capsys.readouterr().out
    assert main(["--plan", "--gpus", "0", "--only", "versions,nosync,nonsense"]) == 1
    none = capsys.readouterr().out.splitlines()
    assert none[0].startswith("nonsense: FAILED unknown part")
    assert none[1:3] == ["versions: runs, timeout 20 s", "nosync: SKIPPED (no CUDA device on this machine)"]
    with pytest.raises(SystemExit):
        main(["--gpus", "1"])  # a machine's GPUs are counted, not told, outside --plan


def test_every_check_the_gpu_parts_gate_is_planned() -> None:
    import re

    from tools.gpu_check import GATES, ROOT

    used = {
        label
        for path in sorted((ROOT / "tools").glob("gpu_*.py"))
        for label in re.findall(r'\bgate\(\s*"([^"]+)"', path.read_text(encoding="utf-8"))
    }
    assert used == set(GATES)


def test_the_nosync_part_tells_steps_from_open_and_close_and_from_the_grad_scaler() -> None:
    from tools.gpu_parts import GRAD_SCALER, SYNC_WARNING, SyncCalls

    calls = SyncCalls()

    def synchronizing_call() -> None:
        warnings.warn(SYNC_WARNING, stacklevel=1)

    def in_a_worker_thread() -> None:
        thread = threading.Thread(target=synchronizing_call)
        thread.start()
        thread.join(timeout=10)

    scaler_code = compile("synchronizing_call()", f"/site-packages/{GRAD_SCALER}", "exec")
    with calls.watching(cuda=False):
        synchronizing_call()  # at open
        calls.stepping.set()
        in_a_worker_thread()
        in_a_worker_thread()
        exec(scaler_code, {"synchronizing_call": synchronizing_call})
        warnings.warn("something else entirely", stacklevel=1)
        calls.stepping.clear()
        synchronizing_call()  # at close
    assert sum(calls.outside.values()) == 2
    assert sum(calls.inside.values()) == 2 and sum(calls.grad_scaler.values()) == 1
    (site,) = calls.inside
    assert site.startswith("tests/unit/test_cuda_desk_check.py:") and site.endswith(" synchronizing_call")


# --------------------------------------------------------------------------------------------------
# On a GPU (tools/gpu_check.py runs these)
# --------------------------------------------------------------------------------------------------


@needs_cuda
def test_a_host_wait_on_a_busy_gpu_leaves_on_abort() -> None:
    warm_kernels()  # the sleep kernel's first launch, never behind a busy GPU
    event = torch.cuda.Event()
    long_kernel()
    event.record()
    abort = threading.Event()
    abort.set()
    with pytest.raises(FitAborted):
        wait_on_host(event, abort)
    assert not event.query()
    wait_on_host(event, threading.Event())
    assert event.query()


@needs_cuda
def test_the_loss_readout_leaves_on_abort_behind_a_busy_stream() -> None:
    abort = threading.Event()
    readout = LossReadout(torch.device("cuda"), abort)
    readout.start(1)
    loss = torch.tensor(2.0, device="cuda")  # made first: a blocking copy to the GPU would wait for the kernel
    warm_kernels()
    long_kernel()
    readout.add(loss, 1.0)
    abort.set()
    with pytest.raises(FitAborted):
        readout.read()
    abort.clear()
    assert readout.read() == [(2.0, 1.0)]
    norm = ScalarReadout(torch.device("cuda"), abort)
    norm.put(torch.tensor(3.0, device="cuda", dtype=torch.float16))
    assert norm.get() == 3.0


@needs_cuda
@pytest.mark.parametrize("dtype", COMPLEX)
def test_nccl_reduces_and_broadcasts_complex_tensors(dtype: torch.dtype) -> None:
    from gsync._core.transports.nccl import NcclCollective
    from gsync._core.streams import CudaStreamSync

    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    sync = CudaStreamSync(devices, 1)
    collective = NcclCollective(devices, sync)
    n = len(devices)
    values = [torch.full((5, 3), complex(i + 1, -(i + 1)), dtype=dtype) for i in range(n)]
    tensors = [v.to(d) for v, d in zip(values, devices)]
    strided = [torch.full((4, 6), complex(0, i + 1), dtype=dtype, device=d)[:, ::2] for i, d in enumerate(devices)]
    collective.all_reduce(tensors, [1 / n] * n)
    collective.all_reduce(strided, [1.0] * n)
    sources = [torch.full((7,), complex(i, i), dtype=dtype, device=d) for i, d in enumerate(devices)]
    collective.broadcast(sources)
    for device in devices:
        torch.cuda.synchronize(device)
    mean = sum(values) / n
    for tensor, twisted, source in zip(tensors, strided, sources):
        assert tensor.dtype == dtype
        torch.testing.assert_close(tensor.cpu(), mean)
        torch.testing.assert_close(twisted.cpu(), torch.full((4, 3), complex(0, n * (n + 1) / 2), dtype=dtype))
        torch.testing.assert_close(source.cpu(), torch.zeros(7, dtype=dtype))
    sync.close()


@needs_cuda
def test_a_side_stream_bucket_write_waits_for_the_compute_stream() -> None:
    from gsync._core.streams import CudaStreamSync

    sync = CudaStreamSync([torch.device("cuda", 0)], 1)
    side = torch.cuda.Stream()
    done = torch.cuda.Event()
    warm_kernels()  # the side stream's short sleep is the long kernel's own: loaded here, not behind it

    def job() -> None:
        with sync.compute_stream(0):
            long_kernel()  # the last round's optimizer step, still running

        with sync.compute_stream(0):
            with torch.cuda.stream(side):
                sync.before_write(0)
                torch.cuda._sleep(1000)  # the hook's copy
                done.record()

    thread = threading.Thread(target=job)
    thread.start()
    thread.join(timeout=30)
    assert not done.query(), "the side stream's write did not wait for the compute stream"
    sync.close()
    side.synchronize()
    assert done.query()


@needs_two_gpus
def test_a_process_on_cuda_1_creates_no_context_on_cuda_0() -> None:
    import subprocess
    import sys

    code = """
import threading, torch
from gsync._core.transports.nccl import NcclCollective
from gsync._core.streams import CudaStreamSync
sync = CudaStreamSync(["cuda:1"], 1)
collective = NcclCollective(["cuda:1"], sync)
tensor = torch.ones(4, device="cuda:1")
def comm_thread():
    sync.mark_ready(0, 0)
    sync.before_reduce(0)
    with sync.comm_streams():
        collective.all_reduce([tensor], [0.5])
    sync.after_reduce(0)
    with sync.comm_stream(0):
        tensor.add_(1)
thread = threading.Thread(target=comm_thread)
thread.start()
thread.join()
sync.close()
print(torch._C._cuda_hasPrimaryContext(0), tensor.cpu().tolist())
"""
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "False [1.5, 1.5, 1.5, 1.5]"


