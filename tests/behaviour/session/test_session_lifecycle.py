"""The open loop: a session's life, its errors, evaluate and all_reduce; fit's callbacks and history."""

from __future__ import annotations

import asyncio
import copy
import functools
import sys
import threading
import time
from typing import Any

import anyio
import pytest
import torch
from torch import nn

import gsync
import gsync.testing
from gsync_pytest import gsync_threads
from tests.support.models import Normed, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.tasks import assert_no_tasks_left

pytestmark = pytest.mark.asyncio

TWO = ["cpu:0", "cpu:1"]


async def test_a_session_loop_equals_fit_and_writes_the_weights_back(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(5, 31)
    expected, expected_losses = train_reference(model, batches)
    engine = gsync.Engine(TWO)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=sgd, loss_fn=classification_loss) as session:
        results = [await session.step(batch) for batch in batches]
        assert_same_state(trained, model, atol=0)  # only written back when the block ends
    assert_same_state(trained, expected)
    assert [r.step for r in results] == [0, 1, 2, 3, 4]
    assert [r.loss for r in results] == pytest.approx(expected_losses, abs=2e-5)
    assert all(r.rows == 31 and r.seconds > 0 and r.lr == 0.1 for r in results)
    fitted = await engine.fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss)
    assert_same_state(fitted.model, trained, atol=0)
    assert_no_tasks_left()


async def test_using_a_session_after_its_block_says_so() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.SessionClosed, match="after the session was closed"):
        await session.step(make_batches(1, 8)[0])
    with pytest.raises(gsync.SessionClosed):
        session.checkpoint()


async def test_two_tasks_stepping_one_session_is_refused(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=1, step=0, site="backward")
    with gsync.testing.inject(engine, fault):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            async with anyio.create_task_group() as group:
                group.start_soon(session.step, make_batches(1, 8)[0])
                await anyio.to_thread.run_sync(fault.reached.wait, 10)
                with pytest.raises(gsync.ConfigError, match="another task is inside step"):
                    await session.step(make_batches(1, 8)[0])
                fault.release.set()


async def test_an_exception_in_the_users_body_propagates_unchanged_and_stops_everything(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    model = TiedNet()
    before = copy.deepcopy(model)
    mine = KeyError("the user's own bug")
    with pytest.raises(KeyError) as caught:
        async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            raise mine
    assert caught.value is mine
    assert_same_state(model, before, atol=0)
    assert gsync_threads() == []
    assert_no_tasks_left()
    async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as again:
        await again.step(make_batches(1, 8)[0])


async def test_a_device_failure_raises_from_step_and_closes_the_session(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    batches = make_batches(4, 8)
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=2, site="backward")):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(batches[0])
            await session.step(batches[1])
            with pytest.raises(gsync.WorkerFailed) as caught:
                await session.step(batches[2])
            failure = caught.value
            assert failure.device_index == 1 and failure.step == 2 and failure.site == "backward"
            assert isinstance(failure.__cause__, gsync.testing.InjectedFault)
            assert failure.last_step == 1 and failure.checkpoint.step == 1
            with pytest.raises(gsync.SessionClosed, match="failed") as closed:
                await session.step(batches[3])
            assert closed.value.__cause__ is failure
    assert gsync_threads() == []


async def test_an_uncaught_failure_leaves_the_block_as_itself() -> None:
    engine = gsync.Engine(TWO)
    with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=1, site="optimizer")):
        with pytest.raises(gsync.WorkerFailed) as caught:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                for batch in make_batches(3, 8):
                    await session.step(batch)
    assert caught.value.step == 1 and caught.value.site == "optimizer"
    # Device 1 may have applied step 1 before the abort reached it: then its state is the checkpoint.
    assert caught.value.last_step in (0, 1) and caught.value.checkpoint.step == caught.value.last_step


async def test_a_bad_batch_is_refused_before_anything_is_dispatched() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        x, y = make_batches(1, 8)[0]
        with pytest.raises(gsync.ConfigError, match="disagree on their size"):
            await session.step((x, y[:5]))
        with pytest.raises(gsync.ConfigError, match="at least one batch"):
            await session.step()
        # Nothing was dispatched: the session goes on.
        result = await session.step((x, y))
    assert result.step == 0


