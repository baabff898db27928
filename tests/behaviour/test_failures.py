"""Failure semantics: root cause within a second, nothing hangs, nothing lost."""

from __future__ import annotations

import asyncio
import copy
import functools
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
from tests.support.inside import claim
from tests.support.models import Normed, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.tasks import assert_no_tasks_left

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

STEPS = 5


def fit_args(steps: int = STEPS) -> dict[str, Any]:
    return {"data": make_batches(steps, 12), "optimizer": sgd, "loss_fn": classification_loss}


@pytest.mark.parametrize("site", ["data", "forward", "backward", "optimizer"])
@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("step", [0, 2, STEPS - 1])
async def test_device_failure_matrix(site: str, device: int, step: int, no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    fault = gsync.testing.fail(device=device, step=step, site=site)  # type: ignore[arg-type]
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(TiedNet(), **fit_args())
    raised_at = time.monotonic()

    error = caught.value
    assert (error.device, error.device_index, error.step, error.site) == (f"cpu:{device}", device, step, site)
    assert isinstance(error.__cause__, gsync.testing.InjectedFault)
    assert error.__cause__.__traceback__ is not None
    assert fault.fired_at is not None and raised_at - fault.fired_at < 1.0
    assert gsync_threads() == []
    assert_no_tasks_left()
    # Nothing lost: the checkpoint is at most one step behind the failure.
    assert error.checkpoint is not None
    assert error.checkpoint.step in (step - 1, step) if site == "optimizer" else error.checkpoint.step == step - 1
    assert error.last_step == (error.checkpoint.step if error.checkpoint.step >= 0 else None)


async def test_several_failures_report_the_earliest_and_keep_the_others(no_leaks: None) -> None:
    device_0_inside, device_2_failing = threading.Event(), threading.Event()

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        device = int(batch[0][0, 0])  # the marker written below
        if device == 2:
            device_0_inside.wait(5)
            device_2_failing.set()
            raise ValueError("device 2")
        if device == 0:
            device_0_inside.set()
            device_2_failing.wait(5)
            raise KeyError("device 0")
        return classification_loss(model, batch)

    first, batch = make_batches(2, 12)
    first[0][:, 0] = -1.0
    batch[0][:, 0] = torch.arange(12) // 4  # each row names the device of its shard
    # Failures at the same time need devices running at the same time: each in its own thread.
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], device_threads="per_device")
    with pytest.raises(gsync.WorkerFailed) as caught:
        # At step 1: a session's first step runs its devices in turn (FirstStepInTurn), later ones at once.
        await engine.fit(TiedNet(), [first, batch], optimizer=sgd, loss_fn=loss_fn)
    error = caught.value
    reported = [error, *error.others]
    assert sorted(e.device_index for e in reported) == [0, 2]  # type: ignore[attr-defined]
    assert all(other.at >= error.at for other in error.others)
    assert {type(e.__cause__) for e in reported} == {ValueError, KeyError}
    assert all(str(other) in "\n".join(error.__notes__) for other in error.others)


async def test_collective_failure_is_sync_failed_naming_bucket_and_step(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    fault = gsync.testing.fail(device=None, step=3, site="all_reduce", error=OSError("link down"))
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncFailed) as caught:
        await engine.fit(TiedNet(), **fit_args())
    assert (caught.value.step, caught.value.bucket) == (3, 0)
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.last_step == 2


@pytest.mark.parametrize("site", ["forward", "optimizer"])
async def test_a_stall_in_the_first_step_names_the_stalled_device_not_those_waiting_their_turn(
    site: str, no_leaks: None
) -> None:
    # The first step runs CPU devices one after another (FirstStepInTurn): cpu:1 and cpu:2 wait behind cpu:0.
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], sync_timeout=0.3)
    fault = gsync.testing.stall(device=0, step=0, site=site)  # type: ignore[arg-type]
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        await engine.fit(TiedNet(), **fit_args())
    error = caught.value
    assert error.step == 0
    assert error.stalled_devices == ("cpu:0",)
    assert "cpu:1" not in str(error) and "cpu:2" not in str(error)
    if site == "forward":
        # The server's deadline for the first step allows for the turns: 3 x 0.3 s.
        assert error.timeout == pytest.approx(0.9)
        assert {d for d, _ in error.missing} == {"cpu:0"}
        assert error.last_seen == {"cpu:0": "step 0, forward"}


