"""The sync server and the device actor, each tested alone through its mailbox.

Each test runs one actor in a rig of ``tests/support/step_rig.py`` (real mailboxes, bucket plan,
LocalCollective, HostStreamSync, worker threads) and plays the part of its peers by posting and
reading messages, keeping to the protocol the peers keep. Nothing here waits with a sleep: progress
is observed through messages, and "the server handled everything posted so far" through the rig's
``WatchedMailbox``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gsync
from gsync._core.step.context import Shard
from gsync._core.step.messages import (
    BucketReady,
    Close,
    ForwardDone,
    ServerMessage,
    StepApplied,
    StepDispatched,
    StepLoss,
    StepSynced,
)
from tests.support.step_rig import WAIT_S, actor_rig, make_batch, reference_step, server_rig

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_leaks")]


@pytest.mark.parametrize("grads_in_place", [False, True], ids=["bucket-buffers", "grads-in-place"])
async def test_server_launches_a_bucket_only_once_ready_everywhere_and_strictly_in_bucket_order(
    grads_in_place: bool,
) -> None:
    async with server_rig(grads_in_place=grads_in_place) as rig, anyio.create_task_group() as group:
        group.start_soon(rig.server.run)
        rig.fill(0)
        rig.mailbox.post(StepDispatched(0, (0.25, 0.75), 8))
        rig.mailbox.post(ForwardDone(0, 0, 0.5))
        rig.mailbox.post(ForwardDone(1, 0, 0.25))

        # Bucket 1 is ready on every device before bucket 0 is: it must wait for bucket 0.
        rig.ready(0, 1)
        rig.ready(1, 1)
        await rig.mailbox.settled()
        assert rig.launches() == []
        # Bucket 0 ready on one device only: still nothing to launch.
        rig.ready(1, 0)
        await rig.mailbox.settled()
        assert rig.launches() == []
        assert rig.server.bucket_ready_received == 3
        # Bucket 0 completes: 0 and then the waiting 1 are launched, in that order.
        rig.ready(0, 0)
        await rig.mailbox.settled()
        assert rig.launches() == [0, 1]
        rig.ready(1, 2)
        await rig.mailbox.settled()
        assert rig.launches() == [0, 1]
        rig.ready(0, 2)
        await rig.mailbox.settled()
        assert rig.launches() == [0, 1, 2]

        synced = [await rig.synced(d) for d in range(2)]
        assert [event.bucket for event in rig.trace.select("all_reduce", 0)] == [0, 1, 2]
        assert synced == [StepSynced(0, (), False)] * 2
        # The loss goes to the session once, from the server, not through the devices.
        assert rig.context.session.receive_nowait() == StepLoss(0, 0.75)
        assert rig.context.session.receive_nowait() is None
        rig.mailbox.post(Close())
    assert rig.server.bucket_ready_received == 6
    assert rig.server.steps_synced == 1


@pytest.mark.parametrize("grads_in_place", [False, True], ids=["bucket-buffers", "grads-in-place"])
async def test_server_reduces_to_the_weighted_sum_and_posts_one_step_synced_with_the_agreed_facts(
    grads_in_place: bool,
) -> None:
    weights = [(0.25, 0.75), (0.5, 0.5)]
    async with server_rig(grads_in_place=grads_in_place) as rig, anyio.create_task_group() as group:
        group.start_soon(rig.server.run)
        for step, (w0, w1) in enumerate(weights):
            rig.fill(step)
            expected = [w0 * a + w1 * b for a, b in zip(rig.devices[0].buffers, rig.devices[1].buffers)]
            rig.mailbox.post(StepDispatched(step, (w0, w1), 8, last=step == len(weights) - 1))
            # Step 1: device 1's loss was not finite (on_nonfinite="skip"): every device skips,
            # though device 0, reporting after it, did not.
            rig.mailbox.post(ForwardDone(1, step, 1.25, skip=step == 1))
            rig.mailbox.post(ForwardDone(0, step, 0.375))
            # Parameter 1 (bucket 1) got no gradient on either device; parameter 2 (bucket 1)
            # and parameter 0 (bucket 2) only on one of them.
            rig.ready(1, 2, step, unused=())
            rig.ready(0, 2, step, unused=(0,))
            rig.ready(0, 1, step, unused=(2, 1))
            rig.ready(1, 0, step)
            rig.ready(0, 0, step)
            rig.ready(1, 1, step, unused=(1,))

            synced = [await rig.synced(d) for d in range(2)]
            assert synced == [StepSynced(step, unused=(1,), skip=step == 1)] * 2
            assert rig.context.session.receive_nowait() == StepLoss(step, 0.375 + 1.25)
            for device in rig.devices:
                for bucket, (buffer, want) in enumerate(zip(device.buffers, expected)):
                    torch.testing.assert_close(buffer, want, rtol=0, atol=1e-5, msg=lambda m, b=bucket: f"bucket {b}: {m}")
            assert rig.server.bucket_ready_received == 6 * (step + 1)
            plan = rig.context.plan
            assert rig.server.reduced_bytes == (step + 1) * sum(b.nbytes for b in plan.buckets) == (step + 1) * 32
            assert rig.server.steps_synced == step + 1
        rig.mailbox.post(Close())
        # Exactly one StepSynced per device and step: the next message each device gets is the Close.
        for device in rig.devices:
            with anyio.fail_after(WAIT_S):
                assert await device.mailbox.receive() == Close("end of data")
    assert rig.server.skipped_steps == [1]
    assert [e.bucket for e in rig.trace.select("all_reduce")] == [0, 1, 2, 0, 1, 2]
    assert [rig.streams.rounds_applied(d) for d in range(2)] == [2, 2]


async def test_server_close_closes_every_device_and_returns() -> None:
    async with server_rig() as rig:
        rig.mailbox.post(Close())
        with anyio.fail_after(WAIT_S):
            await rig.server.run()
        assert rig.mailbox.closed
        for device in rig.devices:
            assert await device.mailbox.receive() == Close("end of data")
        assert rig.launches() == []
        with pytest.raises(gsync.MailboxClosed):
            rig.mailbox.post(StepDispatched(0, (0.5, 0.5), 8))


async def test_server_close_during_a_step_waits_for_that_step_to_sync() -> None:
    async with server_rig() as rig:
        rig.fill(0)
        rig.mailbox.post(StepDispatched(0, (0.5, 0.5), 8))
        rig.mailbox.post(Close())
        for device in range(2):
            rig.mailbox.post(ForwardDone(device, 0, 0.5))
            for bucket in range(3):
                rig.ready(device, bucket)
        with anyio.fail_after(WAIT_S):
            await rig.server.run()
        for device in rig.devices:
            assert await device.mailbox.receive() == StepSynced(0, (), False)
            assert await device.mailbox.receive() == Close("end of data")
        assert rig.server.steps_synced == 1


@pytest.mark.parametrize(
    ("messages", "step"),
    [
        pytest.param([StepDispatched(0, (0.5, 0.5), 8), BucketReady(0, 1, 0)], 0, id="bucket-ready-for-another-step"),
        pytest.param([StepDispatched(0, (0.5, 0.5), 8), ForwardDone(1, 3, 0.5)], 0, id="forward-done-for-another-step"),
        pytest.param([BucketReady(0, 0, 0)], -1, id="bucket-ready-outside-any-step"),
    ],
)
async def test_server_raises_sync_failed_on_a_protocol_error(messages: list[ServerMessage], step: int) -> None:
    async with server_rig() as rig:
        for message in messages:
            rig.mailbox.post(message)
        with anyio.fail_after(WAIT_S), pytest.raises(gsync.SyncFailed, match="protocol error") as caught:
            await rig.server.run()
        assert caught.value.step == step
        assert caught.value.bucket is None
        assert repr(messages[-1]) in str(caught.value)
        assert rig.launches() == []
        assert rig.mailbox.closed


async def test_a_hung_reduction_times_out_naming_only_the_buckets_not_reduced() -> None:
    # Bucket 0 finishes; bucket 1's collective hangs. Only a step's last reduction reports its
    # success, so bucket 0's completion never reached the server, yet it is not blamed.
    calls: list[int] = []
    released = threading.Event()

    def hang_second_reduction(device: int, step: int, site: str, abort: threading.Event) -> None:
        calls.append(step)
        if len(calls) == 2:
            released.wait(WAIT_S)

    async with server_rig(sync_timeout=1.0, site_hooks=(hang_second_reduction,)) as rig:
        try:
            rig.start_step_with_every_loss()
            for device in range(2):
                for bucket in range(3):
                    rig.ready(device, bucket)
            with anyio.fail_after(WAIT_S), pytest.raises(gsync.SyncTimeout) as caught:
                await rig.server.run()
            assert caught.value.unreduced == (1, 2)
            assert caught.value.missing == ()
        finally:
            released.set()


async def test_server_stall_raises_sync_timeout_naming_the_missing_device_and_bucket() -> None:
    async with server_rig(sync_timeout=0.2) as rig:
        rig.start_step_with_every_loss()
        # fake:1 never posts bucket 2.
        for device, bucket in [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]:
            rig.ready(device, bucket)
        with anyio.fail_after(WAIT_S), pytest.raises(gsync.SyncTimeout) as caught:
            await rig.server.run()
        error = caught.value
        assert isinstance(error, TimeoutError)
        assert error.step == 0
        assert error.timeout == 0.2
        assert error.missing == (("fake:1", 2),)
        assert error.site == "gradient sync"
        assert error.stalled_devices == ("fake:1",)
        assert error.last_seen == {"fake:1": "fake 1, backward"}
        assert set(error.unreduced) <= {0, 1}
        assert rig.launches() == [0, 1]
        assert rig.server.bucket_ready_received == 5
        for device in rig.devices:
            device.mailbox.close()
            with pytest.raises(gsync.MailboxClosed):
                await device.mailbox.receive()  # no StepSynced went out


# -- B) the device actor ----------------------------------------------------------------------------------------------


async def test_actor_posts_one_bucket_ready_per_bucket_then_its_loss_and_applies_the_synced_step() -> None:
    batch = make_batch(4, seed=1)
    async with actor_rig() as rig, anyio.create_task_group() as group:
        actor = rig.actor
        ref_loss, ref_grads = reference_step(rig.initial, batch)
        group.start_soon(actor.run)
        rig.shards.post(Shard(step=0, rows=(4,), total_rows=(8,), data=(batch,)))

        readies = [await rig.next_server_message() for _ in rig.context.plan.buckets]
        assert all(isinstance(m, BucketReady) for m in readies), readies
        # The loss is read once backward is launched (no host sync between them), so it comes last.
        assert await rig.next_server_message() == ForwardDone(device=0, step=0, loss=ref_loss * 4 / 8, skip=False)
        assert sorted(m.bucket for m in readies) == [0, 1]  # type: ignore[union-attr]
        assert all((m.device, m.step, m.unused) == (0, 0, ()) for m in readies)  # type: ignore[union-attr]

        # One batch: the bucket holds the plain shard gradient; the reduction applies the weight.
        for position, want in enumerate(ref_grads):
            torch.testing.assert_close(actor.grads.views[position], want, rtol=0, atol=1e-7)
        rig.reduce([m.bucket for m in readies])  # type: ignore[union-attr]
        grads = [view.clone() for view in actor.grads.views]
        before = [p.detach().clone() for p in actor.params]

        actor.mailbox.post(StepSynced(0, (), False))
        with anyio.fail_after(WAIT_S):
            applied = await rig.session.receive()
        assert applied == StepApplied(device=0, step=0, lr=rig.lr, grad_norm=None, skipped=False, lrs=(rig.lr,))
        for param, old, grad in zip(actor.params, before, grads):
            assert torch.equal(param.detach(), old.add(grad, alpha=-rig.lr))
        assert actor.applied_step == 0
        assert rig.context.streams.rounds_applied(0) == 1  # type: ignore[attr-defined]

        rig.shards.close()
        actor.mailbox.post(Close())
    assert await rig.remaining_server_messages() == []


@pytest.mark.parametrize("rows", [(4, 4), (4, 2)], ids=["equal-batches", "unequal-batches"])
async def test_actor_accumulates_several_batches_and_posts_each_bucket_once(rows: tuple[int, int]) -> None:
    batches = (make_batch(rows[0], seed=2), make_batch(rows[1], seed=3))
    total = (8, 8)
    shard = Shard(step=0, rows=rows, total_rows=total, data=batches)
    async with actor_rig() as rig, anyio.create_task_group() as group:
        actor = rig.actor
        references = [reference_step(rig.initial, batch) for batch in batches]
        shares = [r / t / len(rows) for r, t in zip(rows, total)]
        group.start_soon(actor.run)
        rig.shards.post(shard)

        readies = [await rig.next_server_message() for _ in rig.context.plan.buckets]
        assert sorted(m.bucket for m in readies if isinstance(m, BucketReady)) == [0, 1]
        first = await rig.next_server_message()
        assert isinstance(first, ForwardDone)
        assert (first.device, first.step, first.skip) == (0, 0, False)
        assert first.loss == pytest.approx(sum(share * loss for share, (loss, _) in zip(shares, references)), rel=1e-12)

        # The bucket holds the device's weighted mean gradient over the batches, divided by
        # its weight (the reduction multiplies it back).
        assert shard.weight == pytest.approx(sum(shares))
        for position in range(len(actor.params)):
            want = sum(share * grads[position] for share, (_, grads) in zip(shares, references)) / shard.weight
            torch.testing.assert_close(actor.grads.views[position], want, rtol=1e-6, atol=1e-7)

        rig.reduce([m.bucket for m in readies])  # type: ignore[union-attr]
        actor.mailbox.post(StepSynced(0, (), False))
        with anyio.fail_after(WAIT_S):
            applied = await rig.session.receive()
        assert applied == StepApplied(0, 0, rig.lr, lrs=(rig.lr,))
        rig.shards.close()
        actor.mailbox.post(Close())
    # Only the last backward posts: nothing but ForwardDone and one BucketReady per bucket went out.
    assert await rig.remaining_server_messages() == []


def bias_only_in_big_batches(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The bias takes part only in batches of more than 2 rows; smaller batches give it no gradient."""
    x, y = batch
    assert isinstance(model, nn.Linear)
    out = model(x) if x.shape[0] > 2 else x @ model.weight.T
    return F.mse_loss(out, y)


