"""``NcclCollective``: its construction errors and import hygiene (anywhere), its arithmetic and ordering on real
CUDA devices (skipped without a GPU). The Collective conformance cases it also passes: tests/unit/comm."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import gsync
from gsync._core.transports.nccl import NcclCollective
from gsync._core.streams import CudaStreamSync, HostStreamSync
from tests.support.cuda import cuda_devices, in_thread, long_kernel, needs_cuda, warm_kernels


# --------------------------------------------------------------------------------------------------
# Runs anywhere: construction errors and import hygiene
# --------------------------------------------------------------------------------------------------


def test_nccl_collective_rejects_cpu_devices_and_foreign_stream_syncs() -> None:
    with pytest.raises(gsync.ConfigError, match="CUDA devices only"):
        NcclCollective(["cpu"], HostStreamSync(1, 1))  # type: ignore[arg-type]
    with pytest.raises(gsync.ConfigError):
        # Without CUDA: CUDA is unavailable; with CUDA: not a CudaStreamSync.
        NcclCollective(["cuda:0"], HostStreamSync(1, 1))  # type: ignore[arg-type]


class _NcclStandIn:
    """torch.cuda.nccl's reduce_scatter and all_gather on CPU tensors, refusing what torch's C++ checks refuse:
    unequal chunks, mixed dtypes, strided or complex tensors (NCCL has no complex type)."""

    def __init__(self) -> None:
        self.calls = 0

    def _check(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], in_per_out: float) -> None:
        self.calls += 1
        for tensor in [*inputs, *outputs]:
            assert tensor.is_contiguous() and not tensor.is_complex() and tensor.dtype == inputs[0].dtype
        for source, target in zip(inputs, outputs):
            assert source.numel() == target.numel() * in_per_out, (source.numel(), target.numel())
            assert source.data_ptr() != target.data_ptr()

    def reduce_scatter(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        self._check(inputs, outputs, len(inputs))
        total = sum(source.reshape(-1).double() for source in inputs)
        for rank, target in enumerate(outputs):
            target.view(-1).copy_(total.chunk(len(inputs))[rank])  # type: ignore[union-attr]

    def all_gather(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        self._check(inputs, outputs, 1 / len(inputs))
        whole = torch.cat([source.reshape(-1) for source in inputs])
        for target in outputs:
            target.view(-1).copy_(whole)


@pytest.mark.parametrize("numel", [12, 13, 2])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_nccl_shards_are_gsyncs_even_when_nccls_equal_chunks_are_not(numel: int, devices: int, dtype: torch.dtype) -> None:
    """The layout NcclCollective hands torch.cuda.nccl, on CPU: uneven shards padded to NCCL's equal chunks and
    back, complex tensors as real views, each device's shard where shard_bounds puts it."""
    from contextlib import nullcontext

    from gsync._core.transports.nccl import gather_shards, scatter_reduced
    from gsync.comm._shards import shard_bounds

    nccl = _NcclStandIn()
    generator = torch.Generator().manual_seed(numel)
    tensors = [torch.randn(numel, generator=generator).to(dtype) for _ in range(devices)]
    expected = sum(tensors)
    scatter_reduced(tensors, nccl.reduce_scatter, lambda i: nullcontext())
    bounds = shard_bounds(numel, devices)
    for tensor, (start, stop) in zip(tensors, bounds):
        torch.testing.assert_close(tensor[start:stop], expected[start:stop])  # type: ignore[index]
    for tensor, (start, stop) in zip(tensors, bounds):
        tensor[:start] = float("nan")
        tensor[stop:] = float("nan")
    gather_shards(tensors, nccl.all_gather, lambda i: nullcontext())
    for tensor in tensors:
        torch.testing.assert_close(tensor, expected)
    assert nccl.calls == 2


def test_importing_touches_no_cuda() -> None:
    code = "import gsync._core.streams, gsync._core.transports.nccl, torch; print(torch.cuda.is_initialized())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------
# Real CUDA
# --------------------------------------------------------------------------------------------------


def nccl_pair(devices: list[torch.device] | None = None) -> tuple[CudaStreamSync, NcclCollective]:
    devices = devices or cuda_devices()
    sync = CudaStreamSync(devices, 1)
    return sync, NcclCollective(devices, sync)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nccl_weighted_all_reduce(dtype: torch.dtype) -> None:
    sync, collective = nccl_pair()
    assert isinstance(collective, gsync.Collective)
    devices = sync.devices
    generator = torch.Generator().manual_seed(7)
    host = [torch.randn(4099, generator=generator).to(dtype) for _ in devices]
    rows = [3 + 2 * i for i in range(len(devices))]
    weights = [r / sum(rows) for r in rows]
    expected = sum(w * t.double() for w, t in zip(weights, host))
    tensors = [t.to(d) for t, d in zip(host, devices)]
    collective.all_reduce(tensors, weights)
    torch.cuda.synchronize()
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    for tensor in tensors:
        assert tensor.dtype == dtype
        torch.testing.assert_close(tensor.cpu().double(), expected, atol=tolerance, rtol=tolerance)  # type: ignore[arg-type]
    sync.close()