@pytest.mark.parametrize("site", ["forward", "backward", "optimizer"])
async def test_stalled_device_raises_sync_timeout_naming_it(site: str, no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=0.3)
    fault = gsync.testing.stall(device=1, step=2, site=site)  # type: ignore[arg-type]
    started = time.monotonic()
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        await engine.fit(TiedNet(), **fit_args())
    assert fault.fired_at is not None
    assert time.monotonic() - fault.fired_at < 0.3 + 1.0
    error = caught.value
    assert isinstance(error, TimeoutError)
    assert error.stalled_devices == ("cpu:1",)
    assert "cpu:1" in str(error)
    if site == "optimizer":
        # Device 0 has moved on to step 3; either the server (step 3 never
        # arrived from cpu:1) or cpu:1's own optimizer timer reports first.
        assert error.step in (2, 3) and "optimizer" in str(error)
        assert error.last_seen == {"cpu:1": "step 2, optimizer"}
    else:
        assert error.step == 2 and error.missing and {d for d, _ in error.missing} == {"cpu:1"}
        assert error.last_seen == {"cpu:1": f"step 2, {site}"}
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(("device_threads", "thread"), [("shared", "gsync-devices"), ("per_device", "gsync-device-0")])
async def test_uninterruptible_stall_still_raises_in_time_and_the_thread_ends_when_released(
    device_threads: str, thread: str
) -> None:
    # A timeout a loaded machine's first step (devices in turn) cannot reach: only the stall may time out. CPU
    # devices may take turns, each given the timeout, so a step's is twice it.
    timeout = 1.0
    engine = gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=timeout, device_threads=device_threads)  # type: ignore[arg-type]
    fault = gsync.testing.stall(device=0, step=1, site="forward", interruptible=False)
    try:
        with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
            await engine.fit(TiedNet(), **fit_args())
        assert fault.fired_at is not None and time.monotonic() - fault.fired_at < 2 * timeout + 1.0
        assert caught.value.stalled_devices == ("cpu:0",)
        # The stuck thread is the one gsync cannot stop; it is still blocked.
        assert gsync_threads() == [thread]
    finally:
        fault.release.set()
    stuck = [t for t in threading.enumerate() if t.name == thread]
    for thread in stuck:
        thread.join(5)
    assert gsync_threads() == []


@pytest.mark.parametrize("how", ["cancel_scope", "task_cancel"])
async def test_cancellation_from_outside_stops_everything_and_propagates(how: str, no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    fault = gsync.testing.stall(device=1, step=2, site="backward")
    with gsync.testing.inject(engine, fault):
        if how == "cancel_scope":  # what anyio.move_on_after / fail_after do when their deadline passes
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(functools.partial(engine.fit, TiedNet(), **fit_args()))
                    await anyio.to_thread.run_sync(fault.reached.wait, 10)
                    cancelled_at = time.monotonic()
                    scope.cancel()
            assert scope.cancelled_caught
        else:
            task = asyncio.create_task(engine.fit(TiedNet(), **fit_args()))
            await anyio.to_thread.run_sync(fault.reached.wait, 10)
            cancelled_at = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert time.monotonic() - cancelled_at < 1.0
    assert gsync_threads() == []
    assert_no_tasks_left()
    # The engine is usable again: it trains as a plain loop does.
    model = TiedNet()
    expected, expected_losses = train_reference(model, fit_args(2)["data"])
    result = await engine.fit(copy.deepcopy(model), **fit_args(2))
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert_same_state(result.model, expected)


async def test_no_traceback_escapes_any_thread(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    escaped: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], sync_timeout=0.3)
    for fault in (
        gsync.testing.fail(device=1, step=1, site="backward"),
        gsync.testing.stall(device=2, step=1, site="forward"),
        gsync.testing.fail(device=None, step=2, site="all_reduce"),
    ):
        with gsync.testing.inject(engine, fault), pytest.raises(gsync.FitError):
            await engine.fit(Normed(), **fit_args())
    assert escaped == [] and loop_errors == []
    out, err = capfd.readouterr()
    assert "Traceback" not in err + out and "Exception in" not in err + out


