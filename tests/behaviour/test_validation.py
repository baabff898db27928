"""Validation inside ``fit`` (``val_data=``, ``eval_every=``) and the best checkpoint kept by a metric (``keep_best=``).

Each evaluation ``fit`` runs is compared with a separate ``session.evaluate`` of a held session stepped by hand
to the same step; the best file with the state of the step whose evaluation was best.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

STEPS = 5
BATCHES = make_batches(STEPS, 16)
VAL = make_batches(2, 10, seed=7)


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return TiedNet()


def accuracy_and_loss(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    logits = model(batch[0])
    return {
        "accuracy": (logits.argmax(dim=1) == batch[1]).float().mean(),
        "loss": torch.nn.functional.cross_entropy(logits, batch[1]),
    }


def loss_as_score(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """The validation loss under another name, kept by its highest value (best_mode="max"): the loss falls
    step after step, so the best is the first evaluation, which a small ``keep`` rotates away."""
    return {"score": classification_loss(model, batch)}


async def evaluations_by_hand(steps: list[int], metric_fn: Any = None, batches: list[Any] = BATCHES) -> dict[int, dict[str, float]]:
    """A held session stepped through ``batches``, evaluated after each of ``steps``, and its state there."""
    found: dict[int, dict[str, float]] = {}
    async with gsync.Engine(TWO).session(fresh(), optimizer=sgd, loss_fn=classification_loss) as session:
        for step, batch in enumerate(batches):
            await session.step(batch)
            if step in steps:
                found[step] = await session.evaluate(VAL, metric_fn=metric_fn)
    return found


async def state_after(step: int) -> dict[str, torch.Tensor]:
    async with gsync.Engine(TWO).session(fresh(), optimizer=sgd, loss_fn=classification_loss) as session:
        for batch in BATCHES[: step + 1]:
            await session.step(batch)
        return {name: value.clone() for name, value in session.model.state_dict().items()}


class Heard:
    """Every hook a fit calls, in order, with what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        self.calls.append(("step", result.step))

    def on_evaluate(self, session: gsync.Session, evaluation: gsync.Evaluation) -> None:
        self.calls.append(("evaluate", evaluation))

    def on_epoch_end(self, session: gsync.Session, epoch: int) -> None:
        self.calls.append(("epoch", epoch))


class Logged:
    def __init__(self) -> None:
        self.metrics: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((dict(metrics), step))


async def test_fit_evaluates_every_eval_every_steps_and_at_the_end_as_a_separate_evaluate_would() -> None:
    heard, logged = Heard(), Logged()
    result = await gsync.Engine(TWO).fit(
        fresh(), BATCHES, optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=2,
        val_metric_fn=accuracy_and_loss, callbacks=[heard], loggers=[logged], progress=False,
    )
    # After steps 1 and 3 (every 2nd), and after step 4, the last, which the schedule does not reach.
    assert [evaluation.step for evaluation in result.evaluations] == [1, 3, 4]
    expected = await evaluations_by_hand([1, 3, 4], accuracy_and_loss)
    for evaluation in result.evaluations:
        assert evaluation.metrics.keys() == {"accuracy", "loss"}
        for name, value in expected[evaluation.step].items():
            assert evaluation.metrics[name] == pytest.approx(value, abs=1e-6), (evaluation.step, name)
        assert not evaluation.best  # no keep_best
    # Callbacks: after the step's on_step_end, before its epoch's end, with the records FitResult has.
    assert heard.calls == [
        ("step", 0), ("step", 1), ("evaluate", result.evaluations[0]), ("step", 2), ("step", 3),
        ("evaluate", result.evaluations[1]), ("step", 4), ("evaluate", result.evaluations[2]), ("epoch", 0),
    ]
    # The loggers get each evaluation once, as eval/<name> at its step.
    evals = [(metrics, step) for metrics, step in logged.metrics if any(name.startswith("eval/") for name in metrics)]
    assert evals == [
        ({f"eval/{name}": value for name, value in evaluation.metrics.items()}, evaluation.step)
        for evaluation in result.evaluations
    ]


async def test_the_last_step_evaluated_by_the_schedule_is_not_evaluated_again_at_the_end() -> None:
    result = await gsync.Engine(TWO).fit(
        fresh(), BATCHES[:4], optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=2, progress=False,
    )
    assert [evaluation.step for evaluation in result.evaluations] == [1, 3]
    # Without eval_every: once, at the end, of the model fit returns.
    result = await gsync.Engine(TWO).fit(
        fresh(), BATCHES[:4], optimizer=sgd, loss_fn=classification_loss, val_data=VAL, progress=False,
    )
    assert [(evaluation.step, evaluation.metrics.keys()) for evaluation in result.evaluations] == [(3, {"loss"})]
    separate = await evaluations_by_hand([3], batches=BATCHES[:4])
    assert result.evaluations[0].metrics["loss"] == pytest.approx(separate[3]["loss"], abs=1e-6)


