"""Checkpoints on disk: atomic saves, safe loads, clear errors, and exact resume from a file."""

from __future__ import annotations

import copy
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import gsync
import gsync.testing
from tests.support.gates import CancelAfterStep
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state
from tests.support.reference import step_lr

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
    # Readable as any file the user's process creates (0644 under the usual umask), not private as a temp file.
    created = tmp_path / "created by open()"
    created.write_bytes(b"")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(created.stat().st_mode)
    loaded = gsync.Checkpoint.load(path)
    assert loaded.step == checkpoint.step == 2
    for name, value in checkpoint.model_state.items():
        assert torch.equal(loaded.model_state[name], value)
    assert loaded.scheduler_state == checkpoint.scheduler_state
    assert loaded.scaler_state == checkpoint.scaler_state
    assert loaded.optimizer_state["param_groups"] == checkpoint.optimizer_state["param_groups"]


async def test_a_checkpoints_repr_says_what_it_is_in_a_line() -> None:
    # Printed whole, a 200-parameter model's state ran to 18 KB; the repr says its step, sizes and devices.
    model, checkpoint = await _trained_checkpoint()
    shown = repr(checkpoint)
    values = sum(tensor.numel() for tensor in model.state_dict().values())
    assert shown.startswith(f"Checkpoint(step=2, model_state=<{len(model.state_dict())} tensors, {values:,} values, ")
    assert " on cpu>, optimizer_state=<" in shown and "scheduler_state=" in shown and "scaler_state=" in shown
    assert len(shown) < 400 and "\n" not in shown, shown


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


async def test_fit_writes_checkpoints_every_n_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        TiedNet(), make_batches(7, 8), optimizer=sgd, loss_fn=classification_loss,
        checkpoint_dir=tmp_path, checkpoint_every=2, keep=2,
    )
    assert sorted(os.listdir(tmp_path)) == ["step-00000005.pt", "step-00000006.pt"]  # steps 1, 3, 5 and the end
    final = gsync.Checkpoint.load(tmp_path / "step-00000006.pt")
    for name, value in result.checkpoint.model_state.items():
        assert torch.equal(final.model_state[name], value)


async def test_the_same_command_line_starts_fresh_and_resumes_after_a_crash(tmp_path: Path, no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(8, 16)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    straight = await engine.fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr)

    async def run() -> gsync.FitResult:
        return await engine.fit(
            copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr,
            checkpoint_dir=tmp_path / "ckpt", checkpoint_every=3, resume=tmp_path / "ckpt",
        )

    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=6, site="forward")):
        with pytest.raises(gsync.WorkerFailed):
            await run()  # the first run: no checkpoint yet, so it starts fresh and dies at step 6
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-00000002.pt", "step-00000005.pt"]
    resumed = await run()  # the restart: same call, resumes after step 5
    assert resumed.first_step == 6
    assert_same_state(resumed.model, straight.model, atol=0)
    assert resumed.losses == straight.losses[6:]


async def test_a_checkpoint_dir_named_with_a_dot_starts_fresh_then_resumes(tmp_path: Path) -> None:
    directory = tmp_path / "exp_lr0.01"  # not there yet, and it has a "suffix": still the directory of the run

    async def run(batches: int) -> gsync.FitResult:
        return await gsync.Engine(["cpu"]).fit(TiedNet(), make_batches(batches, 8), optimizer=sgd,
                                               loss_fn=classification_loss, checkpoint_dir=directory, resume=directory)

    assert (await run(2)).first_step == 0
    assert (await run(4)).first_step == 2


async def test_keep_never_deletes_what_it_just_wrote_for_a_higher_numbered_file(tmp_path: Path) -> None:
    # A newer file that does not load is skipped by resume; counting it in keep would delete the run's new files.
    (tmp_path / "step-00000099.pt").write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="skipping an unreadable checkpoint"):
        await gsync.Engine(["cpu"]).fit(TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss,
                                        checkpoint_dir=tmp_path, checkpoint_every=1, keep=1, resume=tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002.pt", "step-00000099.pt"]
    assert gsync.Checkpoint.load(tmp_path / "step-00000002.pt").step == 2


async def test_resuming_with_other_trainable_parameters_is_a_config_error() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    engine = gsync.Engine(["cpu"])
    result = await engine.fit(model, make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)
    next(model.parameters()).requires_grad_(False)  # frozen since: the optimizer has one parameter fewer
    with pytest.raises(gsync.ConfigError, match="optimizer state .* does not fit this optimizer"):
        await engine.fit(model, make_batches(4, 8), optimizer=sgd, loss_fn=classification_loss, resume=result.checkpoint)


async def test_an_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path: Path) -> None:
    _, older = await _trained_checkpoint(2)
    older.save(tmp_path / "step-00000001.pt")
    (tmp_path / "step-00000009.pt").write_bytes(b"torn by a crash")
    with pytest.warns(UserWarning, match="skipping an unreadable checkpoint"):
        engine = gsync.Engine(["cpu:0", "cpu:1"])
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss, resume=tmp_path) as session:
            assert session.next_step == 2