def _run_with_checkpoints(
    engine: gsync.Engine, model: nn.Module, batches: list[Any], fault: gsync.testing.Fault, epochs: int = 1
) -> nn.Module:
    async def go() -> nn.Module:
        with gsync.testing.inject(engine, fault), pytest.raises(gsync.FitError) as caught:
            await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, epochs=epochs)
        checkpoint = caught.value.checkpoint
        assert isinstance(checkpoint, gsync.Checkpoint)
        result = await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, epochs=epochs, resume=checkpoint)
        assert result.first_step == checkpoint.next_step
        return result.model

    return go()  # type: ignore[return-value]


@pytest.mark.parametrize("site", ["forward", "backward", "optimizer"])
@pytest.mark.parametrize("step", [0, 3, 6])
async def test_resume_after_failure_equals_a_run_that_never_failed(site: str, step: int, no_leaks: None) -> None:
    # BatchNorm normalises by shard statistics, so the reference is an
    # unfailed gsync run with the same split, not one-device training.
    torch.manual_seed(0)
    model = Normed()
    batches = make_batches(4, 12)
    unfailed = await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, epochs=2
    )

    engine = gsync.Engine(["cpu:0", "cpu:1"])
    fault = gsync.testing.fail(device=1, step=step, site=site)  # type: ignore[arg-type]
    resumed = await _run_with_checkpoints(engine, model, batches, fault, epochs=2)
    assert_same_state(resumed, unfailed.model, atol=1e-6)
    assert int(resumed.norm.num_batches_tracked) == 8


async def test_failed_fit_leaves_the_model_untouched_and_the_checkpoint_loads_into_it() -> None:
    model = TiedNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.testing.inject(engine, gsync.testing.fail(1, 3, "backward")), pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(model, **fit_args())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert caught.value.last_step == 2
    model.load_state_dict(caught.value.checkpoint.model_state)
    expected, _ = train_reference(TiedNet(), [])  # just the class; compare against a 3-step reference below
    reference_model = TiedNet()
    reference_model.load_state_dict(before)
    reference_model, _ = train_reference(reference_model, fit_args()["data"][:3])
    assert_same_state(model, reference_model)
    del expected


async def test_non_finite_loss_raises_naming_device_and_step() -> None:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = classification_loss(model, batch)
        if batch[0].shape[0] == 4:  # device 1's shard of the 9-row batch (5 + 4)
            return loss * float("nan")
        return loss

    batches = make_batches(3, 12) + [(torch.randn(9, 12), torch.randint(0, 5, (9,)))]
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with pytest.raises(gsync.NonFiniteLoss) as caught:
        await engine.fit(TiedNet(), batches, optimizer=sgd, loss_fn=loss_fn)
    assert (caught.value.device, caught.value.step) == ("cpu:1", 3)
    assert caught.value.last_step == 2


async def test_non_finite_loss_can_skip_the_step_on_every_device() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(4, 12)
    poisoned = (batches[2][0].clone(), batches[2][1])
    poisoned[0][7, 0] = float("nan")  # a row of device 1's shard
    data = batches[:2] + [poisoned] + batches[2:]
    expected_model, _ = train_reference(model, batches)

    result = await gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip").fit(
        model, data, optimizer=sgd, loss_fn=classification_loss
    )
    assert result.skipped_steps == [2]
    assert len(result.losses) == 5 and not torch.isfinite(torch.tensor(result.losses[2]))
    assert_same_state(model, expected_model)


def _step_1_not_finite() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = make_batches(4, 12)
    batches[1][0][7, 0] = float("nan")  # a row of device 1's shard
    return batches


async def test_a_skipped_steps_scheduler_fails_at_the_optimizer_site(no_leaks: None) -> None:
    # A skipped step still steps the LR scheduler, in the optimizer phase: user code, reported where it ran.
    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 if epoch < 2 else 1 / 0)  # in step 1's step()

    engine = gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip")
    with pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(
            TiedNet(), _step_1_not_finite(), optimizer=sgd, loss_fn=classification_loss, scheduler=schedule
        )
    assert (caught.value.step, caught.value.site) == (1, "optimizer")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


