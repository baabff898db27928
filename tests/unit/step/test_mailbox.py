from __future__ import annotations

import threading

import anyio
import msgspec
import pytest

import gsync
from gsync._core.threads import LoopHandle
from gsync._core.step.mailbox import Mailbox
from gsync._core.step.messages import BucketReady, Close, DeviceMessage, ServerMessage, StepDispatched, StepSynced

@pytest.mark.asyncio
async def test_messages_arrive_in_order_from_loop_and_threads() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    box.post(StepDispatched(0, (4, 4), 8))
    poster = threading.Thread(target=lambda: [box.post_threadsafe(BucketReady(0, 0, b)) for b in range(3)])
    poster.start()
    poster.join()
    received = [await box.receive() for _ in range(4)]
    assert received == [StepDispatched(0, (4, 4), 8)] + [BucketReady(0, 0, b) for b in range(3)]
    box.discard()


@pytest.mark.asyncio
async def test_posting_after_close_raises_typed_error_in_the_poster() -> None:
    box: Mailbox[DeviceMessage] = Mailbox("device cpu:0", LoopHandle())
    box.post(Close())
    box.close()
    assert await box.receive() == Close()
    with pytest.raises(gsync.MailboxClosed, match="device cpu:0"):
        box.post(StepSynced(0))
    errors: list[BaseException] = []

    def post_from_thread() -> None:
        try:
            box.post_threadsafe(StepSynced(1))
        except gsync.MailboxClosed as error:
            errors.append(error)

    thread = threading.Thread(target=post_from_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and errors[0].message == StepSynced(1)
    assert box.try_post(StepSynced(2)) is False
    box.discard()


@pytest.mark.asyncio
async def test_reading_a_closed_drained_mailbox_raises_instead_of_hanging() -> None:
    box: Mailbox[DeviceMessage] = Mailbox("device cpu:1", LoopHandle())
    box.close()
    with anyio.fail_after(1), pytest.raises(gsync.MailboxClosed):
        await box.receive()
    box.discard()


def test_messages_encode_as_tagged_msgpack() -> None:
    decoder = msgspec.msgpack.Decoder(ServerMessage)
    for message in (StepDispatched(3, (2, 1), 3), BucketReady(1, 3, 2, (5, 7)), Close("done")):
        assert decoder.decode(msgspec.msgpack.encode(message)) == message
    with pytest.raises(AttributeError):
        BucketReady(0, 0, 0).step = 1  # type: ignore[misc]


@pytest.mark.asyncio
async def test_a_burst_of_queued_messages_is_read_in_one_loop_iteration() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    for bucket in range(100):
        box.post(BucketReady(0, 0, bucket))
    other_ran = anyio.Event()

    async def other() -> None:
        other_ran.set()

    async def late_post() -> None:
        box.post(Close("later"))

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(other)
            # Queued messages are taken without yielding: the other task has not run yet.
            received = [await box.receive() for _ in range(100)]
            assert not other_ran.is_set()
            # An empty mailbox yields while it waits (the other tasks run, one posts).
            group.start_soon(late_post)
            with anyio.fail_after(5):
                assert await box.receive() == Close("later")
            assert other_ran.is_set()
    finally:
        box.discard()
    assert [m.bucket for m in received] == list(range(100))  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_messages_a_thread_posted_are_read_before_the_loop_runs_their_drain() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    poster = threading.Thread(target=lambda: [box.post_threadsafe(BucketReady(d, 0, 0)) for d in range(3)])
    poster.start()
    poster.join()
    other_ran = anyio.Event()

    async def other() -> None:
        other_ran.set()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(other)
            received = [await box.receive() for _ in range(3)]
            # Taken at once: no loop iteration (which would run the other task and the drain) came between.
            assert not other_ran.is_set()
    finally:
        box.discard()
    assert [m.device for m in received] == [0, 1, 2]  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_closing_wakes_a_reader_waiting_on_an_empty_mailbox() -> None:
    box: Mailbox[DeviceMessage] = Mailbox("device cpu:0", LoopHandle())
    outcome: list[BaseException] = []

    async def reader() -> None:
        try:
            await box.receive()
        except gsync.MailboxClosed as error:
            outcome.append(error)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            box.close()
    assert len(outcome) == 1


@pytest.mark.asyncio
async def test_a_cancelled_read_loses_no_message() -> None:
    box: Mailbox[DeviceMessage] = Mailbox("device cpu:0", LoopHandle())
    with anyio.move_on_after(0.01):
        await box.receive()
    box.post(StepSynced(3))
    with anyio.fail_after(5):
        assert await box.receive() == StepSynced(3)
    box.discard()


@pytest.mark.asyncio
async def test_posts_that_do_not_wake_the_loop_arrive_in_order_with_the_next_that_does() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    woken = anyio.Event()
    received: list[ServerMessage] = []

    async def reader() -> None:
        for _ in range(3):
            received.append(await box.receive())
        woken.set()

    def quiet_then_waking() -> None:
        box.post_threadsafe(BucketReady(0, 0, 0), wake=False)
        box.post_threadsafe(BucketReady(1, 0, 0), wake=False)
        box.post_threadsafe(BucketReady(2, 0, 0))

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(reader)
                await anyio.wait_all_tasks_blocked()
                thread = threading.Thread(target=quiet_then_waking)
                thread.start()
                thread.join()
                await woken.wait()
    finally:
        box.discard()
    assert [m.device for m in received] == [0, 1, 2]  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_wake_delivers_quiet_posts_and_nothing_wakes_the_loop_without_it() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    received: list[ServerMessage] = []

    async def reader() -> None:
        received.append(await box.receive())

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(reader)
                await anyio.wait_all_tasks_blocked()
                thread = threading.Thread(target=lambda: box.post_threadsafe(BucketReady(0, 0, 1), wake=False))
                thread.start()
                thread.join()
                # No wake-up was scheduled: the reader still sleeps.
                await anyio.wait_all_tasks_blocked()
                assert received == []
                thread = threading.Thread(target=box.wake)
                thread.start()
                thread.join()
    finally:
        box.discard()
    assert received == [BucketReady(0, 0, 1)]


@pytest.mark.asyncio
async def test_closing_keeps_what_threads_posted_for_the_reader() -> None:
    box: Mailbox[ServerMessage] = Mailbox("server", LoopHandle())
    thread = threading.Thread(target=lambda: box.post_threadsafe(BucketReady(0, 0, 2), wake=False))
    thread.start()
    thread.join()
    box.close()
    with anyio.fail_after(5):
        assert await box.receive() == BucketReady(0, 0, 2)
        with pytest.raises(gsync.MailboxClosed):
            await box.receive()
    box.discard()
