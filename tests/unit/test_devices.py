from __future__ import annotations

import pytest
import torch

import gsync
from gsync._core.devices import parse_devices


def test_canonical_names() -> None:
    assert [d.name for d in parse_devices(["cpu", "cpu:1", torch.device("cpu", 2)])] == ["cpu:0", "cpu:1", "cpu:2"]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cpu:0", "cpu:0"], "cpu:0 is listed twice"),
        (["cpu", "cpu:0"], "cpu:0 is listed twice"),
        (["tpu:0"], "unknown device 'tpu:0'"),
        (["meta"], "unsupported device 'meta'"),
        ([], "devices is empty"),
        ("cpu:0", "devices must be a list"),
        ([3], "pass a string"),
    ],
)
def test_bad_device_lists_are_refused(devices: object, message: str) -> None:
    with pytest.raises(gsync.ConfigError, match=message):
        gsync.Engine(devices)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixing needs a CUDA device to be valid on its own")
def test_cpu_and_cuda_cannot_be_mixed() -> None:
    with pytest.raises(gsync.ConfigError, match="mix CPU and CUDA"):
        gsync.Engine(["cpu:0", "cuda:0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(gsync.ConfigError, match="torch.cuda.is_available"):
        gsync.Engine(["cuda:0"])


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_mb", "sync_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1"])
def test_non_positive_settings_are_refused(name: str, value: object) -> None:
    with pytest.raises(gsync.ConfigError, match=name):
        gsync.Engine(["cpu"], **{name: value})  # type: ignore[arg-type]
