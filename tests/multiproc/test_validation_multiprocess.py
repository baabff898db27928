"""Validation inside ``fit`` across 2 real processes (gloo on loopback): every rank evaluates (``evaluate`` is a
collective) and gets the same evaluations, equal to one process's run on the same two devices; rank 0 alone writes
``best.pt``, unsharded and with ``shard_optimizer=True`` (where every rank takes part in gathering each best file).

Each rank is given a directory of its own, so that a write by rank 1 would show.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gsync
from tests.support.harness import run_ranks
from tests.support.models import TiedNet, adamw, classification_loss, make_batches

BATCHES = make_batches(5, 16)
VAL = make_batches(2, 10, seed=7)


def score(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """The validation loss kept by its highest value: the first evaluation is the best, so best.pt is step 1's."""
    return {"score": classification_loss(model, batch)}


async def fit(devices: list[str], shard: bool, directory: Path) -> gsync.FitResult:
    torch.manual_seed(0)
    return await gsync.Engine(devices, shard_optimizer=shard, sync_timeout=60).fit(
        TiedNet(), BATCHES, optimizer=adamw, loss_fn=classification_loss, val_data=VAL, eval_every=2,
        val_metric_fn=score, keep_best="score", best_mode="max", checkpoint_dir=directory, keep=1, progress=False,
    )


def ranks_validate(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def run() -> None:
        for shard in (False, True):
            own = Path(directory) / f"shard{shard}" / f"rank{os.environ['RANK']}"
            result = await fit(["cpu"], shard, own)
            out[f"shard{shard}"] = [(e.step, e.metrics, e.best) for e in result.evaluations]

    asyncio.run(run())
    return out


@pytest.mark.timeout(300)
def test_every_rank_evaluates_alike_and_rank_0_alone_writes_the_best(tmp_path: Path) -> None:
    values = [rank.value for rank in run_ranks(ranks_validate, 2, args=(str(tmp_path),), timeout=240, check=True)]
    one_process = asyncio.run(fit(["cpu:0", "cpu:1"], False, tmp_path / "one"))
    expected = [(e.step, e.metrics, e.best) for e in one_process.evaluations]
    assert [step for step, _, _ in expected] == [1, 3, 4]
    for shard in (False, True):
        ranks = [value[f"shard{shard}"] for value in values]
        assert ranks[0] == ranks[1], shard  # identical on both ranks, bit for bit
        for (step, metrics, best), (want_step, want_metrics, want_best) in zip(ranks[0], expected, strict=True):
            assert (step, best) == (want_step, want_best)
            assert metrics["score"] == pytest.approx(want_metrics["score"], abs=1e-5)
        written = tmp_path / f"shard{shard}"
        assert sorted(path.name for path in (written / "rank0").iterdir()) == ["best.json", "best.pt", "step-00000004.pt"]
        # Rank 1 writes nothing (sharded, it holds a writer to gather with, which made the directory).
        assert not (written / "rank1").exists() or list((written / "rank1").iterdir()) == []
        best = gsync.Checkpoint.load(written / "rank0" / "best.pt")
        assert best.step == 1
        assert best.optimizer_state["state"].keys() == gsync.Checkpoint.load(written / "rank0" / "step-00000004.pt").optimizer_state["state"].keys()
