"""``session.evaluate`` and ``session.all_reduce``: global row-weighted means, and what a failure in one does."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import gsync
import gsync.testing
from tests.support.inside import replicas_of
from tests.support.models import Normed, TWO, TiedNet, classification_loss, make_batches, sgd

pytestmark = pytest.mark.asyncio


def accuracy(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x).argmax(dim=1) == y).float().mean()


@pytest.mark.parametrize("num_devices", [1, 2, 3])
async def test_evaluate_gives_global_row_weighted_means_in_eval_mode(num_devices: int) -> None:
    torch.manual_seed(0)
    model = Normed()
    model.inp.eval()  # a submodule the user froze in eval mode stays so afterwards
    val = make_batches(3, 13, seed=5)
    engine = gsync.Engine([f"cpu:{i}" for i in range(num_devices)])
    async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 16)[0])
        metrics = await session.evaluate(val)
        named = await session.evaluate(val, metric_fn=accuracy)
        both = await session.evaluate(iter(val), metric_fn=lambda m, b: {"acc": accuracy(m, b), "loss": classification_loss(m, b)})
        reference = copy.deepcopy(replicas_of(session)[0])
    assert model.training and not model.inp.training and model.norm.training
    reference.eval()
    with torch.no_grad():
        rows = sum(len(y) for _, y in val)
        loss = sum(float(classification_loss(reference, b)) * len(b[1]) for b in val) / rows
        acc = sum(float(accuracy(reference, b)) * len(b[1]) for b in val) / rows
    assert metrics == {"loss": pytest.approx(loss, abs=1e-5)}
    assert named == {"accuracy": pytest.approx(acc, abs=1e-6)}
    assert both == {"acc": pytest.approx(acc, abs=1e-6), "loss": pytest.approx(loss, abs=1e-5)}


async def test_an_evaluation_before_the_first_step_runs_its_cpu_devices_first_calls_in_turn() -> None:
    # As the first step does (FirstStepInTurn): torch sets up some CPU kernels on their first use, and two threads
    # making those first calls at once may get results that differ in the last bit. Later calls run at once.
    overlapped: list[bool] = []
    both_inside = threading.Barrier(2)
    patience = 0.5

    def loss_meeting_the_other_device(model: nn.Module, batch: Any) -> torch.Tensor:
        try:
            # In turn, the other device cannot arrive: the wait runs out (and the barrier, broken, lets it pass).
            both_inside.wait(timeout=patience)
            overlapped.append(True)
        except threading.BrokenBarrierError:
            overlapped.append(False)
        return classification_loss(model, batch)

    engine = gsync.Engine(["cpu:0", "cpu:1"], device_threads="per_device")
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.evaluate(make_batches(1, 8), metric_fn=loss_meeting_the_other_device)
        assert overlapped == [False, False]
        await session.step(make_batches(1, 8)[0])
        overlapped.clear()
        both_inside.reset()
        patience = 30.0  # the other device arrives (under load, maybe late)
        await session.evaluate(make_batches(1, 8), metric_fn=loss_meeting_the_other_device)
        assert overlapped == [True, True]


@pytest.mark.parametrize("num_devices", [1, 2])
async def test_a_metric_a_shard_leaves_out_counts_as_zero_for_its_rows(num_devices: int) -> None:
    x = torch.randn(8, 12)
    y = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])

    def metrics(model: nn.Module, batch: Any) -> dict[str, float]:
        _, labels = batch
        found = {"seen": 1.0}
        if bool((labels == 1).any()):  # on 2 devices the second shard has no positives and leaves the name out
            found["positive"] = float((labels == 1).float().mean())
        return found

    engine = gsync.Engine([f"cpu:{i}" for i in range(num_devices)])
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        result = await session.evaluate([(x, y)], metric_fn=metrics)
    # A per-row mean comes out the same on any number of devices: half the rows are positive.
    assert result == {"seen": 1.0, "positive": 0.5}


async def test_evaluate_rejects_what_is_not_batches_before_any_work_and_the_session_stays_open() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    before = copy.deepcopy(model.state_dict())
    async with gsync.Engine(TWO).session(model, optimizer=sgd, loss_fn=classification_loss) as session:
        one_batch = {"x": torch.zeros(8, 12), "y": torch.zeros(8, dtype=torch.long)}
        for data in (torch.zeros(8, 12), 5, one_batch):
            with pytest.raises(gsync.InputTypeError, match="data"):
                await session.evaluate(data)  # type: ignore[arg-type]
        await session.step(make_batches(1, 8)[0])
    assert any(not torch.equal(value, before[name]) for name, value in model.state_dict().items())


def _fails_midway() -> Any:
    yield make_batches(1, 8)[0]
    raise OSError("val shard missing")


class _FailsToStart:
    def __iter__(self) -> Any:
        raise OSError("val shard missing")


async def _async_fails_midway() -> Any:
    yield make_batches(1, 8)[0]
    raise OSError("val shard missing")


@pytest.mark.parametrize("data", [_fails_midway, _FailsToStart, _async_fails_midway])
async def test_evaluate_data_that_fails_raises_data_failed_and_closes_the_session(data: Any) -> None:
    async with gsync.Engine(TWO).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 8)[0])
        with pytest.raises(gsync.DataFailed) as caught:
            await session.evaluate(data())
        # Across processes the ranks' evaluations would no longer match: the session is over.
        with pytest.raises(gsync.SessionClosed, match="failed"):
            await session.step(make_batches(1, 8)[0])
    error = caught.value
    failed_batch = 0 if data is _FailsToStart else 1
    assert str(error) == f"evaluate after step 0: reading batch {failed_batch} (from 0) of its data failed: OSError: val shard missing"
    assert error.batch == failed_batch
    assert error.site == "evaluate" and error.step == 0 and isinstance(error.__cause__, OSError)
    assert error.checkpoint is not None and error.checkpoint.step == 0


async def test_metrics_may_be_numpy_scalars_and_bools_as_a_plain_loop_would_take_them() -> None:
    import numpy as np

    def metrics(model: nn.Module, batch: Any) -> dict[str, Any]:
        rows = len(batch[1])
        return {"half": np.float32(0.5), "rows": np.int64(rows), "positive": True, "quarter": np.array([0.25])}

    async with gsync.Engine(TWO).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        result = await session.evaluate(make_batches(2, 8), metric_fn=metrics)
    assert result == {"half": 0.5, "rows": 4.0, "positive": 1.0, "quarter": 0.25}


async def test_metric_names_must_be_strings_in_one_process_as_across_processes() -> None:
    def by_class(model: nn.Module, batch: Any) -> dict[Any, float]:
        return {0: 1.0}

    with pytest.raises(gsync.InputTypeError, match="metric names must be str"):
        async with gsync.Engine(TWO).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.evaluate(make_batches(1, 8), metric_fn=by_class)


async def test_evaluate_failure_is_a_worker_failure_and_closes_the_session() -> None:
    def broken(model: nn.Module, batch: Any) -> torch.Tensor:
        raise ValueError("metric bug")

    engine = gsync.Engine(TWO)
    with pytest.raises(gsync.WorkerFailed) as caught:
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            await session.evaluate(make_batches(1, 8), metric_fn=broken)
    assert caught.value.site == "evaluate" and isinstance(caught.value.__cause__, ValueError)
    assert caught.value.checkpoint is not None and caught.value.checkpoint.step == 0


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("device_threads", ["shared", "per_device"])
async def test_a_stalled_evaluation_raises_sync_timeout_naming_the_device(
    device_threads: str, device: int, no_leaks: None
) -> None:
    engine = gsync.Engine(TWO, sync_timeout=0.3, device_threads=device_threads)  # type: ignore[arg-type]
    # On the shared thread, cpu:1's share waits behind a stalled cpu:0's: only cpu:0 is named.
    fault = gsync.testing.stall(device=device, step=0, site="evaluate")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            await session.evaluate(make_batches(1, 8))
    assert fault.fired_at is not None and time.monotonic() - fault.fired_at < 0.3 + 1.0
    error = caught.value
    name = f"cpu:{device}"
    assert error.site == "evaluate" and error.stalled_devices == (name,)
    assert error.last_seen == {name: "step 0, evaluate"}
    assert str(error).startswith("evaluate after step 0 did not complete within 0.3 s")
    # The stall was after step 0 was applied everywhere: nothing consistent is lost.
    assert error.checkpoint is not None and error.checkpoint.step == 0


async def test_an_evaluation_in_a_resumed_session_is_after_the_step_it_resumed_from(no_leaks: None) -> None:
    engine = gsync.Engine(TWO, sync_timeout=0.3)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        for batch in make_batches(3, 8):
            await session.step(batch)
        checkpoint = session.checkpoint()
    fault = gsync.testing.stall(device=1, step=2, site="evaluate")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss, resume=checkpoint) as session:
            await session.evaluate(make_batches(1, 8))  # before this session's first step
    assert fault.fired_at is not None
    assert caught.value.step == 2 and caught.value.last_seen == {"cpu:1": "step 2, evaluate"}
    assert str(caught.value).startswith("evaluate after step 2 did not complete within 0.3 s")


async def test_the_checkpoint_of_a_stalled_evaluation_is_read_from_a_replica_no_job_still_uses() -> None:
    engine = gsync.Engine(TWO, sync_timeout=0.3)
    release = threading.Event()
    try:
        with pytest.raises(gsync.SyncTimeout) as caught:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                await session.step(make_batches(1, 8)[0])
                expected = copy.deepcopy(replicas_of(session)[1].state_dict())
                stalled = replicas_of(session)[0]

                def scribbles_then_hangs(model: nn.Module, batch: Any) -> torch.Tensor:
                    if model is stalled:  # a metric that writes to the model, then blocks in native code
                        with torch.no_grad():
                            for param in model.parameters():
                                param.fill_(float("nan"))
                        release.wait(10)
                    return classification_loss(model, batch)

                await session.evaluate(make_batches(1, 8), metric_fn=scribbles_then_hangs)
        assert caught.value.stalled_devices == ("cpu:0",)
        checkpoint = caught.value.checkpoint
        assert checkpoint is not None and checkpoint.step == 0
        for name, value in checkpoint.model_state.items():
            assert torch.equal(value, expected[name]), name
    finally:
        release.set()
    for thread in [t for t in threading.enumerate() if t.name.startswith("gsync-")]:
        thread.join(5)


async def test_all_reduce_in_one_process_returns_the_value_as_is() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        tensor = torch.arange(3.0)
        assert await session.all_reduce(tensor) is tensor
        assert await session.all_reduce(2.5, op="max") == 2.5
        # The types any number of processes gives: an int stays an int, a mean is a float.
        assert type(await session.all_reduce(3)) is int
        assert type(await session.all_reduce(3, op="mean")) is float
        assert (await session.all_reduce(torch.tensor([3, 4]), op="mean")).dtype == torch.float64
        assert (await session.all_reduce(torch.tensor([True, False]), op="mean")).tolist() == [1.0, 0.0]
        with pytest.raises(gsync.ConfigError, match="does not fit"):
            await session.all_reduce(2**63)
        with pytest.raises(gsync.ConfigError, match="op must be"):
            await session.all_reduce(1.0, op="product")  # type: ignore[arg-type]
        with pytest.raises(gsync.InputTypeError):
            await session.all_reduce("1.0")  # type: ignore[arg-type]
    assert session.rank == 0 and session.world_size == 1
