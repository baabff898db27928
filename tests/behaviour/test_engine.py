"""Lifecycle, messaging and bucketing contracts of one fit."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable

import anyio
import pytest
import torch
from torch import nn

import gsync
from gsync._core.step.messages import BucketReady, ForwardDone
from gsync_pytest import gsync_threads
from tests.support.gates import BackwardGate, CancelAfterStep
from tests.support.inside import ServerPost, server_of, watch_mailboxes
from tests.support.models import Deep, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.tasks import assert_no_tasks_left

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("num_devices", [1, 2, 3])
async def test_one_bucket_ready_message_per_device_and_bucket(num_devices: int) -> None:
    engine = gsync.Engine([f"cpu:{i}" for i in range(num_devices)], first_bucket_mb=0.01, bucket_cap_mb=0.02)
    result = await engine.fit(Deep(), make_batches(4, 12), optimizer=sgd, loss_fn=classification_loss)
    assert result.stats.buckets >= 3
    assert result.stats.steps == 4
    assert result.stats.bucket_ready_messages == 4 * num_devices * result.stats.buckets


async def test_the_sync_server_wakes_once_per_bucket_not_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the post that completes a bucket, or the step's losses, on every device may wake the server; the rest
    # ride along. What the last device posts after its backward returns (the last bucket, which has no hook once
    # the plan is final, and its losses) wakes the server once, when its job ends. On a shared thread (the CPU
    # default, stated here) the last device is the same for both; with a thread per device it need not be.
    may_wake = 0

    def counted_post(owner: str, message: object, wake: bool) -> None:
        nonlocal may_wake
        if owner == "sync server" and isinstance(message, (BucketReady, ForwardDone)) and wake:
            may_wake += 1

    def counted_wake(owner: str) -> None:
        nonlocal may_wake
        if owner == "sync server":
            may_wake += 1

    watch_mailboxes(monkeypatch, post_threadsafe=counted_post, wake=counted_wake)
    num_devices, steps = 4, 6
    engine = gsync.Engine(
        [f"cpu:{i}" for i in range(num_devices)], first_bucket_mb=0.01, bucket_cap_mb=0.02, device_threads="shared"
    )
    result = await engine.fit(Deep(), make_batches(steps, 16), optimizer=sgd, loss_fn=classification_loss)
    buckets = result.stats.buckets
    assert buckets >= 3
    assert result.stats.bucket_ready_messages == steps * num_devices * buckets
    # The first step hooks every bucket (its gradients' order is observed) and wakes once more for its losses;
    # each later step wakes for its buckets but the last, and once as the last device's job ends.
    assert may_wake == (buckets + 1) + (steps - 1) * buckets


def wide() -> nn.Module:
    """Tensors of 177 KiB on average: large enough for the in-process reduction to take them in place."""
    return nn.Sequential(nn.Linear(12, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 5))


@pytest.mark.parametrize(
    ("make_model", "accumulate", "in_place"),
    [(wide, 1, True), (wide, 2, False), (Deep, 1, False)],
    ids=["large-tensors", "large-tensors-accumulated", "small-tensors"],
)
async def test_where_gradients_live_between_steps_in_one_process(
    make_model: Callable[[], nn.Module], accumulate: int, in_place: bool
) -> None:
    """In one process on CPU the reduction takes each replica's gradients where autograd put them: no copy.

    A step that accumulates forms its gradients in the bucket buffers, and ``.grad`` are views into them; so
    are the gradients of a bucket of small tensors, where one kernel over the buffer beats one per tensor.
    """
    storages: list[set[int]] = []

    def loss_fn(replica: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        storages.append({p.grad.untyped_storage().data_ptr() for p in replica.parameters() if p.grad is not None})
        return classification_loss(replica, batch)

    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=25)  # one bucket
    result = await engine.fit(
        make_model(), make_batches(3 * accumulate, 12), optimizer=sgd, loss_fn=loss_fn, accumulate=accumulate
    )
    assert result.stats.buckets == 1
    # Every call after step 0 (whose first calls see no gradients yet).
    after_a_step = [ptrs for ptrs in storages[2 * accumulate :] if ptrs]
    assert len(after_a_step) == 4 * accumulate
    if in_place:
        params = len(list(make_model().parameters()))
        assert all(len(ptrs) == params for ptrs in after_a_step)  # one tensor of autograd's per parameter
    else:
        assert all(len(ptrs) == 1 for ptrs in after_a_step)  # views into one bucket buffer
        assert len({ptr for ptrs in after_a_step for ptr in ptrs}) == 2  # one buffer per replica, reused


async def test_reductions_start_during_backward_in_bucket_order() -> None:
    """The input layer's backward (the last to run) waits until bucket 0 was reduced.

    If reductions only started after backward returned, this would time out.
    At step 1: the first step runs its devices in turn (FirstStepInTurn), so
    there a device's backward cannot wait for the other device's buckets. Each device in its own thread: on
    one shared thread a device's backward would wait for a peer that cannot run until it returns.
    """
    gate = BackwardGate(step=1, reductions=1)  # bucket 0's, as reductions run in bucket order
    gate.armed = True

    class Gated(Deep):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = gate.hold(torch.relu(self.layers[0](x)))
            for layer in self.layers[1:]:
                x = torch.relu(layer(x))
            return self.head(x)

    engine = gsync.Engine(
        ["cpu:0", "cpu:1"], first_bucket_mb=0.01, bucket_cap_mb=0.02, trace=gate.trace, device_threads="per_device"
    )
    result = await engine.fit(Gated(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)

    assert result.trace is not None
    reductions = result.trace.select("all_reduce", 1)
    assert [e.bucket for e in reductions] == list(range(result.stats.buckets))
    starts = [e.start_us for e in reductions]
    assert starts == sorted(starts)
    assert reductions[0].end_us < min(e.end_us for e in result.trace.select("backward", 1))


async def test_nothing_left_running_after_fit_and_fit_twice(no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    first, second = make_batches(3, 16, seed=1), make_batches(2, 16, seed=2)
    expected_model, _ = train_reference(model, first)
    expected_model, _ = train_reference(expected_model, second)

    engine = gsync.Engine(["cpu:0", "cpu:1"])
    await engine.fit(model, first, optimizer=sgd, loss_fn=classification_loss)
    assert gsync_threads() == []
    assert_no_tasks_left()
    await engine.fit(model, second, optimizer=sgd, loss_fn=classification_loss)
    assert gsync_threads() == []
    assert_no_tasks_left()
    assert_same_state(model, expected_model)


async def test_generator_data_is_read_off_the_loop(no_leaks: None) -> None:
    loop_thread = threading.get_ident()
    reader_threads: set[int] = set()

    def generate():
        for batch in make_batches(3, 8):
            reader_threads.add(threading.get_ident())
            yield batch

    result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(TiedNet(), generate(), optimizer=sgd, loss_fn=classification_loss)
    assert len(result.losses) == 3
    assert reader_threads and loop_thread not in reader_threads


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order: "shards of step N" as the session posts step N's shard to cpu:0, and what a test
    adds."""
    recorded: list[str] = []

    def recorded_post(owner: str, message: object) -> None:
        if owner == "shards of cpu:0":
            recorded.append(f"shards of step {message.step}")  # type: ignore[attr-defined]

    watch_mailboxes(monkeypatch, post=recorded_post)
    return recorded


