"""Checkpoints of a ``shard_optimizer=True`` run across 2 real processes (gloo on loopback): each rank holds its
devices' shards of the optimizer state, and a checkpoint gathers them into the whole state, in the unsharded
format. A sharded 2 x 2 fit writes its files; they resume unsharded in one process, sharded on 2 x 1 processes
and sharded in one process on 3 devices, each ending as the uninterrupted run does (within 1e-5).
``session.checkpoint()`` on both ranks equals the unsharded run's, and a failure's checkpoint, which cannot
gather from a peer that is gone, is left out with a note saying to resume from the last checkpoint file.

One run of the ranks does it all (2 cores in CI); the one-process runs are in the test's own process.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from tests.support.harness import run_ranks
from tests.support.inside import wrap_sharded_gather
from tests.support.models import TINY, TiedNet, adamw, classification_loss, make_batches
from tests.support.reference import state_of, step_lr

STEPS = 6
EVERY = 2  # files after steps 1, 3 and 5
RESUME_AT = 3
ROWS = 19  # uneven over 2, 3 and 4 devices
CLIP = 0.5


def data() -> list[Any]:
    return make_batches(STEPS, ROWS)


def fresh_model() -> nn.Module:
    torch.manual_seed(3)
    return TiedNet()


async def fit(
    devices: list[str], shard: bool, resume: Any = None, checkpoint_dir: Path | None = None, loss_fn: Any = classification_loss
) -> gsync.FitResult:
    engine = gsync.Engine(devices, shard_optimizer=shard, sync_timeout=60, **TINY)
    return await engine.fit(
        fresh_model(), data(), optimizer=adamw, loss_fn=loss_fn, scheduler=step_lr, clip_grad_norm=CLIP,
        checkpoint_dir=checkpoint_dir, checkpoint_every=EVERY if checkpoint_dir is not None else None, keep=3,
        resume=resume, progress=False,
    )


async def session_checkpoint(devices: list[str], shard: bool) -> gsync.Checkpoint:
    """Three steps of a session, then its checkpoint (on every rank)."""
    engine = gsync.Engine(devices, shard_optimizer=shard, sync_timeout=60, **TINY)
    async with engine.session(
        fresh_model(), optimizer=adamw, loss_fn=classification_loss, scheduler=step_lr, clip_grad_norm=CLIP
    ) as session:
        for batch in data()[:3]:
            await session.step(batch)
        return session.checkpoint()


def failing_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Rank 1's training code raises in the step after two have been applied."""
    if os.environ.get("RANK") == "1" and failing_loss.calls >= 2:  # type: ignore[attr-defined]
        raise RuntimeError("rank 1's loss failed on purpose")
    failing_loss.calls += 1  # type: ignore[attr-defined]
    return classification_loss(model, batch)


failing_loss.calls = 0  # type: ignore[attr-defined]


def ranks_checkpoint(directory: str) -> dict[str, Any]:
    """Each rank: a sharded 2 x 2 fit writing files, a sharded 2 x 1 fit resumed from the middle one, a sharded
    session's checkpoint, and a failure."""
    out: dict[str, Any] = {}
    gathered_in: list[str] = []

    def noting_its_thread(gather: Callable[..., Any]) -> Callable[..., Any]:
        def gather_noting_its_thread(*args: Any) -> Any:
            gathered_in.append("the event loop's" if threading.current_thread() is threading.main_thread() else "a worker")
            return gather(*args)

        return gather_noting_its_thread

    wrap_sharded_gather(noting_its_thread)  # the real gather, its thread noted

    async def run() -> None:
        result = await fit(["cpu:0", "cpu:1"], True, checkpoint_dir=Path(directory))
        out["fit"] = (result.checkpoint, result.first_step)
        out["fit_gathered_in"] = list(gathered_in)
        resumed = await fit(["cpu"], True, resume=Path(directory) / f"step-{RESUME_AT:08d}.pt")
        out["resumed"] = (state_of(resumed.model), resumed.first_step)
        out["session"] = await session_checkpoint(["cpu"], True)
        try:
            await fit(["cpu"], True, loss_fn=failing_loss)
            out["failure"] = None
        except gsync.GsyncError as error:
            out["failure"] = (type(error).__name__, error.checkpoint is None, list(getattr(error, "__notes__", [])))

    asyncio.run(run())
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    directory = tmp_path_factory.mktemp("sharded-checkpoints")
    return directory, [rank.value for rank in run_ranks(ranks_checkpoint, 2, args=(str(directory),), timeout=240, check=True)]


