"""Typed mailboxes: how messages reach an actor.

A mailbox is an unbounded FIFO of one message union. Posting never blocks:
the protocol bounds what is in flight (devices x buckets messages per step),
so backpressure would only add latency. Messages posted from a worker thread
or a gradient hook are appended on the event loop, in posting order.

Closing is explicit. ``close()`` is called by the owner after it has received
``Close``; posting afterwards raises :class:`~gsync.MailboxClosed` in the
poster, and a reader of a closed, drained mailbox gets the same error instead
of waiting forever. Nothing is ever dropped under a reader that is still
reading.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

from ..threads import LoopEvent, LoopHandle
from ...errors import MailboxClosed

M = TypeVar("M")

__all__ = ("Mailbox",)


class Mailbox(Generic[M]):
    def __init__(self, owner: str, loop: LoopHandle) -> None:
        self.owner = owner
        self._loop = loop
        self._queue: deque[M] = deque()
        # The reader's wake-up while it waits on an empty mailbox; set by the next post or close.
        self._waiter: LoopEvent | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._from_threads: list[M] = []
        self._drain_scheduled = False

    @property
    def closed(self) -> bool:
        return self._closed

    def post(self, message: M) -> None:
        """Deliver ``message`` now. Call from the event loop.

        :raises ~gsync.MailboxClosed: if the mailbox was closed.
        """
        if self._closed:
            raise MailboxClosed(self.owner, message)
        self._queue.append(message)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def try_post(self, message: M) -> bool:
        """Like :meth:`post`, but returns ``False`` instead of raising when closed.

        For callbacks whose recipient may legitimately be gone (a reduction
        finishing after ``fit`` was cancelled).
        """
        if self._closed:
            return False
        self.post(message)
        return True

    def post_threadsafe(self, message: M, wake: bool = True) -> None:
        """Deliver ``message`` from any thread; it is appended on the event loop.

        Messages posted from threads while the loop has not yet woken up for
        an earlier one ride on that wake-up: a burst of gradient hooks costs
        the loop one wake-up, not one per message. Each poster's messages
        keep their order.

        ``wake=False`` queues the message without waking the loop, for a
        message the reader cannot act on alone: it is delivered, in order,
        with the next post that wakes it (or by :meth:`wake`), or when the
        reader next reads.

        :raises ~gsync.MailboxClosed: if the mailbox is closed or its loop has stopped.
        """
        if self._closed:
            raise MailboxClosed(self.owner, message)
        with self._lock:
            self._from_threads.append(message)
            if not wake or self._drain_scheduled:
                return
            self._drain_scheduled = True
        self._schedule_drain(message)

    def wake(self) -> None:
        """From any thread: deliver what was posted with ``wake=False``, unless a wake-up is already on its way."""
        with self._lock:
            if self._drain_scheduled or not self._from_threads:
                return
            self._drain_scheduled = True
        self._schedule_drain("<wake>")

    def _schedule_drain(self, message: object) -> None:
        if not self._loop.call_soon(self._drain):
            # The loop is gone: nothing will ever drain, so refuse this and every later post.
            with self._lock:
                self._closed = True
                self._from_threads.clear()
                self._drain_scheduled = False
            raise MailboxClosed(self.owner, message)

    def _drain(self) -> None:
        with self._lock:
            batch, self._from_threads = self._from_threads, []
            self._drain_scheduled = False
        for message in batch:
            self.try_post(message)

    async def receive(self) -> M:
        """The next message: at once if one is queued, else once one arrives.

        A queued message is taken without yielding to the loop: a burst of
        messages, such as every device's ``BucketReady`` riding on one
        wake-up, is handled in one loop iteration rather than one per
        message. A reader yields (and sees cancellation) whenever its
        mailbox runs empty, which the protocol bounds to a step's worth of
        messages; it then waits on its own event, with no extra loop
        iteration before it sleeps (anyio's memory streams spend one on a
        checkpoint, on every empty read).

        :raises ~gsync.MailboxClosed: if the mailbox is closed and empty.
        """
        while True:
            message = self.receive_nowait()
            if message is not None:
                return message
            if self._closed:
                raise MailboxClosed(self.owner, "<receive>")
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = self._loop.event()
            await waiter.wait()

    def receive_nowait(self) -> M | None:
        """The next message if one was posted, else ``None``; never waits.

        Messages a thread posted are taken too, even before the loop has
        run their drain (and those posted with ``wake=False``).
        """
        if not self._queue and self._from_threads:
            self._drain()
        return self._queue.popleft() if self._queue else None

    def close(self) -> None:
        """Refuse further posts; messages already posted (from threads too) can still be received."""
        with self._lock:
            self._queue.extend(self._from_threads)
            self._from_threads.clear()
            self._closed = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def discard(self) -> None:
        """Close both ends, dropping whatever is queued. For teardown only."""
        self.close()
        self._queue.clear()