@needs_cuda
def test_nccl_fp16_does_not_overflow_and_zero_weights_contribute_nothing() -> None:
    sync, collective = nccl_pair()
    n = len(sync.devices)
    big = [torch.full((64,), 40000.0, dtype=torch.float16, device=d) for d in sync.devices]
    collective.all_reduce(big, [1 / n] * n)
    poisoned = [torch.full((8,), float("inf") if i else 3.0, device=d) for i, d in enumerate(sync.devices)]
    collective.all_reduce(poisoned, [1.0] + [0.0] * (n - 1))
    torch.cuda.synchronize()
    for tensor in big:
        assert torch.isfinite(tensor).all()
        torch.testing.assert_close(tensor.float().cpu(), torch.full((64,), 40000.0), rtol=1e-3, atol=0)
    for tensor in poisoned:
        torch.testing.assert_close(tensor.cpu(), torch.full((8,), 3.0))
    sync.close()


@needs_cuda
def test_nccl_broadcast_and_strided_tensors() -> None:
    sync, collective = nccl_pair()
    floats = [torch.full((5,), float(i), device=d) for i, d in enumerate(sync.devices)]
    ints = [torch.arange(3, device=d) + 10 * i for i, d in enumerate(sync.devices)]
    strided = [torch.full((4, 6), float(i + 1), device=d)[:, ::2] for i, d in enumerate(sync.devices)]
    collective.broadcast(floats)
    collective.broadcast(ints)
    collective.all_reduce(strided, [1.0] * len(strided))
    torch.cuda.synchronize()
    total = sum(range(1, len(strided) + 1))
    for f, i, s in zip(floats, ints, strided):
        assert torch.equal(f.cpu(), torch.zeros(5))
        assert torch.equal(i.cpu(), torch.arange(3))
        assert torch.equal(s.cpu(), torch.full((4, 3), float(total)))
    sync.close()


@needs_cuda
def test_nccl_collective_does_not_block_the_host() -> None:
    sync, collective = nccl_pair()
    tensors = [torch.zeros(1 << 20, device=d) for d in sync.devices]
    # The first reduction over these devices builds the communicators (ncclCommInitAll), which blocks the
    # host, and the first launch of each kernel may wait for the long kernel (see warm_kernels): neither may
    # land behind the long kernel, whatever ran before this test.
    warm_kernels(
        lambda: collective.all_reduce(tensors, [1.0] * len(tensors)),
        lambda: [tensor.fill_(1.0) for tensor in tensors],
    )
    for device, tensor in zip(sync.devices, tensors):
        with torch.cuda.device(device):
            long_kernel()  # on the caller's (default) stream, which the collective must wait for
            tensor.fill_(1.0)
    started = time.perf_counter()
    collective.all_reduce(tensors, [1.0] * len(tensors))
    host_time = time.perf_counter() - started
    busy = [not sync.comm_cuda_stream(d).query() for d in range(len(tensors))]
    torch.cuda.synchronize()
    assert all(busy), f"the comm stream finished within {host_time:.3f} s: the collective synchronized the host"
    for tensor in tensors:
        assert torch.all(tensor == len(tensors))
    sync.close()


@needs_cuda
def test_nccl_pipeline_across_threads_matches_the_arithmetic() -> None:
    """Compute streams produce, the comm thread reduces, device threads apply: three steps, every wait needed."""
    sync, collective = nccl_pair()
    devices = sync.devices
    n = len(devices)
    params = [torch.zeros(1 << 16, device=d) for d in devices]
    grads = [torch.zeros_like(p) for p in params]
    weights = [1 / n] * n

    def every_kernel_of_the_pipeline() -> None:
        # The communicators' set-up and each kernel's first launch (the scale, the sum, fill_, sub_) would
        # otherwise wait for step 0's long kernel (see warm_kernels): the reduction would then read the
        # gradients after they were written whether or not it waits, and a missing wait would go unseen.
        collective.all_reduce(grads, weights)
        for param, grad in zip(params, grads):
            grad.fill_(1.0)
            param.sub_(grad)
            param.zero_()
            grad.zero_()

    warm_kernels(every_kernel_of_the_pipeline)
    for step in range(3):
        for device in range(n):

            def backward(d: int = device) -> None:
                with sync.compute_stream(d):
                    if step == 0:
                        long_kernel()  # the reduction reads stale zeros unless it waits
                    grads[d].fill_(float((d + 1) * (step + 1)))
                    sync.mark_ready(d, 0)

            in_thread(backward)

        def reduce() -> None:
            sync.before_reduce(0)
            collective.all_reduce(grads, weights)
            sync.after_reduce(0)

        in_thread(reduce)
        for device in range(n):

            def apply(d: int = device) -> None:
                with sync.compute_stream(d):
                    sync.before_apply(d)
                    params[d].sub_(grads[d])

            in_thread(apply)
    sync.close()
    mean_rank = sum(range(1, n + 1)) / n
    expected = -mean_rank * (1 + 2 + 3)
    for param in params:
        torch.testing.assert_close(param.cpu(), torch.full((1 << 16,), expected))


@needs_cuda
def test_nccl_collective_checks_its_inputs() -> None:
    sync, collective = nccl_pair([torch.device("cuda", 0)])
    with pytest.raises(gsync.GsyncError, match="one tensor"):
        collective.all_reduce([], [])
    with pytest.raises(gsync.GsyncError, match="is on cpu"):
        collective.all_reduce([torch.ones(3)], [1.0])
    with pytest.raises(gsync.ConfigError, match="distinct"):
        NcclCollective(["cuda:0", "cuda:0"], sync)
    if torch.cuda.device_count() > 1:
        with pytest.raises(gsync.ConfigError, match="differ"):
            NcclCollective(["cuda:1"], sync)
    collective.close()
    collective.close()
    with pytest.raises(gsync.GsyncError, match="closed"):
        collective.broadcast([torch.ones(3, device="cuda:0")])
    sync.close()
