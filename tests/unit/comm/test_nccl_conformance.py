"""The Collective conformance suite, run on NcclCollective (needs CUDA).

The suite's cases are imported from ``test_conformance.py`` unchanged and
collected here with this module's ``make`` fixture. They build CPU tensors,
so the factory returns an adapter that copies them to one GPU each, runs the
real NcclCollective (stream-ordered), synchronizes, and copies the results
back. A case that needs more devices than the machine has is skipped.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import gsync
from gsync._core.transports.nccl import NcclCollective
from gsync._core.streams import CudaStreamSync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _load_suite() -> object:
    # By path, so this works whatever pytest's import mode (prepend, append, importlib).
    spec = importlib.util.spec_from_file_location("_gsync_conformance_suite", Path(__file__).with_name("test_conformance.py"))
    if spec is None or spec.loader is None:
        raise ImportError("cannot load tests/unit/comm/test_conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load_suite()
test_is_a_collective = _suite.test_is_a_collective  # type: ignore[attr-defined]
test_weighted_all_reduce = _suite.test_weighted_all_reduce  # type: ignore[attr-defined]
test_fp16_weighted_sum_does_not_overflow = _suite.test_fp16_weighted_sum_does_not_overflow  # type: ignore[attr-defined]
test_broadcast_from_first_device = _suite.test_broadcast_from_first_device  # type: ignore[attr-defined]
test_zero_weight_devices_contribute_nothing = _suite.test_zero_weight_devices_contribute_nothing  # type: ignore[attr-defined]
test_reduce_scatter_gives_each_device_the_weighted_sum_of_its_shard = (
    _suite.test_reduce_scatter_gives_each_device_the_weighted_sum_of_its_shard  # type: ignore[attr-defined]
)
test_reduce_scatter_leaves_zero_weight_devices_out = _suite.test_reduce_scatter_leaves_zero_weight_devices_out  # type: ignore[attr-defined]
test_fp16_reduce_scatter_does_not_overflow = _suite.test_fp16_reduce_scatter_does_not_overflow  # type: ignore[attr-defined]
test_all_gather_gives_every_device_every_owners_shard = _suite.test_all_gather_gives_every_device_every_owners_shard  # type: ignore[attr-defined]
test_reduce_scatter_then_all_gather_is_an_all_reduce = _suite.test_reduce_scatter_then_all_gather_is_an_all_reduce  # type: ignore[attr-defined]


class _OnGpus:
    """NcclCollective behind the suite's CPU-tensor interface: one GPU per device, synchronized on return."""

    def __init__(self, num_devices: int) -> None:
        available = torch.cuda.device_count()
        if num_devices > available:
            pytest.skip(f"needs {num_devices} CUDA devices, this machine has {available}")
        self._devices = [torch.device("cuda", i) for i in range(num_devices)]
        self._streams = CudaStreamSync(self._devices, 1)
        self.inner = NcclCollective(self._devices, self._streams)

    @property
    def world_devices(self) -> int:
        return self.inner.world_devices

    @property
    def capabilities(self) -> frozenset[str]:
        return self.inner.capabilities

    def all_reduce(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        on_gpus = [t.to(d) for t, d in zip(tensors, self._devices)]
        self.inner.all_reduce(on_gpus, weights)
        self._copy_back(tensors, on_gpus)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        on_gpus = [t.to(d) for t, d in zip(tensors, self._devices)]
        self.inner.broadcast(on_gpus)
        self._copy_back(tensors, on_gpus)

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        on_gpus = [t.to(d) for t, d in zip(tensors, self._devices)]
        self.inner.reduce_scatter(on_gpus, weights)
        self._copy_back(tensors, on_gpus)

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> None:
        on_gpus = [t.to(d) for t, d in zip(tensors, self._devices)]
        self.inner.all_gather(on_gpus)
        self._copy_back(tensors, on_gpus)

    def close(self) -> None:
        self.inner.close()
        self._streams.close()

    @staticmethod
    def _copy_back(tensors: Sequence[torch.Tensor], on_gpus: Sequence[torch.Tensor]) -> None:
        torch.cuda.synchronize()
        for tensor, result in zip(tensors, on_gpus):
            tensor.copy_(result.cpu())


@pytest.fixture
def make() -> Callable[[int], gsync.Collective]:
    return _OnGpus


def test_nccl_collective_itself_is_a_collective() -> None:
    devices = [torch.device("cuda", 0)]
    streams = CudaStreamSync(devices, 1)
    collective = NcclCollective(devices, streams)
    assert isinstance(collective, gsync.Collective)
    assert collective.world_devices == 1
    collective.close()
    collective.close()
    streams.close()
