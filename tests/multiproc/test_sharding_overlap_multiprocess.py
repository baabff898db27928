"""``shard_optimizer=True`` across 2 real processes (gloo on loopback): the all-gather overlapping the next
forward, held on one rank by a gate until a reader waits for the held bucket (the other rank waits in the
collective meanwhile), trains as the plain loop does; and a rank lost inside the all-gather fails the other
rank's session, which does not hang in the gather nor in its forward's wait for it.
The gate: ``tests.support.gates.GatherGate``; in one process: ``tests/behaviour/test_sharding_overlap.py``."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks
from tests.support.models import classification_loss, make_batches
from tests.support.reference import plain_loop

STEPS = 4
TINY = {"first_bucket_mb": 0.001, "bucket_cap_mb": 0.002}


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def make_model() -> nn.Sequential:
    torch.manual_seed(31)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def steps() -> list[list[Any]]:
    return [[batch] for batch in make_batches(STEPS, 20)]


def gated_rank(mode: str, devices: list[str]) -> dict[str, Any]:
    """Rank 0 gates every all-gather of the head's bucket (``mode`` as :class:`GatherGate` takes it; ``"exit"`` on
    rank 1 only, at its second gather); returns the trained parameters and the gate's events."""
    import gsync
    from tests.support.gates import GatherGate, bucket_of

    rank = int(os.environ["RANK"])
    trained = copy.deepcopy(make_model())

    async def run() -> dict[str, Any]:
        engine = gsync.Engine(devices, shard_optimizer=True, sync_timeout=30, **TINY)
        async with engine.session(trained, optimizer=adamw, loss_fn=classification_loss) as session:
            sharding = session._core._context.sharding  # noqa: SLF001 - the gate wraps the session's sharded step
            assert sharding is not None
            head = bucket_of(sharding, "4.weight")
            gate = None
            if mode == "open" and rank == 0:
                gate = GatherGate(sharding, head, "open", always=True)
            elif mode == "exit" and rank == 1:
                gate = GatherGate(sharding, head, "exit")
            for index, batches in enumerate(steps()):
                if gate is not None and mode == "exit" and index == 1:
                    await sharding.whole()  # step 0's gather is done: the gate holds step 1's
                    gate.arm()  # rank 1 leaves inside it, rank 0 waits in it
                await session.step(*batches)
        return {
            "params": {k: v.detach().clone() for k, v in trained.state_dict().items()},
            "events": [] if gate is None else gate.events,
        }

    return asyncio.run(run())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("devices", [["cpu"], ["cpu:0", "cpu:1"]], ids=["2x1", "2x2"])
def test_a_held_all_gather_overlaps_the_next_forward_and_trains_as_the_plain_loop(devices: list[str]) -> None:
    ranks = run_ranks(gated_rank, 2, args=("open", devices), timeout=150, check=True)
    expected, _, _, _ = plain_loop(make_model(), steps(), optimizer=adamw)
    for rank in ranks:
        for name, value in expected.state_dict().items():
            torch.testing.assert_close(rank.value["params"][name], value, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # Every gather of the head's bucket on rank 0 waited for a reader: the next forward, or the end.
    events = ranks[0].value["events"]
    assert events.count("gathered") == STEPS and events[0] == "reader waits"


@pytest.mark.timeout(180)
def test_a_rank_lost_inside_the_all_gather_fails_the_other_ranks_session_without_a_hang() -> None:
    ranks = run_ranks(gated_rank, 2, args=("exit", ["cpu"]), timeout=150, failure_grace=120)
    lost, survivor = ranks[1], ranks[0]
    assert lost.returncode == 3 and not lost.returned
    assert survivor.returned and not survivor.killed, survivor.stderr[-3000:]
    assert survivor.error_type is not None and survivor.error_type.startswith("gsync."), (survivor.error_type, survivor.error)
    assert "step 1" in (survivor.error or ""), survivor.error
