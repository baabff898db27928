"""Checkpoints on disk: atomic saves, safe loads, clear errors, and exact resume from a file."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import gsync
from conftest import TiedNet, assert_same_state, classification_loss, make_batches, sgd
from test_recipes import step_lr

pytestmark = pytest.mark.asyncio


async def _trained_checkpoint(steps: int = 3) -> tuple[TiedNet, gsync.Checkpoint]:
    torch.manual_seed(0)
    model = TiedNet()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    async with engine.session(copy.deepcopy(model), optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr, autocast=torch.float16) as session:
        for batch in make_batches(steps, 16):
            await session.step(batch)
        return model, session.checkpoint()


async def test_a_saved_checkpoint_loads_back_equal(tmp_path: Path) -> None:
    _, checkpoint = await _trained_checkpoint()
    path = checkpoint.save(tmp_path / "run" / "step2.pt")
    assert path.exists() and os.listdir(path.parent) == ["step2.pt"]  # no temporary file left behind
    loaded = gsync.Checkpoint.load(path)
    assert loaded.step == checkpoint.step == 2
    for name, value in checkpoint.model_state.items():
        assert torch.equal(loaded.model_state[name], value)
    assert loaded.scheduler_state == checkpoint.scheduler_state
    assert loaded.scaler_state == checkpoint.scaler_state
    assert loaded.optimizer_state["param_groups"] == checkpoint.optimizer_state["param_groups"]


async def test_resuming_from_a_file_equals_never_stopping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 16)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    straight = await engine.fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr)
    first = await engine.fit(copy.deepcopy(model), batches[:3], optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr)
    first.checkpoint.save(tmp_path / "ckpt.pt")
    resumed = await engine.fit(
        copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr,
        resume=gsync.Checkpoint.load(tmp_path / "ckpt.pt"),
    )
    assert resumed.first_step == 3
    assert_same_state(resumed.model, straight.model, atol=0)
    assert resumed.losses == straight.losses[3:]


async def test_a_failed_save_leaves_the_previous_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, checkpoint = await _trained_checkpoint(1)
    path = checkpoint.save(tmp_path / "ckpt.pt")
    before = path.read_bytes()

    def crash_midway(payload: Any, file: Any) -> None:
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo this must never run",))


@pytest.mark.parametrize("kind", ["missing", "truncated", "garbage", "foreign", "code", "newer"])
async def test_an_unusable_file_gets_a_checkpoint_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.pt"
    if kind != "missing":
        _, checkpoint = await _trained_checkpoint(1)
        checkpoint.save(path)
        whole = path.read_bytes()
        if kind == "truncated":
            path.write_bytes(whole[: len(whole) // 2])
        elif kind == "garbage":
            path.write_bytes(b"\x00\x01not a checkpoint" * 10)
        elif kind == "foreign":
            torch.save({"weights": torch.ones(2)}, path)
        elif kind == "code":
            path.write_bytes(pickle.dumps(_Payload(), protocol=2))
        elif kind == "newer":
            torch.save({"format": "gsync-checkpoint", "version": 99}, path)
    with pytest.raises(gsync.CheckpointError) as caught:
        gsync.Checkpoint.load(path)
    assert str(path) in str(caught.value)


async def test_a_checkpoint_of_another_model_is_refused_before_any_work() -> None:
    _, checkpoint = await _trained_checkpoint(1)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with pytest.raises(gsync.ConfigError, match="'embed.weight' has shape \\(24, 12\\), the model's \\(25, 12\\)"):
        await engine.fit(TiedNet(hidden=25), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss, resume=checkpoint)
    with pytest.raises(gsync.ConfigError, match="has no 'extra.weight'"):

        class Wider(TiedNet):
            def __init__(self) -> None:
                super().__init__()
                self.extra = torch.nn.Linear(2, 2)

        engine.session(Wider(), optimizer=sgd, loss_fn=classification_loss, resume=checkpoint)