async def test_bad_checkpoint_settings_are_refused(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    args: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss)
    with pytest.raises(gsync.ConfigError, match="checkpoint_every needs checkpoint_dir"):
        await engine.fit(TiedNet(), make_batches(1, 8), checkpoint_every=5, **args)
    with pytest.raises(gsync.ConfigError, match="keep must be a positive"):
        await engine.fit(TiedNet(), make_batches(1, 8), checkpoint_dir=tmp_path, keep=0, **args)
    with pytest.raises(gsync.InputTypeError, match="resume must be"):
        await engine.fit(TiedNet(), make_batches(1, 8), resume=3, **args)  # type: ignore[arg-type]


class DropoutNet(torch.nn.Module):
    """Draws from torch's generator in forward; its loss draws from Python's and NumPy's too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def noisy_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    import random

    import numpy as np

    return classification_loss(model, batch) * (1.0 + 1e-3 * random.random() + 1e-3 * float(np.random.rand()))


async def test_a_resumed_fit_draws_the_same_random_numbers_as_the_run_it_continues(tmp_path: Path) -> None:
    import random

    import numpy as np

    def seed_everything(seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    batches = make_batches(6, 16)
    engine = gsync.Engine(["cpu"])
    seed_everything(0)
    model = DropoutNet()
    args: dict[str, Any] = {"optimizer": sgd, "loss_fn": noisy_loss}
    seed_everything(1)
    straight = await engine.fit(copy.deepcopy(model), batches, **args)
    seed_everything(1)
    await engine.fit(copy.deepcopy(model), batches[:3], checkpoint_dir=tmp_path, **args)
    seed_everything(99)  # a fresh process starts from other generator states
    resumed = await engine.fit(copy.deepcopy(model), batches, resume=tmp_path, **args)
    assert resumed.first_step == 3
    assert resumed.losses == straight.losses[3:]
    assert_same_state(resumed.model, straight.model, atol=0)


class DrawsInItsCallbacks:
    """A callback that draws from the global generator (sampling a log line, say) after a step and an epoch."""

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        torch.rand(3)

    def on_epoch_end(self, session: gsync.Session, epoch: int) -> None:
        torch.rand(3)


@pytest.mark.parametrize("data", ["list", "loader"])
async def test_a_checkpoint_written_during_a_fit_keeps_the_generators_its_callbacks_leave(tmp_path: Path, data: str) -> None:
    # The next step starts from the generators as the step's callbacks leave them: so must a run resumed there. A
    # DataLoader draws a seed from the global generator as each epoch begins, after the last epoch's checkpoint.
    batches: Any = make_batches(3, 16)
    if data == "loader":
        rows = torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        batches = torch.utils.data.DataLoader(rows, batch_size=16)
    engine = gsync.Engine(["cpu"])
    torch.manual_seed(0)
    model = DropoutNet()
    args: dict[str, Any] = {"optimizer": sgd, "loss_fn": classification_loss, "epochs": 2,
                            "callbacks": [DrawsInItsCallbacks()]}
    torch.manual_seed(1)
    straight = await engine.fit(
        copy.deepcopy(model), batches, checkpoint_dir=tmp_path, checkpoint_every=1, keep=6, **args
    )
    for after_step in (1, 2):  # within an epoch, and at its end (after its on_epoch_end too)
        torch.manual_seed(99)
        resumed = await engine.fit(copy.deepcopy(model), batches, resume=tmp_path / f"step-{after_step:08d}.pt", **args)
        assert resumed.first_step == after_step + 1
        assert resumed.losses == straight.losses[after_step + 1 :]
        assert_same_state(resumed.model, straight.model, atol=0)


class CancelsDuringAnEvaluation:
    """Cancels the fit while awaiting an evaluation in on_step_end, as a notebook interrupt there would."""

    def __init__(self, scope: anyio.CancelScope, step: int) -> None:
        self.scope, self.step = scope, step

    async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        if result.step == self.step:
            self.scope.cancel()
            await session.evaluate(make_batches(1, 8))


@pytest.mark.parametrize("callback", [CancelAfterStep, CancelsDuringAnEvaluation])
async def test_a_fit_cancelled_in_a_steps_callback_still_writes_that_steps_due_file(
    tmp_path: Path, callback: Any
) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with anyio.CancelScope() as scope:
        await engine.fit(TiedNet(), make_batches(4, 8), optimizer=sgd, loss_fn=classification_loss,
                         checkpoint_dir=tmp_path, checkpoint_every=1, keep=5, callbacks=[callback(scope, 1)])
    assert scope.cancelled_caught
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000000.pt", "step-00000001.pt"]
    assert gsync.Checkpoint.load(tmp_path / "step-00000001.pt").step == 1


async def test_the_final_checkpoint_keeps_the_generators_as_they_were_before_on_fit_end(tmp_path: Path) -> None:
    # A run that continues from it would not have called on_fit_end there: what on_fit_end draws is not in it.
    before_on_fit_end: list[torch.Tensor] = []

    class DrawsAtTheEnd:
        def on_fit_end(self, session: gsync.Session) -> None:
            before_on_fit_end.append(torch.get_rng_state())
            torch.rand(3)

    result = await gsync.Engine(["cpu"]).fit(TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss,
                                             checkpoint_dir=tmp_path, callbacks=[DrawsAtTheEnd()])
    saved = gsync.Checkpoint.load(tmp_path / "step-00000002.pt")
    for checkpoint in (result.checkpoint, saved):
        assert checkpoint.rng_state is not None and torch.equal(checkpoint.rng_state["torch"], before_on_fit_end[0])


async def test_a_callback_that_fails_after_a_step_leaves_that_steps_checkpoint_written(tmp_path: Path) -> None:
    class FailsAfterStep1:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            if result.step == 1:
                raise ValueError("the callback's own bug")

    engine = gsync.Engine(["cpu"])
    with pytest.raises(ValueError, match="the callback's own bug"):
        await engine.fit(TiedNet(), make_batches(4, 8), optimizer=sgd, loss_fn=classification_loss,
                         checkpoint_dir=tmp_path, checkpoint_every=1, keep=5, callbacks=[FailsAfterStep1()])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000000.pt", "step-00000001.pt"]
    assert gsync.Checkpoint.load(tmp_path / "step-00000001.pt").step == 1


async def test_a_checkpoint_file_keeps_the_generators_and_the_data_position(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu"])
    result = await engine.fit(TiedNet(), make_batches(3, 8), epochs=2, optimizer=sgd, loss_fn=classification_loss)
    assert result.checkpoint.data_position == (1, 3)
    loaded = gsync.Checkpoint.load(result.checkpoint.save(tmp_path / "end.pt"))
    assert loaded.data_position == (1, 3)
    assert loaded.rng_state is not None and torch.equal(loaded.rng_state["torch"], result.checkpoint.rng_state["torch"])
    # A failure's checkpoint is taken mid-step: no generator state to restore.
    with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=2, site="backward")):
        with pytest.raises(gsync.WorkerFailed) as caught:
            await engine.fit(TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss)
    assert caught.value.checkpoint.step == 1 and caught.value.checkpoint.rng_state is None


async def test_resuming_with_data_that_does_not_line_up_is_refused(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu"])
    args: dict[str, Any] = {"optimizer": sgd, "loss_fn": classification_loss}
    await engine.fit(TiedNet(), make_batches(3, 8), checkpoint_dir=tmp_path, **args)
    with pytest.raises(gsync.ConfigError, match=r"does not line up with the checkpoint: through step 2 it had consumed 3 batch"):
        await engine.fit(TiedNet(), make_batches(8, 8), accumulate=2, resume=tmp_path, **args)


async def test_a_session_resumed_from_its_checkpoint_continues_the_same_random_draws() -> None:
    batches = make_batches(6, 16)
    engine = gsync.Engine(["cpu"])
    torch.manual_seed(0)
    model = DropoutNet()
    args: dict[str, Any] = {"optimizer": sgd, "loss_fn": noisy_loss}
    straight_model, resumed_model = copy.deepcopy(model), copy.deepcopy(model)
    async with engine.session(straight_model, **args) as session:
        for batch in batches[:3]:
            await session.step(batch)
        checkpoint = session.checkpoint()
        straight = [(await session.step(batch)).loss for batch in batches[3:]]
    torch.manual_seed(99)  # as in a new process
    async with engine.session(resumed_model, resume=checkpoint, **args) as session:
        resumed = [(await session.step(batch)).loss for batch in batches[3:]]
    assert resumed == straight
    assert_same_state(resumed_model, straight_model, atol=0)



async def test_a_missing_resume_path_beside_a_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    # resume="runs" beside checkpoint_dir="run" is a typo: starting afresh would write over the run's own files.
    args: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss, checkpoint_dir=tmp_path / "run")
    with pytest.raises(gsync.CheckpointError, match="runs' does not exist, and it is not checkpoint_dir"):
        await gsync.Engine(["cpu"]).fit(TiedNet(), make_batches(2, 8), resume=tmp_path / "runs", **args)
    assert not (tmp_path / "run").exists()


async def test_a_session_resuming_from_a_directory_not_made_yet_starts_afresh_and_says_so(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu"])
    with pytest.warns(UserWarning, match="no such directory yet, so training starts from scratch"):
        opening = engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss, resume=tmp_path / "run")
    async with opening as session:
        assert session.first_step == 0
        await session.step(make_batches(1, 8)[0])