async def test_a_skipped_step_that_stalls_times_out_as_an_optimizer_step_does(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip", sync_timeout=0.3)
    fault = gsync.testing.stall(device=1, step=1, site="optimizer")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        await engine.fit(TiedNet(), _step_1_not_finite(), optimizer=sgd, loss_fn=classification_loss)
    assert fault.fired_at is not None
    assert caught.value.stalled_devices == ("cpu:1",) and "optimizer" in str(caught.value)
    assert caught.value.last_seen == {"cpu:1": "step 1, optimizer"}


async def test_replica_divergence_is_detected() -> None:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if batch[0].shape[0] == 5:  # device 1 of an 11-row batch writes to its replica
            with torch.no_grad():
                model.head.bias.add_(1.0)
        return classification_loss(model, batch)

    batches = make_batches(2, 12) + make_batches(1, 11)
    engine = gsync.Engine(["cpu:0", "cpu:1"], check_replicas_every=1)
    with pytest.raises(gsync.ReplicasDiverged) as caught:
        await engine.fit(TiedNet(), batches, optimizer=sgd, loss_fn=loss_fn)
    assert caught.value.step == 2 and set(caught.value.fingerprints) == {"cpu:0", "cpu:1"}
    assert caught.value.last_step is not None


@pytest.mark.parametrize(
    "cause",
    # A gsync error the user's data raises (from a session of its own) is a failure of that data too.
    [OSError("disk gone"), gsync.ConfigError("raised by a session the loader runs itself")],
    ids=["os-error", "gsync-error"],
)
async def test_data_iterator_failure_names_the_step(cause: Exception) -> None:
    def broken() -> Any:
        yield from make_batches(2, 8)
        raise cause

    with pytest.raises(gsync.DataFailed) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(TiedNet(), broken(), optimizer=sgd, loss_fn=classification_loss)
    assert caught.value.step == 2 and caught.value.__cause__ is cause
    assert caught.value.last_step == 1


class _Reopened:
    """A re-iterable that opens its source again each epoch; the ``fail_on``-th opening raises."""

    def __init__(self, batches: list[Any], fail_on: int) -> None:
        self.batches, self.fail_on, self.opened = batches, fail_on, 0

    def __iter__(self) -> Any:
        self.opened += 1
        if self.opened == self.fail_on:
            raise OSError("index file vanished")
        return iter(self.batches)


class _AsyncReopened(_Reopened):
    def __aiter__(self) -> Any:
        inner = _Reopened.__iter__(self)

        async def batches() -> Any:
            for batch in inner:
                yield batch

        return batches()

    __iter__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("source", [_Reopened, _AsyncReopened])
async def test_data_that_fails_to_start_an_epoch_raises_data_failed_and_keeps_the_steps_done(source: type) -> None:
    batches = make_batches(4, 8)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with pytest.raises(gsync.DataFailed) as caught:
        await engine.fit(TiedNet(), source(batches, fail_on=2), epochs=3, optimizer=sgd, loss_fn=classification_loss)
    assert caught.value.step == 4 and isinstance(caught.value.__cause__, OSError)
    # Every step of the first epoch ran, the one read ahead included, and nothing of them is lost.
    assert caught.value.last_step == 3 and caught.value.checkpoint.step == 3


class _FailsOnRead:
    def __init__(self, batches: list[Any], fail_at: int) -> None:
        self.batches, self.fail_at, self.reads = batches, fail_at, 0

    def __iter__(self) -> Any:
        for batch in self.batches:
            self.reads += 1
            if self.reads == self.fail_at:
                raise OSError("disk gone")
            yield batch


@pytest.mark.parametrize(
    ("fail_at", "step"),
    [
        (7, 2),  # the second batch of step 2 (epoch 1's first step; epoch 0 dropped its fifth batch)
        (11, 4),  # the first batch of epoch 2, after two dropped partial steps
    ],
)
async def test_data_failed_names_the_step_with_accumulation_and_dropped_partial_steps(fail_at: int, step: int) -> None:
    data = _FailsOnRead(make_batches(5, 8), fail_at)
    with pytest.raises(gsync.DataFailed) as caught, pytest.warns(UserWarning, match="left out"):
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(
            TiedNet(), data, epochs=3, accumulate=2, optimizer=sgd, loss_fn=classification_loss
        )
    assert caught.value.step == step and caught.value.last_step == step - 1


async def test_fault_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="site"):
        gsync.testing.fail(0, 0, "sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        gsync.testing.stall(0, -1, "forward")
    with pytest.raises(ValueError, match="step"):
        gsync.testing.stall(0, -2, "evaluate")
    # Faults that could never fire are refused rather than passing a test that asserted nothing.
    with pytest.raises(TypeError, match="step must be an int"):
        gsync.testing.fail(0, 1.5, "forward")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        gsync.testing.fail(0, True, "forward")
    with pytest.raises(TypeError, match="device must be an int"):
        gsync.testing.fail(0.0, 1, "forward")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for device 2, and this engine has 2 \\(cpu:0, cpu:1\\)"):
        with gsync.testing.inject(gsync.Engine(["cpu:0", "cpu:1"]), gsync.testing.fail(2, 0, "forward")):
            pass


async def test_a_fault_for_any_device_fires_once_though_devices_reach_it_together() -> None:
    for _ in range(20):
        fault = gsync.testing.fail(None, 0, "forward")
        start = threading.Barrier(8)
        claims: list[bool] = []

        def reach(device: int, fault: gsync.testing.Fault = fault, start: threading.Barrier = start) -> None:
            start.wait()
            claims.append(claim(fault, device, 0, "forward"))

        threads = [threading.Thread(target=reach, args=(device,)) for device in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert claims.count(True) == 1


async def test_an_evaluate_before_the_first_step_can_be_made_to_fail(no_leaks: None) -> None:
    # Its step is -1, as the module says: a sanity check before training is testable like any other phase.
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=-1, site="evaluate")):
        with pytest.raises(gsync.WorkerFailed) as caught:
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                await session.evaluate(make_batches(1, 8))
    assert (caught.value.step, caught.value.site, caught.value.device_index) == (-1, "evaluate", 1)


