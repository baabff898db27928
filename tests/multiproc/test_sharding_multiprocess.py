"""``shard_optimizer=True`` across 2 real processes (gloo on loopback): 2 x 1 and 2 x 2 devices, each device
stepping its shard, equal to the plain one-device loop and to the unsharded run within 1e-5, and
``session.checkpoint()`` on both ranks gathering the whole optimizer state, the unsharded run's.
Checkpoint files and resuming them: ``test_sharded_checkpoint_multiprocess.py``."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.models import TINY, TiedNet, adamw, classification_loss, make_batches, momentum
from tests.support.reference import assert_same_optimizer_state, plain_loop

STEPS = 4
ROWS = 19  # uneven over 2 and over 4 devices
CLIP = 0.5

# Every optimizer is sharded on 2 and 3 devices of one process (tests/behaviour/test_sharding.py); across processes,
# one of each kind of state: a momentum buffer, and AdamW's moments with their scalar step (Adam's are the same).
OPTIMIZERS = {"sgd_momentum": momentum, "adamw": adamw}
LAYOUTS = {"2x1": ["cpu"], "2x2": ["cpu:0", "cpu:1"]}


def steps() -> list[list[Any]]:
    batches = make_batches(STEPS * 2, ROWS)
    return [batches[i : i + 2] for i in range(0, len(batches), 2)]


def train_sharded() -> dict[str, Any]:
    """Each rank: every optimizer, sharded on each layout, and unsharded on 2 x 2; clipped, two batches a step."""
    import gsync

    torch.manual_seed(0)
    model = TiedNet()
    out: dict[str, Any] = {}

    async def run(devices: list[str], shard: bool, optimizer: Any) -> tuple[dict[str, torch.Tensor], int, dict[str, Any]]:
        trained = copy.deepcopy(model)
        engine = gsync.Engine(devices, shard_optimizer=shard, sync_timeout=60, **TINY)
        async with engine.session(trained, optimizer=optimizer, loss_fn=classification_loss, clip_grad_norm=CLIP) as session:
            for batches in steps():
                await session.step(*batches)
            state = sum(
                v.numel() for opt in session.optimizers for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
            # Sharded, half the state is on the other process: every rank takes the checkpoint, which gathers it.
            checkpoint = session.checkpoint()
        return {k: v.detach().clone() for k, v in trained.state_dict().items()}, state, checkpoint.optimizer_state

    async def all_runs() -> None:
        for name, optimizer in OPTIMIZERS.items():
            for layout, devices in LAYOUTS.items():
                out[f"{name}-{layout}"] = await run(devices, True, optimizer)
            out[f"{name}-unsharded"] = await run(LAYOUTS["2x2"], False, optimizer)

    asyncio.run(all_runs())
    return out


@pytest.fixture(scope="module")
def ranks() -> list[Any]:
    return run_ranks(train_sharded, 2, timeout=240, check=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_across_processes_equals_the_plain_loop_and_unsharded(ranks: list[Any], name: str, layout: str) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    expected, _, _, _ = plain_loop(model, steps(), optimizer=OPTIMIZERS[name], clip=CLIP)
    want = expected.state_dict()
    states = []
    for rank in ranks:
        sharded, state, gathered = rank.value[f"{name}-{layout}"]
        unsharded, copies, whole_state = rank.value[f"{name}-unsharded"]
        whole = copies // 2  # unsharded, each of the rank's 2 devices holds all of it
        for key, value in sharded.items():
            torch.testing.assert_close(value, want[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"rank {rank.rank} {k}: {m}")
            torch.testing.assert_close(value, unsharded[key], atol=1e-5, rtol=0)
        states.append(state)
        # The checkpoint holds the whole state, as the unsharded run's does.
        assert_same_optimizer_state(gathered, whole_state)
    # Every element's state is on exactly one device of one process.
    assert sum(states) == whole, (states, whole)
