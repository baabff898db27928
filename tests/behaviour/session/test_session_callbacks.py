"""fit's callbacks: their order between steps and epochs, ``StopTraining``, their exceptions, and fit's history."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import gsync
import gsync.testing
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.tasks import assert_no_tasks_left

pytestmark = pytest.mark.asyncio


EVAL_BATCH = make_batches(1, 8)[0]


def plain_eval_loss(model: nn.Module) -> float:
    """What ``session.evaluate([EVAL_BATCH])`` must give on ``model``: the batch's mean loss, in eval mode."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        return classification_loss(model, EVAL_BATCH).item()


class Recorder:
    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.stop_at = stop_at

    async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        self.calls.append(("step", result.step))
        if self.stop_at == result.step:
            raise gsync.StopTraining

    def on_epoch_end(self, session: gsync.Session, epoch: int) -> None:
        self.calls.append(("epoch", epoch))

    async def on_fit_end(self, session: gsync.Session) -> None:
        # At fit's end the session still holds the trained weights: evaluate sees them.
        metrics = await session.evaluate([EVAL_BATCH])
        self.calls.append(("end", metrics["loss"]))


async def test_callbacks_run_in_order_between_steps() -> None:
    recorder = Recorder()
    result = await gsync.Engine(TWO).fit(
        TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, epochs=2, callbacks=[recorder]
    )
    assert recorder.calls[:-1] == [
        ("step", 0), ("step", 1), ("step", 2), ("epoch", 0),
        ("step", 3), ("step", 4), ("step", 5), ("epoch", 1),
    ]  # fmt: skip
    assert recorder.calls[-1] == ("end", pytest.approx(plain_eval_loss(result.model), abs=1e-5))
    assert [(r.step, r.epoch) for r in result.history] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert [r.loss for r in result.history] == result.losses
    assert all(r.rows == 8 and r.lr == 0.1 and r.seconds > 0 for r in result.history)


async def test_an_epochs_callbacks_run_before_the_next_epoch_is_read() -> None:
    # What a callback changes at an epoch's end (a curriculum, the training set it evaluates on) is what the next
    # epoch reads, as in a plain loop: fit reads one batch ahead, but never into the next epoch.
    events: list[tuple[str, int]] = []
    batches = make_batches(2, 8)

    class Loader:
        def __iter__(self) -> Any:
            events.append(("read", len(events)))
            return iter(batches)

        def __len__(self) -> int:
            return len(batches)

    class Ends:
        def on_epoch_end(self, session: gsync.Session, epoch: int) -> None:
            events.append(("epoch_end", epoch))

    await gsync.Engine(TWO).fit(TiedNet(), Loader(), optimizer=sgd, loss_fn=classification_loss, epochs=3, callbacks=[Ends()])
    assert [name for name, _ in events] == ["read", "epoch_end", "read", "epoch_end", "read", "epoch_end"], events


async def test_stop_training_ends_fit_early_with_the_steps_done(no_leaks: None) -> None:
    recorder = Recorder(stop_at=3)
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 8)
    expected, _ = train_reference(model, batches[:4])
    result = await gsync.Engine(TWO).fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, callbacks=[recorder])
    assert len(result.losses) == 4 and result.checkpoint.step == 3
    assert_same_state(result.model, expected)
    assert recorder.calls[-1] == ("end", pytest.approx(plain_eval_loss(expected), abs=1e-5))


async def test_any_other_callback_exception_propagates_unchanged(no_leaks: None) -> None:
    boom = RuntimeError("callback bug")

    class Failing:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            if result.step == 1:
                raise boom

    with pytest.raises(RuntimeError) as caught:
        await gsync.Engine(TWO).fit(TiedNet(), make_batches(4, 8), optimizer=sgd, loss_fn=classification_loss, callbacks=[Failing()])
    assert caught.value is boom
    assert_no_tasks_left()


async def test_bad_callbacks_and_recipe_arguments_are_refused_up_front() -> None:
    engine = gsync.Engine(TWO)
    args: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss)
    with pytest.raises(gsync.InputTypeError, match="has none of on_step_end"):
        await engine.fit(TiedNet(), make_batches(1, 8), callbacks=[object()], **args)
    with pytest.raises(gsync.ConfigError, match="accumulate must be a positive int"):
        await engine.fit(TiedNet(), make_batches(1, 8), accumulate=0, **args)
    with pytest.raises(gsync.ConfigError, match="clip_grad_norm must be a positive"):
        engine.session(TiedNet(), clip_grad_norm=-1.0, **args)
    with pytest.raises(gsync.ConfigError, match="autocast must be"):
        engine.session(TiedNet(), autocast=torch.float64, **args)
    opt = sgd(list(TiedNet().parameters()))
    with pytest.raises(gsync.InputTypeError, match="scheduler must be a factory"):
        engine.session(TiedNet(), scheduler=torch.optim.lr_scheduler.StepLR(opt, 1), **args)
    # A class is a factory only when the optimizer is all it needs (LinearLR); StepLR needs its step_size.
    with pytest.raises(gsync.InputTypeError, match=r"scheduler=StepLR needs more than the optimizer .*step_size"):
        engine.session(TiedNet(), scheduler=torch.optim.lr_scheduler.StepLR, **args)
