"""A step's losses are read after its backward passes are launched, in order, with their weights."""

from __future__ import annotations

import math

import pytest
import torch

import gsync
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import train_reference
from gsync._core.step.readout import LossReadout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_losses_read_back_in_order_with_their_weights(device: str) -> None:
    readout = LossReadout(torch.device(device))
    for batches in (1, 3, 2):  # growing and shrinking between steps
        readout.start(batches)
        values = [torch.tensor(float(i) + 0.5, device=device, requires_grad=True) * 2 for i in range(batches)]
        for value in values:
            readout.add(value, 1 / batches)
        # The slots are reused next step: what a step read must not change afterwards.
        assert readout.read() == [(2 * i + 1.0, 1 / batches) for i in range(batches)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_non_finite_loss_reads_as_itself(device: str) -> None:
    readout = LossReadout(torch.device(device))
    readout.start(2)
    readout.add(torch.tensor(float("nan"), device=device), 0.5)
    readout.add(torch.tensor(float("inf"), device=device), 0.5)
    (nan, _), (inf, _) = readout.read()
    assert math.isnan(nan) and inf == math.inf


@pytest.mark.asyncio
async def test_a_non_finite_first_batch_of_an_accumulated_step_skips_the_whole_step() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 12)
    poisoned = [(x.clone(), y) for x, y in batches]
    poisoned[2][0][0, 0] = float("nan")  # the first batch of step 1 (batches 2 and 3)
    # Step 1 left out: the same as training on steps 0 and 2 only (two equal batches accumulated = one of both).
    def joined(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([batches[a][0], batches[b][0]]), torch.cat([batches[a][1], batches[b][1]])

    expected, _ = train_reference(model, [joined(0, 1), joined(4, 5)])
    result = await gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip").fit(
        model, poisoned, optimizer=sgd, loss_fn=classification_loss, accumulate=2
    )
    assert result.skipped_steps == [1]
    assert math.isnan(result.losses[1]) and all(math.isfinite(loss) for loss in (result.losses[0], result.losses[2]))
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
