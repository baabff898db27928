"""uneven="join" in one process: the argument's checks, and step(None) (the multi-process runs are in tests/multiproc)."""

from __future__ import annotations

import pytest
import torch

import gsync
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

pytestmark = pytest.mark.asyncio


async def test_join_needs_process_local_data_and_is_refused_before_any_work() -> None:
    engine = gsync.Engine(["cpu"])
    with pytest.raises(gsync.ConfigError, match="process_local_data=True"):
        await engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss, uneven="join")
    with pytest.raises(gsync.ConfigError, match="process_local_data=True"):
        engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss, uneven="join")
    with pytest.raises(gsync.ConfigError, match="'refuse' or 'join'"):
        await engine.fit(
            TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss, process_local_data=True,
            uneven="pad",  # type: ignore[arg-type]
        )


async def test_step_none_without_join_names_the_option(no_leaks: None) -> None:
    async with gsync.Engine(["cpu:0", "cpu:1"]).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        with pytest.raises(gsync.ConfigError, match="uneven='join'"):
            await session.step(None)
        # Refused before anything was dispatched: the session goes on.
        result = await session.step(make_batches(1, 8)[0])
    assert result.step == 0


async def test_in_one_process_a_joined_step_without_batches_trains_nothing(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(3, 9)
    expected, _ = train_reference(model, batches)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    async with engine.session(model, optimizer=sgd, loss_fn=classification_loss, process_local_data=True, uneven="join") as session:
        for batch in batches:
            await session.step(batch)
        ended = await session.step(None)
        assert ended.rows == 0 and ended.step == 3 and session.next_step == 3
        # One position without a batch anywhere is left out of an accumulated step.
        await session.step(None, None)
        assert session.next_step == 3
    assert_same_state(model, expected)


async def test_a_joined_fit_in_one_process_equals_the_plain_fit(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(4, 7)
    expected, expected_losses = train_reference(model, batches)
    result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        model, batches, optimizer=sgd, loss_fn=classification_loss, process_local_data=True, uneven="join"
    )
    assert_same_state(model, expected)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected_losses), atol=2e-5, rtol=0)
