"""LR schedules over a session's optimizers: one that needs a metric, driven from the session as in a plain loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gsync
import gsync.testing
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state

pytestmark = pytest.mark.asyncio


async def test_a_scheduler_that_needs_a_metric_is_refused_with_what_to_do() -> None:
    engine = gsync.Engine(TWO)
    with pytest.raises(gsync.InputTypeError, match="ReduceLROnPlateau"):
        async with engine.session(
            TiedNet(), optimizer=sgd, loss_fn=classification_loss,
            scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
        ):
            pass


async def test_a_plateau_schedule_over_the_sessions_optimizers_matches_a_plain_loop() -> None:
    # What the refusal above says to do instead: a ReduceLROnPlateau over each replica's optimizer, stepped with
    # the validation loss from the loop, as a plain loop steps its one.
    torch.manual_seed(0)
    model = TiedNet()
    batches, validation = make_batches(6, 8), make_batches(2, 8, seed=5)

    def plateau(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10.0)

    reference = copy.deepcopy(model)
    optimizer = sgd(list(reference.parameters()))
    schedule = plateau(optimizer)
    for batch in batches:
        optimizer.zero_grad()
        classification_loss(reference, batch).backward()
        optimizer.step()
        with torch.no_grad():
            schedule.step(sum(float(classification_loss(reference, b)) for b in validation) / len(validation))
    async with gsync.Engine(TWO).session(model, optimizer=sgd, loss_fn=classification_loss) as session:
        schedules = [plateau(optimizer) for optimizer in session.optimizers]
        assert len(schedules) == 2
        for batch in batches:
            await session.step(batch)
            metrics = await session.evaluate(validation)
            for each in schedules:
                each.step(metrics["loss"])
        lrs = {group["lr"] for optimizer in session.optimizers for group in optimizer.param_groups}
    assert lrs == {optimizer.param_groups[0]["lr"]} and lrs != {0.1}
    assert_same_state(model, reference)
    with pytest.raises(gsync.SessionClosed):
        session.optimizers