async def test_checkpoint_after_skipped_steps_resumes_exactly(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = Normed()
    batches = make_batches(6, 12)
    for poisoned in (2, 3):
        batches[poisoned][0][7, 0] = float("nan")
    unfailed = await gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip").fit(
        copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss
    )
    assert unfailed.skipped_steps == [2, 3]

    engine = gsync.Engine(["cpu:0", "cpu:1"], on_nonfinite="skip")
    with gsync.testing.inject(engine, gsync.testing.fail(0, 4, "backward")), pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss)
    assert caught.value.last_step == 3  # skipped steps count as consistent
    resumed = await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, resume=caught.value.checkpoint)
    assert_same_state(resumed.model, unfailed.model, atol=1e-6)


async def test_every_gsync_error_pickles_with_its_attributes() -> None:
    import pickle

    errors: list[gsync.GsyncError] = [
        gsync.WorkerFailed("cpu:1", 1, 3, "backward"),
        gsync.SyncFailed(2, 0, "gloo said no"),
        gsync.SyncTimeout(4, 3.0, [("cpu:0", 1)], [2], last_seen={"cpu:0": "step 4, backward"}),
        gsync.NonFiniteLoss("cpu:0", 0, 5, float("inf")),
        gsync.PeerFailed(1, "cpu", 2, "forward", "KeyError", "'x'"),
        gsync.PeerLost([gsync.LostRank(1, 2, "backward", "cpu", 3.2, 0.1)]),
        gsync.DataFailed(7),
        gsync.DataFailed(3, site="evaluate"),
        gsync.SyncFailed(3, None, site="all_reduce"),
        gsync.ConfigError("bad"),
    ]
    for error in errors:
        error.last_step = 1
        error.add_note("a note")
        restored = pickle.loads(pickle.dumps(error))
        assert type(restored) is type(error) and str(restored) == str(error)
        assert restored.__dict__.keys() == error.__dict__.keys()
        assert restored.last_step == 1 and restored.__notes__ == ["a note"]
    assert pickle.loads(pickle.dumps(errors[5])).lost == errors[5].lost


async def test_a_fault_armed_while_a_session_is_open_fires_at_its_next_step(no_leaks: None) -> None:
    # The shape docs/testing.md recommends: a fixture opened the session before the test armed its fault.
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    batches = make_batches(3, 8)
    session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
    try:
        await session.step(batches[0])
        with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=1, site="backward")):
            with pytest.raises(gsync.WorkerFailed) as caught:
                await session.step(batches[1])
    finally:
        await session.aclose()
    assert (caught.value.device_index, caught.value.step, caught.value.site) == (1, 1, "backward")
    assert caught.value.last_step == 0


