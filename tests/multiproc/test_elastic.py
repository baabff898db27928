"""Elastic runs over real processes and gloo: a rank lost, the step redone over the survivors, exact parameters.

The store lives in the test process (as torchrun's agent hosts it), so any
rank, rank 0 included, may be lost. Every run is compared with one plain
PyTorch loop over the same global batches: each step's gradient is the mean
over the whole global batch however it is split, so an elastic run that
applies every step exactly once ends where the uninterrupted run does.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
import torch

from tests.multiproc.elastic_job import global_batches, loss, model, optimizer
from tests.multiproc.elastic_ranks import ElasticRanks

STEPS = 10


def uninterrupted(steps: int = STEPS) -> dict[str, torch.Tensor]:
    reference = model()
    optim = optimizer(reference.parameters())
    for batch in global_batches(steps):
        optim.zero_grad()
        loss(reference, batch).backward()
        optim.step()
    return reference.state_dict()


def assert_equal_to(expected: dict[str, torch.Tensor], outcome: dict[str, Any]) -> None:
    assert outcome["ok"], outcome.get("traceback")
    for name, tensor in expected.items():
        torch.testing.assert_close(outcome["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def survivors(ranks: ElasticRanks, names: list[str], timeout: float = 90) -> dict[str, dict[str, Any]]:
    outcomes = ranks.results(timeout)
    for name in names:
        assert name in outcomes and outcomes[name]["ok"], f"rank {name}: {outcomes.get(name)}\n{ranks.logs()}"
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_left_behind_and_the_survivors_end_exact(victim: int) -> None:
    config = {"steps": STEPS, "die": {"rank": victim, "step": 4, "how": "kill"}}
    with ElasticRanks(3, config) as ranks:
        outcomes = survivors(ranks, [str(r) for r in range(3) if r != victim])
    expected = uninterrupted()
    kept = [r for r in range(3) if r != victim]
    for rank in kept:
        outcome = outcomes[str(rank)]
        assert_equal_to(expected, outcome)
        (change,) = outcome["membership"]
        step, lost, joined, world_size, seconds, reason = change
        assert (lost, joined, world_size, reason) == ((victim,), (), 2, "lost")
        assert step in (4, 5), change  # the step redone, or the next one when a survivor had applied it
        assert 0 < seconds < 30
        # Every step is applied exactly once on each survivor: 3 ranks until the change, 2 after it.
        assert outcome["world_sizes"][:4] == [3, 3, 3, 3]
        assert outcome["world_sizes"][-1] == 2
        assert outcome["changes_seen"] == [f"membership change at step {step}: lost rank(s) {victim}; 2 rank(s) now"]


@pytest.mark.timeout(120)
def test_a_rank_whose_loss_fn_raises_still_stops_everyone() -> None:
    config = {"steps": STEPS, "die": {"rank": 1, "step": 4, "how": "raise"}}
    with ElasticRanks(3, config) as ranks:
        outcomes = ranks.results(90)
    assert outcomes["1"]["type"] == "WorkerFailed", outcomes["1"]
    for rank in ("0", "2"):
        assert not outcomes[rank]["ok"], outcomes[rank]
        assert outcomes[rank]["type"] == "PeerFailed", outcomes[rank]
        assert "rank 1" in outcomes[rank]["message"]


@pytest.mark.timeout(120)
def test_below_min_world_size_every_survivor_raises_peer_lost() -> None:
    config = {"steps": STEPS, "die": {"rank": 2, "step": 4, "how": "kill"}, "min_world_size": 3}
    with ElasticRanks(3, config) as ranks:
        outcomes = ranks.results(90)
    for rank in ("0", "1"):
        assert outcomes[rank]["type"] == "PeerLost", outcomes[rank]
        assert "min_world_size=3" in outcomes[rank]["message"]


@pytest.mark.timeout(120)
def test_a_users_own_step_loop_is_carried_across_a_loss() -> None:
    config = {"steps": STEPS, "mode": "loop", "die": {"rank": 1, "step": 4, "how": "kill"}}
    with ElasticRanks(3, config) as ranks:
        outcomes = survivors(ranks, ["0", "2"])
    expected = uninterrupted()
    for rank in ("0", "2"):
        assert_equal_to(expected, outcomes[rank])
        assert outcomes[rank]["world_sizes"][-1] == 2


@pytest.mark.timeout(150)
def test_the_killed_rank_started_again_rejoins_and_all_three_end_equal() -> None:
    config = {"steps": 14, "die": {"rank": 1, "step": 3, "how": "kill"}, "wait_for_knock": {"step": 7}}
    with ElasticRanks(3, config) as ranks:
        assert ranks.wait("1", 60) == -signal.SIGKILL
        again = ranks.start(1, {"steps": 14})
        outcomes = survivors(ranks, ["0", "2", again])
    expected = uninterrupted(14)
    for name in ("0", "2", again):
        assert_equal_to(expected, outcomes[name])
    for name in ("0", "2"):
        changes = outcomes[name]["membership"]
        assert [(c[1], c[2], c[3]) for c in changes] == [((1,), (), 2), ((), (1,), 3)], changes
    joiner = outcomes[again]
    assert joiner["first_step"] == joiner["membership"][0][0] > 7
    assert joiner["world_sizes"] == [3] * len(joiner["world_sizes"])
