"""What gsync logs through its logger."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gsync
import gsync.testing
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd

pytestmark = pytest.mark.asyncio


async def test_gsync_logs_what_it_does_through_its_logger(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="gsync")

    def nan_at_step_1(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = classification_loss(model, batch)
        return loss * float("nan") if float(batch[0][0, 0]) == 99.0 else loss

    batches = make_batches(3, 8)
    batches[1][0][0, 0] = 99.0
    engine = gsync.Engine(TWO, on_nonfinite="skip")
    await engine.fit(TiedNet(), batches, optimizer=sgd, loss_fn=nan_at_step_1)
    messages = [(record.levelname, record.getMessage()) for record in caplog.records if record.name == "gsync"]
    assert any(level == "INFO" and "session on cpu:0, cpu:1 (rank 0 of 1)" in text for level, text in messages)
    assert any(level == "INFO" and "buckets rebuilt" in text for level, text in messages)
    assert ("WARNING", "gsync: step 1 skipped on every device: a loss was not finite (on_nonfinite='skip')") in messages
