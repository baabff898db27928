"""gsync under trio, anyio's other backend: its threads reach a trio loop through the loop bridge's trio branch."""

from __future__ import annotations

import anyio
import pytest
import torch

import gsync
import gsync.testing
from tests.support.models import Deep, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

pytestmark = pytest.mark.timeout(120)


def test_fit_session_evaluate_and_cancellation_under_trio(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = Deep()
    batches = make_batches(steps=4, rows=32)
    expected_model, expected_losses = train_reference(model, batches + batches[:1])
    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.001, bucket_cap_mb=0.01)
    seen: dict[str, object] = {}

    async def main() -> None:
        result = await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, progress=False)
        seen["buckets"] = result.stats.buckets
        seen["fit_losses"] = result.losses
        async with engine.session(model, optimizer=sgd, loss_fn=classification_loss, resume=result.checkpoint) as session:
            seen["step_loss"] = (await session.step(batches[0])).loss
            seen["evaluate"] = await session.evaluate(batches[:2])
        with anyio.move_on_after(0.2) as scope:
            await engine.fit(model, batches * 500, optimizer=sgd, loss_fn=classification_loss, progress=False)
        seen["cancelled"] = scope.cancelled_caught

    anyio.run(main, backend="trio")

    assert isinstance(seen["buckets"], int) and seen["buckets"] > 1
    torch.testing.assert_close(
        torch.tensor([*seen["fit_losses"], seen["step_loss"]]), torch.tensor(expected_losses), atol=2e-5, rtol=0  # type: ignore[misc]
    )
    assert set(seen["evaluate"]) == {"loss"}  # type: ignore[arg-type]
    assert seen["cancelled"] is True
    # The cancelled fit left the model as it was after the session, which continued the fit by one step.
    assert_same_state(model, expected_model)


@pytest.mark.parametrize(("site", "what"), [("backward", "gradient sync"), ("optimizer", "optimizer step")])
def test_a_stalled_device_times_out_under_trio_naming_it(site: str, what: str, no_leaks: None) -> None:
    # A step's sync deadline and an optimizer step's are timers on the loop; under trio each is a system task.
    engine = gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=0.3, device_threads="per_device")
    fault = gsync.testing.stall(device=1, step=1, site=site)  # type: ignore[arg-type]
    caught: list[gsync.SyncTimeout] = []

    async def main() -> None:
        with gsync.testing.inject(engine, fault):
            try:
                await engine.fit(Deep(), make_batches(steps=4, rows=8), optimizer=sgd, loss_fn=classification_loss,
                                 progress=False)
            except gsync.SyncTimeout as error:
                caught.append(error)

    anyio.run(main, backend="trio")

    assert len(caught) == 1 and caught[0].stalled_devices == ("cpu:1",)
    assert what in str(caught[0])


def test_a_held_session_on_trio_is_refused_saying_to_use_async_with(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    seen: dict[str, object] = {}

    async def main() -> None:
        with pytest.raises(gsync.ConfigError, match=r"needs asyncio; on trio, use the scoped form, `async with engine.session"):
            await engine.session(Deep(), optimizer=sgd, loss_fn=classification_loss)
        async with engine.session(Deep(), optimizer=sgd, loss_fn=classification_loss) as session:  # the engine is free
            seen["step"] = (await session.step(make_batches(1, 8)[0])).step

    anyio.run(main, backend="trio")
    assert seen["step"] == 0
