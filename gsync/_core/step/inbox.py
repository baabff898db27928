"""The sync server's inbox: what device threads post to the server, and the one place that decides when it wakes.

Every device posts each bucket's ``BucketReady`` and its ``ForwardDone``
once per step, from its worker thread (or autograd's, in a gradient hook).
The server can act on a bucket, or finish the step, only once every local
device has posted it, so only the post that completes it is worth waking
the loop for; the rest are queued without a wake-up and ride along with
it. Each wake-up costs the poster a write to the loop's self-pipe and the
loop a read, system calls that give up the GIL the device threads then
have to win back.

The completing post wakes the server at once from a gradient hook (the
bucket's reduction then overlaps the rest of backward) and from a device
that queues its kernels behind the host (an accelerator: a reduction
launched early still overlaps its queued work). A CPU device's posts
after its backward returned, and every device's ``ForwardDone`` (its job's
last post), have nothing left to overlap: they wake the server once, when
the device's job ends (:meth:`ServerInbox.job_ended`), so that wake-up and
the job's own report usually ride on one, where each post waking the loop
would have it take the GIL from the device thread in the middle of the
job's last lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .mailbox import Mailbox
from .messages import BucketReady, ForwardDone, ServerMessage

__all__ = ("LastArrivals", "ServerInbox")


class LastArrivals:
    """Tells which device's ``BucketReady`` completes a bucket on every device of the process, and which
    device's ``ForwardDone`` completes the step's losses.

    Every device posts every bucket and its losses exactly once per step,
    and none posts for the next step before the server has every post of
    this one, so a count per bucket, modulo the device count, names the last
    poster. No lock: ``next`` on an ``itertools.count`` is atomic under the GIL.
    """

    def __init__(self, devices: int, max_buckets: int) -> None:
        self._devices = devices
        # A bucket holds at least one parameter, so no plan has more buckets than parameters.
        self._counts = [itertools.count(1) for _ in range(max_buckets if devices > 1 else 0)]
        self._losses = itertools.count(1)

    def completes(self, bucket: int) -> bool:
        """Count one device's post of ``bucket``; whether it was the last device's. Call after posting."""
        return self._devices == 1 or next(self._counts[bucket]) % self._devices == 0

    def completes_losses(self) -> bool:
        """Count one device's ``ForwardDone``; whether it was the last device's. Call after posting."""
        return self._devices == 1 or next(self._losses) % self._devices == 0


class ServerInbox:
    """Where the devices post to the sync server's mailbox, from any thread.

    ``queues_work[i]``: local device ``i`` runs its kernels behind the host
    (an accelerator), so its completing posts always wake the server at once.
    """

    def __init__(self, mailbox: Mailbox[ServerMessage], max_buckets: int, queues_work: Sequence[bool]) -> None:
        self.mailbox = mailbox
        self._arrivals = LastArrivals(len(queues_work), max_buckets)
        self._queues_work = tuple(queues_work)
        # Per device: its running job posted something the server can act on, and wakes it as it ends. Only that
        # device's worker thread writes and reads its entry (hooks, which may run in autograd's thread, wake the
        # server themselves), so it needs no lock.
        self._wake_at_end = [False] * len(queues_work)

    def bucket_ready(self, message: BucketReady, in_hook: bool) -> None:
        """Post ``message``; ``in_hook``: from a gradient hook, while backward still runs."""
        self.mailbox.post_threadsafe(message, wake=False)
        if self._arrivals.completes(message.bucket):
            self._wake(message.device, at_once=in_hook)

    def forward_done(self, message: ForwardDone) -> None:
        """Post ``message``, the last post of a device's job: a completing one wakes the server as the job ends."""
        self.mailbox.post_threadsafe(message, wake=False)
        if self._arrivals.completes_losses():
            self._wake_at_end[message.device] = True

    def job_started(self, device: int) -> None:
        self._wake_at_end[device] = False

    def job_ended(self, device: int) -> None:
        """``device``'s forward/backward job ended (returned or raised): wake the server for what it left queued.

        :raises ~gsync.MailboxClosed: if the server's mailbox is closed (the session is ending).
        """
        if self._wake_at_end[device]:
            self._wake_at_end[device] = False
            self.mailbox.wake()

    def _wake(self, device: int, at_once: bool) -> None:
        if at_once or self._queues_work[device]:
            self.mailbox.wake()
        else:
            self._wake_at_end[device] = True
