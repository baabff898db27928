"""An engine's one ``Trace`` object shared by its sessions: a session whose start failed before anything was built
records nothing on it, even after another session described it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gsync
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_start_that_failed_before_anything_was_built_leaves_a_shared_trace_as_it_was() -> None:
    trace = gsync.Trace()
    engine = gsync.Engine(TWO, trace=trace)
    session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
    await session.step(make_batches(1, 31)[0])
    await session.aclose()
    outcome, events = trace.outcome, len(trace.events)
    assert outcome == "ok" and events > 0

    frozen = nn.Linear(4, 2)
    frozen.requires_grad_(False)
    with pytest.raises(gsync.ConfigError):
        await engine.session(frozen, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss_fn=classification_loss)
    assert (trace.outcome, len(trace.events)) == (outcome, events)
