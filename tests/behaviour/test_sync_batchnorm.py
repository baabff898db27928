"""nn.SyncBatchNorm on the devices of one process: statistics over the whole global batch, exact."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import gsync
import gsync.testing
from tests.support.batchnorm import (
    NormNet,
    full_batch_reference,
    norm_batches,
    norm_loss,
    norm_sgd,
    synced,
    worst_difference,
)
from tests.support.reference import state_of

pytestmark = pytest.mark.asyncio


def _devices(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize(("affine", "momentum"), [(True, 0.1), (False, None)])
async def test_parameters_and_running_statistics_equal_one_device_on_the_full_batch(
    devices: int, affine: bool, momentum: float | None, no_leaks: None
) -> None:
    torch.manual_seed(0)
    model = NormNet(affine, momentum)
    # 11 and 13 rows: uneven over 2 and over 3 devices.
    batches = norm_batches(4, [11, 13, 11, 13])
    expected = state_of(full_batch_reference(model, [[b] for b in batches]))

    result = await gsync.Engine(_devices(devices), sync_timeout=30).fit(
        synced(model), batches, optimizer=norm_sgd, loss_fn=norm_loss
    )

    worst, where = worst_difference(state_of(result.model), expected)
    assert worst < 1e-5, f"{where} is {worst:g} off the full-batch run"
    assert "norm2d.running_var" in expected and "norm1d.num_batches_tracked" in expected


async def test_with_accumulation_each_batch_has_its_own_statistics(no_leaks: None) -> None:
    torch.manual_seed(1)
    model = NormNet()
    batches = norm_batches(4, [10, 7, 9, 11])
    expected = state_of(full_batch_reference(model, [batches[0:2], batches[2:4]]))

    result = await gsync.Engine(_devices(3), sync_timeout=30).fit(
        synced(model), batches, optimizer=norm_sgd, loss_fn=norm_loss, accumulate=2
    )

    worst, where = worst_difference(state_of(result.model), expected)
    assert worst < 1e-5, f"{where} is {worst:g} off the full-batch run"


async def test_a_batch_with_fewer_rows_than_devices_leaves_the_empty_shard_out(no_leaks: None) -> None:
    torch.manual_seed(2)
    model = NormNet()
    # 2 rows over 3 devices: cpu:2's shard is empty and must not count.
    batches = norm_batches(3, [7, 2, 8])
    expected = state_of(full_batch_reference(model, [[b] for b in batches]))

    result = await gsync.Engine(_devices(3), sync_timeout=30).fit(synced(model), batches, optimizer=norm_sgd, loss_fn=norm_loss)

    worst, where = worst_difference(state_of(result.model), expected)
    assert worst < 1e-5, f"{where} is {worst:g} off the full-batch run"


async def test_plain_batchnorm_keeps_per_shard_statistics_as_ddp_does(no_leaks: None) -> None:
    """Without the conversion each shard normalizes by its own statistics: not the full-batch run."""
    torch.manual_seed(0)
    model = NormNet()
    batches = norm_batches(3, 12)
    expected = state_of(full_batch_reference(model, [[b] for b in batches]))

    result = await gsync.Engine(_devices(2), sync_timeout=30).fit(copy.deepcopy(model), batches, optimizer=norm_sgd, loss_fn=norm_loss)

    worst, _ = worst_difference(state_of(result.model), expected)
    assert worst > 1e-3


async def test_evaluate_uses_the_running_statistics(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = NormNet()
    batches = norm_batches(3, 12)
    reference = full_batch_reference(model, [[b] for b in batches]).eval()

    async with gsync.Engine(_devices(2), sync_timeout=30).session(synced(model), optimizer=norm_sgd, loss_fn=norm_loss) as session:
        for batch in batches:
            await session.step(batch)
        metrics = await session.evaluate([batches[0]])

    with torch.no_grad():
        expected = float(norm_loss(reference, batches[0]))
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)


async def test_shared_device_threads_are_refused_before_any_work() -> None:
    engine = gsync.Engine(_devices(2), device_threads="shared")
    with pytest.raises(gsync.ConfigError, match="device_threads='per_device'"):
        await engine.fit(synced(NormNet()), norm_batches(1, 8), optimizer=norm_sgd, loss_fn=norm_loss)


async def test_a_device_failing_in_forward_ends_the_fit_while_the_others_wait_for_its_statistics(no_leaks: None) -> None:
    engine = gsync.Engine(_devices(3), sync_timeout=30)
    with gsync.testing.inject(engine, gsync.testing.fail(1, 1, "forward", error=RuntimeError("boom in forward"))):
        with pytest.raises(gsync.WorkerFailed, match="boom in forward") as raised:
            await engine.fit(synced(NormNet()), norm_batches(3, 9), optimizer=norm_sgd, loss_fn=norm_loss)
    assert raised.value.step == 1 and raised.value.site == "forward"


async def test_the_users_model_keeps_torchs_own_forward(no_leaks: None) -> None:
    model = synced(NormNet())
    result = await gsync.Engine(_devices(2), sync_timeout=30).fit(model, norm_batches(1, 8), optimizer=norm_sgd, loss_fn=norm_loss)
    layers = [m for m in result.model.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert layers and all("forward" not in vars(layer) for layer in layers)


class _Recorded(nn.Module):
    """Records which device thread enters it (a module-level list: every replica's copy appends to the same one)."""

    entries: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Recorded.entries.append(threading.current_thread().name)
        return x


async def test_the_first_step_runs_the_devices_in_turn_between_their_meetings(no_leaks: None) -> None:
    # Torch sets CPU kernels up on first use, and two threads doing so at once may round differently: the first
    # step runs one device at a time, here between the layers where the devices meet.
    model = nn.Sequential(nn.Linear(16, 8), _Recorded(), nn.BatchNorm1d(8), _Recorded(), nn.BatchNorm1d(8), nn.Linear(8, 5))
    _Recorded.entries = []
    engine = gsync.Engine(_devices(3), sync_timeout=30, device_threads="per_device")
    async with engine.session(synced(model), optimizer=norm_sgd, loss_fn=norm_loss) as session:
        await session.step(norm_batches(1, 9)[0])
        first = list(_Recorded.entries)
        for batch in norm_batches(3, 9, seed=3):
            await session.step(batch)
    devices = [f"gsync-device-{i}" for i in range(3)]
    # Each segment between meetings runs on device 0, then 1, then 2.
    assert first == devices + devices, first