async def test_cancelling_a_session_stops_everything_and_the_engine_opens_another(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=0, step=1, site="forward")
    with gsync.testing.inject(engine, fault):
        with anyio.move_on_after(5) as scope:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                await session.step(make_batches(1, 8)[0])
                async with anyio.create_task_group() as group:
                    group.start_soon(session.step, make_batches(1, 8)[0])
                    await anyio.to_thread.run_sync(fault.reached.wait, 10)
                    scope.cancel()
    assert scope.cancelled_caught
    assert gsync_threads() == []
    assert_no_tasks_left()
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(make_batches(1, 8)[0])


async def test_one_session_or_fit_at_a_time_per_engine() -> None:
    engine = gsync.Engine(TWO)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss):
        with pytest.raises(gsync.ConfigError, match="already has an open session"):
            await engine.fit(TiedNet(), make_batches(1, 8), optimizer=sgd, loss_fn=classification_loss)


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
        reference = copy.deepcopy(session._core._actors[0].replica)
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
    assert str(error) == f"evaluate after step 0: reading batch {failed_batch} (from 0) of its data failed"
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
                expected = copy.deepcopy(session._core._actors[1].replica.state_dict())
                stalled = session._core._actors[0].replica

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
        metrics = await session.evaluate(make_batches(1, 8))
        self.calls.append(("end", round(metrics["loss"], 3) > 0))


async def test_callbacks_run_in_order_between_steps() -> None:
    recorder = Recorder()
    result = await gsync.Engine(TWO).fit(
        TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, epochs=2, callbacks=[recorder]
    )
    assert recorder.calls == [
        ("step", 0), ("step", 1), ("step", 2), ("epoch", 0),
        ("step", 3), ("step", 4), ("step", 5), ("epoch", 1),
        ("end", True),
    ]  # fmt: skip
    assert [(r.step, r.epoch) for r in result.history] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert [r.loss for r in result.history] == result.losses
    assert all(r.rows == 8 and r.lr == 0.1 and r.seconds > 0 for r in result.history)