@pytest.fixture(scope="module")
def uninterrupted() -> gsync.FitResult:
    """The whole run, unsharded, in one process."""
    return asyncio.run(fit(["cpu:0", "cpu:1"], False))


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{what}, {n}: {m}")


def assert_same_checkpoint(actual: gsync.Checkpoint, expected: gsync.Checkpoint, what: str) -> None:
    """The same step, model, scheduler and optimizer state, in the unsharded format (whole tensors)."""
    assert actual.step == expected.step, what
    assert_same_state(actual.model_state, expected.model_state, what)
    assert actual.scheduler_state == expected.scheduler_state, what
    got, want = actual.optimizer_state, expected.optimizer_state
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for key, values in want["state"].items():
        assert got["state"][key].keys() == values.keys(), (what, key)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                assert got["state"][key][name].shape == value.shape, (what, key, name)
                torch.testing.assert_close(got["state"][key][name], value, atol=1e-5, rtol=0)
            else:
                assert got["state"][key][name] == value, (what, key, name)


@pytest.mark.timeout(300)
def test_a_sharded_fit_across_processes_writes_the_whole_state_in_the_unsharded_format(
    ranks: tuple[Path, list[Any]], uninterrupted: gsync.FitResult
) -> None:
    directory, values = ranks
    assert sorted(path.name for path in directory.glob("step-*.pt")) == [f"step-{s:08d}.pt" for s in (1, 3, 5)]
    for rank, value in enumerate(values):
        checkpoint, first_step = value["fit"]
        assert first_step == 0
        # Every rank gets the whole checkpoint, as the unsharded run's.
        assert_same_checkpoint(checkpoint, uninterrupted.checkpoint, f"rank {rank}'s result")
    assert_same_checkpoint(gsync.Checkpoint.load(directory / f"step-{STEPS - 1:08d}.pt"), uninterrupted.checkpoint, "the last file")


@pytest.mark.timeout(300)
def test_its_files_resume_unsharded_sharded_again_and_on_another_device_count(
    ranks: tuple[Path, list[Any]], uninterrupted: gsync.FitResult
) -> None:
    directory, values = ranks
    expected = state_of(uninterrupted.model)
    middle = directory / f"step-{RESUME_AT:08d}.pt"
    for rank, value in enumerate(values):
        state, first_step = value["resumed"]
        assert first_step == RESUME_AT + 1
        assert_same_state(state, expected, f"resumed sharded on 2 x 1 processes, rank {rank}")
    for devices, shard in ((["cpu:0", "cpu:1"], False), (["cpu:0", "cpu:1", "cpu:2"], True)):
        resumed = asyncio.run(fit(devices, shard, resume=middle))
        assert resumed.first_step == RESUME_AT + 1
        assert_same_state(state_of(resumed.model), expected, f"resumed on {len(devices)} devices, shard_optimizer={shard}")


@pytest.mark.timeout(300)
def test_a_fits_gathers_leave_the_event_loop_free(ranks: tuple[Path, list[Any]]) -> None:
    """Each due file and the fit's last checkpoint are gathered from every rank in a worker thread, while the
    event loop goes on (other tasks of the program run meanwhile)."""
    _directory, outs = ranks
    for rank, out in enumerate(outs):
        # Files after steps 1, 3 and 5, and the checkpoint FitResult carries.
        assert out["fit_gathered_in"] == ["a worker"] * 4, (rank, out["fit_gathered_in"])


@pytest.mark.timeout(300)
def test_session_checkpoint_on_every_rank_is_the_unsharded_runs(ranks: tuple[Path, list[Any]]) -> None:
    _, values = ranks
    expected = asyncio.run(session_checkpoint(["cpu:0", "cpu:1"], False))
    for rank, value in enumerate(values):
        assert_same_checkpoint(value["session"], expected, f"rank {rank}'s session.checkpoint()")


@pytest.mark.timeout(300)
def test_a_failures_checkpoint_is_left_out_with_a_note_to_resume_from_the_last_file(ranks: tuple[Path, list[Any]]) -> None:
    _, values = ranks
    kinds = {rank: value["failure"][0] if value["failure"] else None for rank, value in enumerate(values)}
    assert kinds == {0: "PeerFailed", 1: "WorkerFailed"}, kinds
    for rank, value in enumerate(values):
        _, no_checkpoint, notes = value["failure"]
        assert no_checkpoint, f"rank {rank}'s failure carries a checkpoint"
        assert any("resume from the last checkpoint file" in note for note in notes), (rank, notes)