async def test_a_step_whose_batch_is_already_read_starts_without_a_turn_of_the_loop(events: list[str]) -> None:
    # Between two steps every device waits: fit hands out the next step's shards in the same turn of the event
    # loop in which the previous step's on_step_end returned. A callback that turn schedules runs after them.
    class NextTurn:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            asyncio.get_running_loop().call_soon(events.append, f"turn after step {result.step}")

    steps = 4
    await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        TiedNet(), make_batches(steps, 8), optimizer=sgd, loss_fn=classification_loss, callbacks=[NextTurn()]
    )
    for step in range(steps - 1):
        assert events.index(f"shards of step {step + 1}") < events.index(f"turn after step {step}")
    assert events.count("shards of step 0") == 1


@pytest.mark.parametrize(
    ("device_threads", "names"),
    [("shared", {"gsync-devices"}), ("per_device", {"gsync-device-0", "gsync-device-1"})],
)
async def test_forward_backward_and_step_run_off_the_event_loop(device_threads: str, names: set[str]) -> None:
    loop_thread = threading.get_ident()
    threads: set[int] = set()
    seen: set[str] = set()

    def loss_fn(replica: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        threads.add(threading.get_ident())
        seen.add(threading.current_thread().name)
        return classification_loss(replica, batch)

    engine = gsync.Engine(["cpu:0", "cpu:1"], device_threads=device_threads)  # type: ignore[arg-type]
    await engine.fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=loss_fn)
    assert seen == names and len(threads) == len(names) and loop_thread not in threads