async def test_keep_best_keeps_the_best_evaluations_checkpoint_which_rotation_never_deletes(tmp_path: Path) -> None:
    result = await gsync.Engine(TWO).fit(
        fresh(), BATCHES, optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=1,
        val_metric_fn=loss_as_score, keep_best="score", best_mode="max",
        checkpoint_dir=tmp_path, checkpoint_every=1, keep=1, progress=False,
    )
    scores = [evaluation.metrics["score"] for evaluation in result.evaluations]
    assert [evaluation.step for evaluation in result.evaluations] == list(range(STEPS))
    best_step = max(range(STEPS), key=lambda i: scores[i])
    assert best_step == 0, scores  # the premise: the best is the first, whose step file keep=1 rotates away
    assert [evaluation.best for evaluation in result.evaluations] == [True, False, False, False, False]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best.json", "best.pt", f"step-{STEPS - 1:08d}.pt"]
    best = gsync.Checkpoint.load(tmp_path / "best.pt")
    assert best.step == 0
    for name, value in (await state_after(0)).items():
        torch.testing.assert_close(best.model_state[name], value, atol=1e-6, rtol=0)
    record = json.loads((tmp_path / "best.json").read_text())
    assert record == {"metric": "score", "mode": "max", "step": 0, "value": scores[0], "metrics": {"score": scores[0]}}
    # The newest file is still what resume=checkpoint_dir takes, never the best.
    resumed = await gsync.Engine(TWO).fit(
        fresh(), BATCHES, optimizer=sgd, loss_fn=classification_loss, resume=tmp_path, epochs=2, progress=False,
    )
    assert resumed.first_step == STEPS


async def test_keep_best_by_the_lowest_loss_holds_the_state_of_that_step(tmp_path: Path) -> None:
    # SGD with momentum at lr 0.1 overshoots: the validation loss is lowest before the end (checked below).
    batches = make_batches(8, 16, seed=3)
    result = await gsync.Engine(TWO).fit(
        fresh(), batches, optimizer=lambda params: torch.optim.SGD(params, lr=0.8, momentum=0.9),
        loss_fn=classification_loss, val_data=VAL, eval_every=1, keep_best="loss",
        checkpoint_dir=tmp_path, checkpoint_every=1, keep=8, progress=False,
    )
    losses = {evaluation.step: evaluation.metrics["loss"] for evaluation in result.evaluations}
    best_step = min(losses, key=losses.__getitem__)
    assert best_step < 7, losses  # the premise: the best is not simply the newest
    best = gsync.Checkpoint.load(tmp_path / "best.pt")
    assert best.step == best_step
    # best.pt is that step's checkpoint: the same state as its step file.
    that_step = gsync.Checkpoint.load(tmp_path / f"step-{best_step:08d}.pt")
    for name, value in that_step.model_state.items():
        assert torch.equal(best.model_state[name], value), name
    flagged = [evaluation.step for evaluation in result.evaluations if evaluation.best]
    assert flagged[-1] == best_step and flagged == sorted(flagged)


class StopWhenWorse:
    """Early stopping on the validation loss: the first evaluation that does not improve ends the fit."""

    def __init__(self) -> None:
        self.lowest = float("inf")

    def on_evaluate(self, session: gsync.Session, evaluation: gsync.Evaluation) -> None:
        if evaluation.metrics["loss"] >= self.lowest:
            raise gsync.StopTraining
        self.lowest = evaluation.metrics["loss"]


async def test_stop_training_from_on_evaluate_ends_the_fit_without_another_evaluation(tmp_path: Path) -> None:
    batches = make_batches(12, 16, seed=3)
    result = await gsync.Engine(TWO).fit(
        fresh(), batches, optimizer=lambda params: torch.optim.SGD(params, lr=0.8, momentum=0.9),
        loss_fn=classification_loss, val_data=VAL, eval_every=1, keep_best="loss", callbacks=[StopWhenWorse()],
        checkpoint_dir=tmp_path, progress=False,
    )
    losses = [evaluation.metrics["loss"] for evaluation in result.evaluations]
    assert len(result.history) < 12, losses  # it stopped early
    assert [evaluation.step for evaluation in result.evaluations] == [record.step for record in result.history]
    assert losses[-1] >= min(losses[:-1])
    assert gsync.Checkpoint.load(tmp_path / "best.pt").step == losses.index(min(losses))


