from __future__ import annotations

import threading

import anyio
import msgspec
import pytest

import gsync
from gsync._threads import LoopHandle
from gsync.mailbox import Mailbox
from gsync.messages import BucketReady, Close, DeviceMessage, ServerMessage, StepDispatched, StepSynced

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