async def test_worker_exception_surfaces_as_worker_failed(no_leaks: None) -> None:
    model = TiedNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_fn(replica: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if batch[0].shape[0] == 5:  # only device 1 of 2 gets 5 rows of a 11-row batch
            raise RuntimeError("boom on device 1")
        return classification_loss(replica, batch)

    with pytest.raises(gsync.WorkerFailed) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(model, make_batches(2, 11), optimizer=sgd, loss_fn=loss_fn)
    error = caught.value
    assert (error.device, error.device_index, error.step, error.site) == ("cpu:1", 1, 0, "forward")
    assert isinstance(error.__cause__, RuntimeError) and "boom on device 1" in str(error.__cause__)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class RegisteredBackwards(nn.Module):
    """Registered head first, so reverse registration order is the reverse of backward's order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 5)
        self.middle = nn.Linear(64, 64)
        self.stem = nn.Linear(12, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.middle(torch.relu(self.stem(x)))))


async def test_buckets_are_rebuilt_once_from_the_observed_gradient_order() -> None:
    torch.manual_seed(0)
    model = RegisteredBackwards()
    batches = make_batches(4, 16)
    expected_model, expected_losses = train_reference(model, batches)

    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.001, bucket_cap_mb=0.02)
    result = await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss)

    assert result.stats.rebuilt_buckets
    # Backward reaches the head first, so after the rebuild the head is in bucket 0 and the stem last.
    assert result.stats.bucket_params[0][0].startswith("head.")
    assert result.stats.bucket_params[-1][-1].startswith("stem.")
    assert_same_state(model, expected_model)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected_losses), atol=2e-5, rtol=0)


async def test_plan_is_kept_when_backward_already_follows_it() -> None:
    result = await gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.01, bucket_cap_mb=0.02).fit(
        Deep(), make_batches(3, 12), optimizer=sgd, loss_fn=classification_loss
    )
    assert not result.stats.rebuilt_buckets


async def test_a_callback_that_cancels_the_fit_between_steps_starts_no_further_step(events: list[str]) -> None:
    # Taking a batch already read is not a turn of the loop, but a cancellation already requested is still seen
    # before the next step starts.
    with anyio.CancelScope() as scope:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(
            TiedNet(), make_batches(5, 8), optimizer=sgd, loss_fn=classification_loss, callbacks=[CancelAfterStep(scope, 1)]
        )
    assert scope.cancelled_caught
    assert events == ["shards of step 0", "shards of step 1"]


async def test_a_deadline_whose_step_already_synced_is_ignored() -> None:
    # A step's deadline is a timer that posts StepDeadline to the sync server; one that fired just as its step
    # synced is read later: between steps, or during the next step.
    server_box: list[ServerPost] = []
    steps = 4

    class StaleDeadlines:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            server = server_of(session)
            server_box[:] = [server]
            server.deadline(result.step)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if server_box:  # from a device thread, during the next step
            server_box[0].deadline_from_a_thread(0)
        return classification_loss(model, batch)

    model = TiedNet()
    batches = make_batches(steps, 8)
    result = await gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=60).fit(
        model, batches, optimizer=sgd, loss_fn=loss_fn, callbacks=[StaleDeadlines()]
    )
    assert len(result.losses) == steps and result.skipped_steps == []


SECOND_OF_IMPORTS = """
import asyncio, sys, torch, gsync
seen = []

def optimizer(params):
    seen.append("torch._dynamo" in sys.modules)
    return torch.optim.SGD(params, lr=0.1)

async def main():
    model = torch.nn.Linear(4, 2)
    async with gsync.Engine(["cpu"]).session(model, optimizer=optimizer, loss_fn=lambda m, b: m(b).sum()) as session:
        await session.step(torch.ones(8, 4))
    print(seen)

asyncio.run(main())
"""


@pytest.mark.timeout(120)
async def test_the_first_optimizer_of_a_process_is_built_without_a_second_of_imports_on_the_event_loop() -> None:
    # torch.optim's first optimizer imports torch._dynamo (about a second): the user's factory runs on the loop,
    # so the session makes that import in its copying thread first. A fresh interpreter, since this one has it.
    done = await anyio.run_process([sys.executable, "-c", SECOND_OF_IMPORTS], check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "[True]"