async def test_actor_updates_a_parameter_that_got_a_gradient_only_in_an_earlier_batch_of_the_step() -> None:
    rows, total = (4, 2), (8, 8)
    batches = (make_batch(rows[0], seed=6), make_batch(rows[1], seed=7))
    shard = Shard(step=0, rows=rows, total_rows=total, data=batches)
    async with actor_rig(loss_fn=bias_only_in_big_batches) as rig, anyio.create_task_group() as group:
        actor = rig.actor
        references = [reference_step(rig.initial, batch, bias_only_in_big_batches) for batch in batches]
        assert torch.count_nonzero(references[1][1][1]) == 0  # the last batch gives the bias no gradient
        shares = [r / t / len(rows) for r, t in zip(rows, total)]
        group.start_soon(actor.run)
        rig.shards.post(shard)
        messages = [await rig.next_server_message() for _ in range(3)]
        assert isinstance(messages[2], ForwardDone)
        readies = {m.bucket: m for m in messages[:2] if isinstance(m, BucketReady)}
        # The bias (bucket 0) got a gradient in the step, so it is not unused.
        assert sorted(readies) == [0, 1] and readies[0].unused == () and readies[1].unused == ()

        wants = [
            sum(share * grads[position] for share, (_, grads) in zip(shares, references)) / shard.weight
            for position in range(len(actor.params))
        ]
        for view, want in zip(actor.grads.views, wants):
            torch.testing.assert_close(view, want, rtol=1e-6, atol=1e-7)
        rig.reduce(sorted(readies))
        before = [p.detach().clone() for p in actor.params]
        actor.mailbox.post(StepSynced(0, (), False))
        with anyio.fail_after(WAIT_S):
            assert await rig.session.receive() == StepApplied(0, 0, rig.lr, lrs=(rig.lr,))
        for name, param, old, want in zip(("weight", "bias"), actor.params, before, wants):
            torch.testing.assert_close(param.detach(), old - rig.lr * want, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        rig.shards.close()
        actor.mailbox.post(Close())


async def test_actor_skips_a_step_the_server_says_to_skip() -> None:
    batch = make_batch(4, seed=4)
    async with actor_rig() as rig, anyio.create_task_group() as group:
        actor = rig.actor
        before = [p.detach().clone() for p in actor.params]
        group.start_soon(actor.run)
        rig.shards.post(Shard(0, (4,), (8,), (batch,)))
        messages = [await rig.next_server_message() for _ in range(3)]
        assert isinstance(messages[2], ForwardDone)
        rig.reduce([m.bucket for m in messages[:2]])  # type: ignore[union-attr]
        actor.mailbox.post(StepSynced(0, (), True))
        with anyio.fail_after(WAIT_S):
            applied = await rig.session.receive()
        assert applied == StepApplied(0, 0, rig.lr, None, skipped=True, lrs=(rig.lr,))
        for param, old in zip(actor.params, before):
            assert torch.equal(param.detach(), old)
        rig.shards.close()
        actor.mailbox.post(Close())


async def test_actor_wraps_a_loss_fn_error_in_worker_failed() -> None:
    boom = RuntimeError("boom")

    def failing_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        raise boom

    async with actor_rig(loss_fn=failing_loss) as rig:
        rig.shards.post(Shard(0, (4,), (8,), (make_batch(4, seed=5),)))
        with anyio.fail_after(WAIT_S), pytest.raises(gsync.WorkerFailed) as caught:
            await rig.actor.run()
        error = caught.value
        assert (error.site, error.step, error.device, error.device_index) == ("forward", 0, "cpu:0", 0)
        assert error.__cause__ is boom
        assert rig.actor.failure is error
        assert rig.context.abort.is_set()
        assert await rig.remaining_server_messages() == []


async def test_a_timeout_counts_the_posts_that_did_not_wake_the_server() -> None:
    # Device 0 posts every bucket from its thread without waking the server (device 1 never
    # completes them); the timeout must still see them as arrived and name only device 1.
    async with server_rig(sync_timeout=0.3) as rig:
        rig.start_step_with_every_loss()

        def device_0_hooks() -> None:
            for bucket in range(3):
                rig.streams.mark_ready(0, bucket)
                rig.mailbox.post_threadsafe(BucketReady(0, 0, bucket), wake=False)

        async def device_0_posts_once_the_server_waits() -> None:
            await anyio.wait_all_tasks_blocked()
            poster = threading.Thread(target=device_0_hooks)
            poster.start()
            poster.join()

        async with anyio.create_task_group() as group:
            group.start_soon(device_0_posts_once_the_server_waits)
            with anyio.fail_after(WAIT_S), pytest.raises(gsync.SyncTimeout) as caught:
                await rig.server.run()
        error = caught.value
        assert {device for device, _ in error.missing} == {"fake:1"}
        assert sorted(bucket for _, bucket in error.missing) == [0, 1, 2]


async def test_from_the_moment_a_step_is_past_its_deadline_nothing_more_is_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The last readiness is posted, and then, before the server has read it, the step's deadline passes (on a
    # busy loop both land in one turn): the server reads it only after the deadline, so it counts as arrived in
    # the report, and bucket 2 is not launched. The test passes the deadline itself, so no clock decides.
    async with server_rig() as rig:
        deadlines: list[Callable[[], object]] = []

        def hold_the_deadline(delay: float, callback: Callable[..., object], *args: object) -> Callable[[], None]:
            deadlines.append(functools.partial(callback, *args))
            return lambda: None

        monkeypatch.setattr(rig.context.loop, "call_later", hold_the_deadline)
        rig.start_step_with_every_loss()
        for device, bucket in [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]:
            rig.ready(device, bucket)

        async def post_the_last_readiness_then_pass_the_deadline() -> None:
            await anyio.wait_all_tasks_blocked()  # the server waits, its deadline set
            assert len(deadlines) == 1
            rig.ready(1, 2)
            deadlines[0]()

        async with anyio.create_task_group() as group:
            group.start_soon(post_the_last_readiness_then_pass_the_deadline)
            with anyio.fail_after(WAIT_S), pytest.raises(gsync.SyncTimeout) as caught:
                await rig.server.run()
        assert rig.launches() == [0, 1]
        assert caught.value.missing == ()
        assert 2 not in caught.value.unreduced
