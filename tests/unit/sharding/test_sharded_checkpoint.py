"""The exchange of a sharded checkpoint across processes, alone: 2 ranks as threads over a gloo group in this
process (the host group an NCCL run gathers on), with chunks small enough to cut values and ranks' parts.

The whole path (real processes, real optimizers, files and resumes) is
``tests/multiproc/test_sharded_checkpoint_multiprocess.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gsync._core.sharding import checkpoint as sharded_checkpoint
from tests.support.rank_threads import in_rank_threads
from gsync.errors import CheckpointError

SHAPES = [torch.Size([4, 3]), torch.Size([5]), torch.Size([2])]
# Rank 0 holds elements [0, 7) of parameter 0 and [0, 2) of parameter 1, rank 1 the rest; parameter 2 has no state.
RANGES = [[(0, 7), (0, 2)], [(7, 12), (2, 5)]]


def whole_values() -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return {
        key: {
            "exp_avg": torch.randn(shape, generator=generator),
            "exp_avg_sq": torch.randn(shape, generator=generator, dtype=torch.float64),
        }
        for key, shape in enumerate(SHAPES[:2])
    }


def described(rank: int, whole: dict[int, dict[str, torch.Tensor]]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What a rank holding ``RANGES[rank]`` describes, and its flat buffers, as ``_local_parts`` makes them."""
    parts: list[dict[str, Any] | None] = []
    flats: dict[str, list[torch.Tensor]] = {}
    for key, (start, stop) in enumerate(RANGES[rank]):
        tensors = []
        for name in ("exp_avg", "exp_avg_sq"):
            value = whole[key][name].reshape(-1)[start:stop]
            dtype = str(value.dtype).removeprefix("torch.")
            tensors.append([name, dtype])
            flats.setdefault(dtype, []).append(value)
        step = torch.tensor(3.0)
        parts.append({"start": start, "stop": stop, "tensors": tensors, "values": {"step": step}, "order": ["step", "exp_avg", "exp_avg_sq"]})
    parts.append(None)
    return {"problem": None, "parts": parts}, {dtype: torch.cat(values) for dtype, values in flats.items()}


def in_ranks(job: Callable[[Any], Any]) -> list[Any]:
    """``job(runtime)`` on 2 ranks, each a thread with its own view of one gloo group; each result or error."""
    store = dist.HashStore()

    def run(rank: int) -> Any:
        group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))
        membership = SimpleNamespace(rank=rank, world_size=2, abort=threading.Event(), group=None)
        return job(SimpleNamespace(host=group, membership=membership))

    return in_rank_threads(run)


@pytest.mark.timeout(60)
def test_two_ranks_parts_make_the_whole_state_across_chunk_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_checkpoint, "_CHUNK_BYTES", 12)  # 3 float32 or 1 float64 per rank and gather
    whole = whole_values()
    calls: list[int] = []

    def exchange(runtime: Any) -> dict[int, dict[str, Any]]:
        mine, flats = described(runtime.membership.rank, whole)
        return sharded_checkpoint._exchange(runtime, mine, flats, SHAPES, lambda: calls.append(1))

    results = in_ranks(exchange)
    for rank, gathered in enumerate(results):
        assert not isinstance(gathered, BaseException), (rank, gathered)
        assert sorted(gathered) == [0, 1], "parameter 2 has no state anywhere"
        for key, values in whole.items():
            assert list(gathered[key]) == ["step", "exp_avg", "exp_avg_sq"]
            assert torch.equal(gathered[key]["step"], torch.tensor(3.0))
            for name, value in values.items():
                assert gathered[key][name].dtype == value.dtype and torch.equal(gathered[key][name], value), (rank, key, name)
    # The descriptions, then 3 chunks of float32 (the longest rank holds 9) and 9 of float64, on each rank.
    assert len(calls) == 2 * (1 + 3 + 9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flaw", ["gap", "names", "problem"])
def test_states_that_do_not_make_a_whole_one_are_refused_on_every_rank(flaw: str) -> None:
    whole = whole_values()

    def exchange(runtime: Any) -> dict[int, dict[str, Any]]:
        rank = runtime.membership.rank
        mine, flats = described(rank, whole)
        if rank == 1 and flaw == "gap":
            mine["parts"][0]["start"] = 8
        if rank == 1 and flaw == "names":
            mine["parts"][1]["tensors"] = mine["parts"][1]["tensors"][:1]
        if rank == 1 and flaw == "problem":
            mine = {"problem": "parameter 0's optimizer state exists on some of its devices' shards only", "parts": []}
        return sharded_checkpoint._exchange(runtime, mine, flats, SHAPES, lambda: None)

    results = in_ranks(exchange)
    expected = {"gap": "not whole across the ranks", "names": "every rank must build the same optimizer", "problem": "rank 1 cannot"}
    for rank, error in enumerate(results):
        assert isinstance(error, CheckpointError), (rank, error)
        assert expected[flaw] in str(error), (rank, str(error))