async def test_a_stall_armed_while_a_session_is_open_stalls_it(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=0.3)
    fault = gsync.testing.stall(device=0, step=0, site="forward")
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
            await session.step(make_batches(1, 8)[0])
    assert fault.reached.is_set() and caught.value.stalled_devices == ("cpu:0",)


async def test_a_fault_disarmed_while_a_session_is_open_no_longer_fires(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    fault = gsync.testing.fail(device=0, step=0, site="forward")
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        with gsync.testing.inject(engine, fault):
            pass
        assert (await session.step(make_batches(1, 8)[0])).step == 0
    assert not fault.reached.is_set()


async def test_a_fault_for_a_step_the_open_session_has_run_is_refused_naming_the_session(no_leaks: None) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        for batch in make_batches(2, 8):
            await session.step(batch)
        with pytest.raises(ValueError, match=r"fault is for step 1, .*opened at .*test_failures\.py:\d+\) is past it, at step 2"):
            with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=1, site="forward")):
                pass
        # An evaluate's step is the last step trained, which the session is still at.
        with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=1, site="evaluate")):
            with pytest.raises(gsync.WorkerFailed):
                await session.evaluate(make_batches(1, 8))


async def test_a_worker_failure_says_its_cause_in_its_message(no_leaks: None) -> None:
    # Services log str(error): a model that returns a tuple must be named there, not only in __cause__.
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(12, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.linear(x), x

    with pytest.raises(gsync.WorkerFailed) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(TwoOutputs(), **fit_args())
    cause = caught.value.__cause__
    assert isinstance(cause, TypeError)
    assert str(caught.value).endswith(f"during forward (its shard: 6 of the batch's 12 rows): TypeError: {cause}")


async def test_data_and_sync_failures_say_their_cause_and_keep_it_across_a_pickle() -> None:
    import pickle

    def broken() -> Any:
        yield from make_batches(1, 8)
        raise OSError("disk gone")

    with pytest.raises(gsync.DataFailed) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(TiedNet(), broken(), optimizer=sgd, loss_fn=classification_loss)
    assert str(caught.value) == "reading the batch of step 1 from data failed: OSError: disk gone"
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)

    failed = gsync.SyncFailed(3, 0)
    failed.__cause__ = RuntimeError("Connection closed by peer")
    assert str(failed) == "all-reduce of bucket 0 failed at step 3: RuntimeError: Connection closed by peer"
    # Not wrapping anything: the message alone, as before.
    assert str(gsync.NonFiniteLoss("cpu:0", 0, 5, float("inf"))).startswith("loss on device cpu:0 at step 5 is inf;")


async def test_a_batchnorm_shard_too_small_names_the_devices_rows(no_leaks: None) -> None:
    # 3 rows over 2 devices: cpu:1's shard has 1 row, which training-mode BatchNorm cannot normalize.
    with pytest.raises(gsync.WorkerFailed) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(
            Normed(), make_batches(2, 3), optimizer=sgd, loss_fn=classification_loss
        )
    error = caught.value
    assert (error.device, error.site, error.shard_rows, error.batch_rows) == ("cpu:1", "forward", 1, 3)
    assert "cpu:1 (index 1) failed at step 0 during forward (its shard: 1 of the batch's 3 rows): ValueError: " in str(error)
    assert "Expected more than 1 value per channel" in str(error)


async def test_the_failures_page_prints_what_the_code_prints(no_leaks: None) -> None:
    from tests.support.paths import ROOT

    page = (ROOT / "docs" / "failures.md").read_text(encoding="utf-8")
    # The printed line the page shows, the comment under its `print(error)`.
    shown = page.split("print(error)\n", 1)[1].splitlines()[0].strip().removeprefix("# ")
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.testing.inject(engine, gsync.testing.fail(1, 5, "backward", error=ValueError("a NaN in layer 3"))):
        with pytest.raises(gsync.WorkerFailed) as caught:
            await engine.fit(TiedNet(), make_batches(8, 32), optimizer=sgd, loss_fn=classification_loss)
    assert str(caught.value) == shown