async def test_a_resumed_fit_continues_the_schedule_and_the_best_so_far(tmp_path: Path) -> None:
    common: dict[str, Any] = dict(
        optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=2, val_metric_fn=loss_as_score,
        keep_best="score", best_mode="max", checkpoint_dir=tmp_path, checkpoint_every=1, keep=2, progress=False,
    )
    uninterrupted = await gsync.Engine(TWO).fit(fresh(), BATCHES, **{**common, "checkpoint_dir": tmp_path / "other"})
    first = await gsync.Engine(TWO).fit(fresh(), BATCHES[:3], **common)
    assert [evaluation.step for evaluation in first.evaluations] == [1, 2]  # step 2: the end of this fit
    resumed = await gsync.Engine(TWO).fit(fresh(), BATCHES, resume=tmp_path, **common)
    assert resumed.first_step == 3
    # By the global step: after step 3, and after step 4 (the end), as the uninterrupted run did.
    assert [evaluation.step for evaluation in resumed.evaluations] == [3, 4]
    assert [evaluation.step for evaluation in uninterrupted.evaluations] == [1, 3, 4]
    for got, want in zip(resumed.evaluations, uninterrupted.evaluations[1:], strict=True):
        assert got.metrics["score"] == pytest.approx(want.metrics["score"], abs=1e-6)
    # The best of the first run (step 1, the highest score) is not replaced by the resumed run's first evaluation.
    assert [evaluation.best for evaluation in resumed.evaluations] == [False, False]
    assert gsync.Checkpoint.load(tmp_path / "best.pt").step == 1


async def test_a_second_fit_of_a_held_session_continues_the_schedule() -> None:
    async with gsync.Engine(TWO).session(fresh(), optimizer=sgd, loss_fn=classification_loss) as session:
        first = await session.fit(BATCHES[:3], val_data=VAL, eval_every=2, progress=False)
        second = await session.fit(BATCHES[3:], val_data=VAL, eval_every=2, progress=False)
    assert [evaluation.step for evaluation in first.evaluations] == [1, 2]
    assert [evaluation.step for evaluation in second.evaluations] == [3, 4]


def never_called(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("training started")


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        ({"eval_every": 2}, gsync.ConfigError, "eval_every need(s) val_data"),
        ({"keep_best": "loss", "checkpoint_dir": "run"}, gsync.ConfigError, "keep_best need(s) val_data"),
        ({"val_data": VAL, "keep_best": "loss"}, gsync.ConfigError, "needs checkpoint_dir"),
        ({"val_data": VAL, "eval_every": 0}, gsync.ConfigError, "eval_every must be a positive number"),
        ({"val_data": VAL, "eval_every": True}, gsync.ConfigError, "eval_every must be a positive number"),
        ({"val_data": 5}, gsync.InputTypeError, "val_data: data must be an iterable"),
        ({"val_data": iter(VAL)}, gsync.ConfigError, "pass a re-iterable"),
        ({"val_data": []}, gsync.ConfigError, "val_data has no batch"),
        ({"val_data": VAL[0]}, gsync.InputTypeError, "val_data is a tuple of 2 tensors"),
        ({"val_data": VAL, "val_metric_fn": "accuracy"}, gsync.InputTypeError, "val_metric_fn must be callable"),
        ({"val_data": VAL, "keep_best": "accuracy", "checkpoint_dir": "run"}, gsync.ConfigError, "returns 'loss' only"),
        ({"val_data": VAL, "keep_best": 1, "checkpoint_dir": "run"}, gsync.InputTypeError, "keep_best must be the name"),
        ({"val_data": VAL, "keep_best": "loss", "best_mode": "lowest", "checkpoint_dir": "run"}, gsync.ConfigError, "best_mode must be"),
        ({"val_data": VAL, "best_mode": "max"}, gsync.ConfigError, "without keep_best does nothing"),
    ],
)
async def test_bad_validation_arguments_are_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict[str, Any], error: type[Exception], says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        await gsync.Engine(TWO).fit(fresh(), BATCHES, optimizer=sgd, loss_fn=never_called, progress=False, **arguments)
    assert says in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # no checkpoint_dir made
    async with gsync.Engine(TWO).session(fresh(), optimizer=sgd, loss_fn=classification_loss) as session:
        with pytest.raises(error):
            await session.fit(BATCHES, progress=False, **arguments)
        assert session.next_step == 0  # refused before a step, and the session is still open
        await session.step(BATCHES[0])


async def test_a_keep_best_metric_the_evaluation_never_returns_is_a_config_error_at_the_first_evaluation(tmp_path: Path) -> None:
    model = fresh()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(gsync.ConfigError, match=r"keep_best='acc', but the evaluation after step 1 returned \['accuracy', 'loss'\]"):
        await gsync.Engine(TWO).fit(
            model, BATCHES, optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=2,
            val_metric_fn=accuracy_and_loss, keep_best="acc", checkpoint_dir=tmp_path, progress=False,
        )
    assert not (tmp_path / "best.pt").exists()
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value)  # the failed fit left the model as it was


class StopAfterStep1:
    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        if result.step == 1:
            raise gsync.StopTraining


async def test_a_fit_stopped_from_on_step_end_is_evaluated_at_its_end() -> None:
    result = await gsync.Engine(TWO).fit(
        fresh(), BATCHES, optimizer=sgd, loss_fn=classification_loss, val_data=VAL, eval_every=3,
        callbacks=[StopAfterStep1()], progress=False,
    )
    assert [evaluation.step for evaluation in result.evaluations] == [1]
    separate = await evaluations_by_hand([1])
    assert result.evaluations[0].metrics["loss"] == pytest.approx(separate[1]["loss"], abs=1e-6)
