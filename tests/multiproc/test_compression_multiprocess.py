"""``Engine(compression=...)`` across 2 real processes (gloo on loopback), against 2 devices of one process.

With compression on, 2 processes of 1 device and 1 process of 2 devices must
end with the same parameters to the bit (both run the same weighted cast and
the same two-term sum), and the bytes that cross the process group halve.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks
from tests.support.inside import replace_process_group_dist
from tests.support.models import classification_loss, make_batches, sgd

STEPS = 8
ROWS = 31  # uneven over 2 devices: weights 16/31 and 15/31
COMPRESSIONS: tuple[Literal["bf16", "fp16"] | None, ...] = (None, "bf16", "fp16")
SCALE = 40000.0  # the overflow case: each device's gradient fits fp16, the two devices' sum does not


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def scaled_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).mean() * SCALE


def tiny_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-6)


def ones_linear() -> nn.Module:
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    return model


class CountingDist:
    """``torch.distributed`` as the process-group collective sees it, counting the bytes it all-reduces."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.dtypes: set[torch.dtype] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.nbytes += tensor.numel() * tensor.element_size()
        self.dtypes.add(tensor.dtype)
        return torch.distributed.all_reduce(tensor, *args, **kwargs)


async def train_all(devices: list[str], wire: dict[str, CountingDist] | None = None) -> dict[str, Any]:
    """Every configuration, on ``devices`` of this process (and, under the harness, the other rank's); with
    ``wire``, each compression's fit also counts what the process-group collective hands to gloo there."""
    import gsync

    out: dict[str, Any] = {}
    for compression in COMPRESSIONS:
        counting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if wire is not None:
            wire[str(compression)] = counter = CountingDist()
            counting = replace_process_group_dist(counter)
        with counting:
            result = await gsync.Engine(devices, compression=compression, sync_timeout=30).fit(
                mlp(), make_batches(STEPS, ROWS), optimizer=sgd, loss_fn=classification_loss
            )
        out[str(compression)] = {
            "state": {k: v.detach().clone() for k, v in result.model.state_dict().items()},
            "losses": result.losses,
            "reduced_bytes": result.stats.reduced_bytes,
        }
    overflow = await gsync.Engine(devices, compression="fp16", sync_timeout=30).fit(
        ones_linear(), [(torch.ones(3, 4), torch.zeros(3))], optimizer=tiny_sgd, loss_fn=scaled_loss
    )
    out["overflow"] = overflow.model.get_parameter("weight").detach().clone()
    return out


def rank_main() -> dict[str, Any]:
    counters: dict[str, CountingDist] = {}
    out = asyncio.run(train_all(["cpu"], counters))
    out["wire"] = {key: (counter.nbytes, sorted(str(d) for d in counter.dtypes)) for key, counter in counters.items()}
    return out


@pytest.mark.timeout(240)
def test_two_processes_equal_two_devices_of_one_process_bit_for_bit_and_move_half_the_bytes() -> None:
    ranks = [result.value for result in run_ranks(rank_main, 2, timeout=220, check=True)]
    local = asyncio.run(train_all(["cpu:0", "cpu:1"]))
    for key in ("bf16", "fp16"):
        for rank, out in enumerate(ranks):
            for name, value in out[key]["state"].items():
                assert torch.equal(value, local[key]["state"][name]), f"{key}, rank {rank}, {name}"
            assert out[key]["losses"] == pytest.approx(local[key]["losses"], abs=1e-6)
    # Without compression the two topologies agree to float rounding only (a + w1*(b - a) in one process).
    for name, value in ranks[0]["None"]["state"].items():
        torch.testing.assert_close(value, local["None"]["state"][name], atol=2e-5, rtol=0)
    # fp16 with gradients whose two-device sum overflows: finite, and the same on both topologies.
    for out in ranks:
        assert torch.isfinite(out["overflow"]).all()
        assert torch.equal(out["overflow"], local["overflow"])
    torch.testing.assert_close(local["overflow"], torch.full((1, 4), 1 - 1e-6 * SCALE), rtol=0, atol=1e-6)
    # Bytes on the process group: every bucket all-reduce, counted where gloo gets it; half of fp32's.
    for out in ranks:
        plain, plain_dtypes = out["wire"]["None"]
        assert plain_dtypes == ["torch.float32"] and plain > 0
        for key, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
            nbytes, dtypes = out["wire"][key]
            assert dtypes == [dtype]
            assert nbytes * 2 == plain
            assert nbytes == out[key]["reduced_bytes"]  # the server's counter says what crossed the group
        assert out["None"]["reduced_bytes"] == plain