class _IndexedRows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset that logs which rows are read, in the order they are."""

    def __init__(self, rows: int) -> None:
        self.x, self.y = make_batches(1, rows)[0]
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(index)
        return self.x[index], self.y[index]


def _shuffled_loader(rows: int) -> torch.utils.data.DataLoader[Any]:
    dataset = _IndexedRows(rows)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)


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


async def test_a_distributed_sampler_reshuffles_each_epoch_as_in_a_plain_loop() -> None:
    # A plain loop calls sampler.set_epoch(epoch) before each epoch (DistributedSampler's docs); fit does it too,
    # as Lightning and Accelerate do, so the recipe the README gives for process-local data shuffles per epoch.
    plain = _shuffled_loader(16)
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for _ in plain:
            pass
    loader = _shuffled_loader(16)
    await gsync.Engine(TWO).fit(TiedNet(), loader, optimizer=sgd, loss_fn=classification_loss, epochs=3)
    assert loader.dataset.read == plain.dataset.read  # type: ignore[attr-defined]
    epochs = [plain.dataset.read[i * 16 : (i + 1) * 16] for i in range(3)]  # type: ignore[attr-defined]
    assert epochs[0] != epochs[1] != epochs[2]


async def test_a_loop_that_sets_the_epoch_itself_and_fits_one_epoch_at_a_time_keeps_its_numbering() -> None:
    plain, loader = _shuffled_loader(16), _shuffled_loader(16)
    engine = gsync.Engine(TWO)
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for _ in plain:
            pass
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        await engine.fit(TiedNet(), loader, optimizer=sgd, loss_fn=classification_loss, epochs=1)
    assert loader.dataset.read == plain.dataset.read  # type: ignore[attr-defined]


async def test_a_run_resumed_in_a_later_epoch_reads_that_epochs_shuffle(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    args: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss, epochs=3)
    whole = await gsync.Engine(TWO).fit(copy.deepcopy(model), _shuffled_loader(16), **args)
    loader = _shuffled_loader(16)
    first = await gsync.Engine(TWO).fit(copy.deepcopy(model), loader, **{**args, "epochs": 2})
    # In the same process (a notebook resuming after a failure) the sampler is left at epoch 1: the resumed run
    # replays the run's epochs from 0, as the checkpoint counts them.
    resumed = await gsync.Engine(TWO).fit(copy.deepcopy(model), loader, resume=first.checkpoint, **args)
    assert resumed.first_step == 8
    assert_same_state(resumed.model, whole.model, atol=0)


async def test_stop_training_ends_fit_early_with_the_steps_done(no_leaks: None) -> None:
    recorder = Recorder(stop_at=3)
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(6, 8)
    expected, _ = train_reference(model, batches[:4])
    result = await gsync.Engine(TWO).fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, callbacks=[recorder])
    assert len(result.losses) == 4 and result.checkpoint.step == 3
    assert recorder.calls[-1] == ("end", True)
    assert_same_state(result.model, expected)


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


async def test_the_default_progress_display_is_rank_0s_outside_tests_and_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    from gsync._core.session.progress import progress_wanted

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    # Under torchrun every rank runs the same steps: one bar, not one per rank fighting over the terminal.
    assert [progress_wanted(None, rank) for rank in range(3)] == [True, False, False]
    assert [progress_wanted(True, rank) for rank in range(3)] == [True, True, True]
    monkeypatch.setenv("CI", "true")
    assert progress_wanted(None, 0) is False


async def test_fit_progress_logs_without_tqdm(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed: importing it fails
    caplog.set_level("INFO", logger="gsync")
    await gsync.Engine(TWO).fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss, progress=True)
    assert any("step 0 (epoch 0): loss" in record.getMessage() for record in caplog.records)


async def test_fit_progress_bar_formats_figures_only_to_redraw_and_ends_on_the_last_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tqdm = pytest.importorskip("tqdm")
    formatted: list[object] = []
    set_postfix = tqdm.std.tqdm.set_postfix
    monkeypatch.setattr(tqdm.std.tqdm, "set_postfix", lambda bar, *a, **k: formatted.append(k) or set_postfix(bar, *a, **k))
    # No redraw during the run, so no figures are formatted for one. (Not TQDM_MININTERVAL: tqdm reads its
    # environment once, as it is imported, and without it a slow step redraws after tqdm's default 0.1 s.)
    monkeypatch.setattr(tqdm.std.tqdm, "__init__", functools.partialmethod(tqdm.std.tqdm.__init__, mininterval=1000))
    result = await gsync.Engine(TWO).fit(
        TiedNet(), make_batches(6, 8), optimizer=sgd, loss_fn=classification_loss, progress=True
    )
    final = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert "6/6" in final and f"loss={result.losses[-1]:.4g}" in final, final
    assert len(formatted) == 1  # at the end


async def test_fit_progress_bar_disabled_by_tqdms_environment_still_trains(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tqdm = pytest.importorskip("tqdm")
    torch.manual_seed(0)
    model = TiedNet()
    expected, expected_losses = train_reference(model, make_batches(3, 8))
    # What TQDM_DISABLE=1 does to every bar (set so: tqdm reads its environment only as it is imported).
    monkeypatch.setattr(tqdm.std.tqdm, "__init__", functools.partialmethod(tqdm.std.tqdm.__init__, disable=True))
    result = await gsync.Engine(TWO).fit(
        copy.deepcopy(model), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, progress=True
    )
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert_same_state(result.model, expected)
    assert capsys.readouterr().err == ""  # the disabled bar drew nothing, and nothing fell back to lines


async def test_a_session_used_from_an_asyncio_task_group_too() -> None:
    """Sessions are plain anyio: an asyncio.TaskGroup around them works as well."""
    engine = gsync.Engine(TWO)
    torch.manual_seed(0)
    model = TiedNet()
    _, expected_losses = train_reference(model, make_batches(1, 8))
    async with asyncio.TaskGroup() as group:
        async def train() -> float:
            async with engine.session(copy.deepcopy(model), optimizer=sgd, loss_fn=classification_loss) as session:
                return (await session.step(make_batches(1, 8)[0])).loss

        task = group.create_task(train())
    assert task.result() == pytest.approx(expected_losses[0], abs=2e-5)


async def test_cancelling_one_step_midway_closes_the_session(no_leaks: None) -> None:
    engine = gsync.Engine(TWO)
    fault = gsync.testing.stall(device=1, step=1, site="backward")
    with gsync.testing.inject(engine, fault):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            with anyio.move_on_after(0.2) as scope:
                await session.step(make_batches(1, 8)[0])
            assert scope.cancelled_caught
            with pytest.raises(gsync.SessionClosed, match="cancelled midway"):
                await session.step(make_batches(1, 8)[0])
    assert gsync_threads() == []


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
