"""uneven="join": ranks whose process-local data ends first step on with empty shards, exact against the union."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.batchnorm import (
    NormNet,
    full_batch_reference,
    norm_batches,
    norm_loss,
    synced,
    worst_difference,
)
from tests.support.harness import run_ranks
from tests.support.models import TiedNet, classification_loss, sgd
from tests.support.reference import state_of


def rank_batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s own ``count`` batches, of 6 to 8 rows (ranks' batches differ in size too)."""
    batches = []
    for k in range(count):
        generator = torch.Generator().manual_seed(100 * rank + k)
        rows = 6 + (rank + k) % 3
        x = torch.cat([torch.randn(rows, 12, generator=generator), torch.randn(rows, 4, generator=generator) * 3 + 2], 1)
        batches.append((x, torch.randint(0, 5, (rows,), generator=generator)))
    return batches


def tied_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return classification_loss(model, (batch[0][:, :12], batch[1]))


def union_steps(counts: list[int], accumulate: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step k of the union: each of its batch positions, every rank's batch there that exists, rank-major."""
    usable = [count // accumulate * accumulate for count in counts]
    data = [rank_batches(rank, count) for rank, count in enumerate(counts)]
    steps = []
    for k in range(max(usable) // accumulate):
        positions = []
        for p in range(k * accumulate, (k + 1) * accumulate):
            parts = [data[rank][p] for rank in range(len(counts)) if p < usable[rank]]
            positions.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        steps.append(positions)
    return steps


def union_reference(model: torch.nn.Module, steps: list[list[Any]], loss_fn: Any, epochs: int = 1) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = sgd([p for p in model.parameters() if p.requires_grad])
    for _ in range(epochs):
        for positions in steps:
            optimizer.zero_grad(set_to_none=True)
            for batch in positions:
                (loss_fn(model, batch) / len(positions)).backward()
            optimizer.step()
    return state_of(model)


def tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TiedNet()


def norm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return NormNet()


class StopAt:
    def __init__(self, step: int) -> None:
        self.stop_after = step

    def on_step_end(self, session: Any, result: Any) -> None:
        import gsync

        if result.step == self.stop_after:
            raise gsync.StopTraining


def joined_runs(counts: list[int], directory: str) -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])
    mine = rank_batches(rank, counts[rank])
    out: dict[str, Any] = {}

    def engine() -> gsync.Engine:
        return gsync.Engine(["cpu"], sync_timeout=30)

    async def runs() -> None:
        common = dict(optimizer=sgd, process_local_data=True, uneven="join")
        result = await engine().fit(tied_model(), mine, loss_fn=tied_loss, **common)
        out["fit"] = (state_of(result.model), [record.step for record in result.history])
        result = await engine().fit(tied_model(), mine, loss_fn=tied_loss, accumulate=2, epochs=2, **common)
        out["accumulate_2_epochs_2"] = state_of(result.model)
        result = await engine().fit(synced(norm_model()), mine, loss_fn=norm_loss, **common)
        out["sync_batchnorm"] = state_of(result.model)

        # A checkpoint in the middle (after step 2), then a fresh fit resumed from it. Each rank resumes from its
        # own result's: rank 0's file may still be being written when another rank lists the directory.
        stopped = await engine().fit(
            tied_model(), mine, loss_fn=tied_loss, accumulate=2, epochs=2, checkpoint_dir=Path(directory) / f"rank{rank}",
            checkpoint_every=1, callbacks=[StopAt(2)], **common,
        )
        checkpoint = stopped.checkpoint
        if rank == 0:
            # The file rank 0 wrote holds the same state and the run's data position.
            checkpoint = gsync.Checkpoint.load(sorted((Path(directory) / "rank0").glob("*.pt"))[-1])
        out["checkpoint_position"] = checkpoint.data_position
        result = await engine().fit(
            tied_model(), mine, loss_fn=tied_loss, accumulate=2, epochs=2, resume=checkpoint, **common
        )
        out["resumed"] = (state_of(result.model), result.first_step)

        # A loop of the user's own: step(None) once its data has ended, until no rank has a batch.
        async with engine().session(tied_model(), loss_fn=tied_loss, **common) as session:
            for batch in mine:
                await session.step(batch)
            while (await session.step(None)).rows:
                pass
            out["own_loop"] = (state_of(session.model), session.next_step)

    asyncio.run(runs())
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("counts", [[5, 3], [5, 3, 0]])
def test_joined_ranks_equal_one_process_on_the_union(counts: list[int], tmp_path: Path) -> None:
    results = run_ranks(joined_runs, len(counts), args=(counts, str(tmp_path)), timeout=230, check=True)
    steps_1 = union_steps(counts, 1)
    steps_2 = union_steps(counts, 2)
    expected = {
        "fit": union_reference(tied_model(), steps_1, tied_loss),
        "accumulate_2_epochs_2": union_reference(tied_model(), steps_2, tied_loss, epochs=2),
        "sync_batchnorm": union_reference(norm_model(), steps_1, norm_loss),
        "resumed": union_reference(tied_model(), steps_2, tied_loss, epochs=2),
        "own_loop": union_reference(tied_model(), steps_1, tied_loss),
    }
    for result in results:
        out = result.value
        state, steps = out["fit"]
        assert steps == list(range(max(counts))), f"rank {result.rank} stepped {steps}"
        out["fit"] = state
        out["resumed"], first_step = out["resumed"]
        assert first_step == 3, f"rank {result.rank} resumed at {first_step}"
        # After step 2 of accumulate=2 over 5 batches (2 steps per epoch): 1 step into epoch 1, alike on every rank.
        assert out.pop("checkpoint_position") == (1, 2)
        out["own_loop"], next_step = out["own_loop"]
        assert next_step == max(counts)
        for key, reference in expected.items():
            worst, where = worst_difference(out[key], reference)
            assert worst < 1e-5, f"rank {result.rank}, {key}: {where} is {worst:g} off the union run"


def refused_by_default() -> str:
    import gsync

    rank = int(os.environ["RANK"])
    try:
        asyncio.run(gsync.Engine(["cpu"], sync_timeout=30).fit(
            tied_model(), rank_batches(rank, 4 if rank == 0 else 2), optimizer=sgd, loss_fn=tied_loss,
            process_local_data=True,
        ))
    except gsync.ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(90)
def test_data_of_unequal_length_is_refused_by_default_naming_uneven_join() -> None:
    for result in run_ranks(refused_by_default, 2, timeout=80, check=True):
        assert "uneven='join'" in result.value, result.value


class _UnevenElasticRanks:
    """ElasticRanks (the store in this process, as torchrun's agent hosts it) running uneven_elastic_job.py."""

    @staticmethod
    def make(world_size: int, config: dict[str, Any]) -> Any:
        import subprocess
        import sys

        from tests.multiproc import elastic_ranks

        job = Path(__file__).with_name("uneven_elastic_job.py")

        class Ranks(elastic_ranks.ElasticRanks):
            def start(self, rank: int, config: dict[str, Any] | None = None) -> str:
                import json

                name = str(rank)
                log = Path(self._tmp.name) / f"{name}.log"
                self._logs[name] = log
                with open(log, "wb") as output:
                    self._processes[name] = subprocess.Popen(
                        [sys.executable, str(job), json.dumps(config or self.config), str(Path(self._tmp.name) / f"{name}.pt")],
                        env=self.env(rank), stdout=output, stderr=subprocess.STDOUT,
                    )
                return name

        return Ranks(world_size, config)


@pytest.mark.timeout(150)
def test_a_rank_killed_after_its_data_ended_leaves_the_others_exact_under_elastic() -> None:
    counts = [5, 2, 4]
    # Rank 1's data ends after step 1; it joins steps 2 and 3 with empty shards and is killed after step 3.
    with _UnevenElasticRanks.make(3, {"counts": counts, "kill": {"rank": 1, "after_step": 3}}) as ranks:
        outcomes = ranks.results(120)
        logs = ranks.logs()
    expected = union_reference(tied_model(), union_steps(counts, 1), tied_loss)
    for name in ("0", "2"):
        outcome = outcomes.get(name)
        assert outcome is not None and outcome["ok"], f"rank {name}: {outcome}\n{logs}"
        worst, where = worst_difference(outcome["state"], expected)
        assert worst < 1e-5, f"rank {name}: {where} is {worst:g} off the union run"
        (change,) = outcome["membership"]
        assert change[1:] == ((1,), 2, "lost"), change
        assert outcome["steps"] == list(range(5)), outcome["steps"]
    assert "1" not in outcomes  # killed: it saved nothing


@pytest.mark.timeout(150)
def test_a_rank_killed_in_a_syncbatchnorm_forward_leaves_the_others_exact_under_elastic() -> None:
    # Rank 1 dies in its forward of step 2: the others wait for it in the first layer's statistics collective,
    # the membership changes, and step 2 is redone over the 2 survivors with the statistics of the new split.
    steps = 5
    with _UnevenElasticRanks.make(3, {"mode": "syncbn", "steps": steps, "kill": {"rank": 1, "in_step": 2}}) as ranks:
        outcomes = ranks.results(120)
        logs = ranks.logs()
    expected = state_of(full_batch_reference(norm_model(), [[batch] for batch in norm_batches(steps, 12)]))
    for name in ("0", "2"):
        outcome = outcomes.get(name)
        assert outcome is not None and outcome["ok"], f"rank {name}: {outcome}\n{logs}"
        worst, where = worst_difference(outcome["state"], expected)
        assert worst < 1e-5, f"rank {name}: {where} is {worst:g} off the full-batch run"
        (change,) = outcome["membership"]
        assert change[1:] == ((1,), 2, "lost"), change
        assert outcome["steps"] == list(range(steps)), outcome["steps"]

