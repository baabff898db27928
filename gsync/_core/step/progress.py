"""What the sync server has heard of the step in progress, and what a step that timed out reports."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..base.agreement import StepFacts
from .context import DeviceEndpoint, FirstStepInTurn
from ...errors import SyncTimeout
from .messages import BucketReady, ForwardDone, ServerMessage, StepDispatched

__all__ = ("StepProgress", "timed_out")

_NOTHING_UNUSED: frozenset[int] = frozenset()


class StepProgress:
    """What the server has heard of one step so far: readiness per (bucket, device), reductions, losses."""

    __slots__ = (
        "arrived", "dispatched", "expired", "loss", "losses_in", "next_launch", "num_buckets", "num_devices",
        "ready_count", "reduced", "skip", "step", "unused", "weights",
    )

    def __init__(self, dispatched: StepDispatched, num_buckets: int, num_devices: int) -> None:
        self.dispatched = dispatched
        self.step = dispatched.step
        self.weights = list(dispatched.weights)
        self.num_buckets = num_buckets
        self.num_devices = num_devices
        self.arrived = [bytearray(num_devices) for _ in range(num_buckets)]
        self.ready_count = [0] * num_buckets
        # Per bucket, the parameters no device has given a gradient so far (None: no device has reported).
        self.unused: list[frozenset[int] | None] = [None] * num_buckets
        self.next_launch = 0
        self.reduced = 0
        self.losses_in = 0
        self.skip = False
        self.loss = 0.0
        self.expired = False

    def bucket_ready(self, device: int, bucket: int, missing: Sequence[int]) -> range:
        """Note ``bucket`` ready on ``device``; the buckets that may now be launched, in order."""
        self.arrived[bucket][device] = 1
        self.ready_count[bucket] += 1
        if not missing:
            self.unused[bucket] = _NOTHING_UNUSED
        elif self.unused[bucket] is None:
            self.unused[bucket] = frozenset(missing)
        else:
            self.unused[bucket] &= frozenset(missing)  # type: ignore[operator]
        first = launch = self.next_launch
        while launch < self.num_buckets and self.ready_count[launch] == self.num_devices:
            launch += 1
        self.next_launch = launch
        return range(first, launch)

    @property
    def inputs_complete(self) -> bool:
        return self.reduced >= self.num_buckets and self.losses_in >= self.num_devices

    def facts(self) -> StepFacts:
        no_gradient = tuple(sorted(p for bucket_unused in self.unused if bucket_unused for p in bucket_unused))
        dispatched = self.dispatched
        return StepFacts(self.step, no_gradient, self.skip, dispatched.rows, self.loss, dispatched.last)


def timed_out(
    progress: StepProgress,
    late: Iterable[ServerMessage],
    devices: Sequence[DeviceEndpoint],
    turns: FirstStepInTurn | None,
    reduced_through: tuple[int, int],
    timeout: float,
) -> SyncTimeout:
    """The timeout of a step, naming the (device, bucket) pairs that never arrived and where devices were.

    ``late``: the message read as the deadline was seen, and what was still queued: posts that did not wake the
    server count as arrived (a bucket, or the losses, not yet in from every device, or in from every device but
    whose last poster's job, which wakes the server as it ends, had not ended). ``reduced_through``: the last
    (step, bucket) whose reduction finished, reported or not.
    """
    step, num_devices, num_buckets = progress.step, progress.num_devices, progress.num_buckets
    arrived = progress.arrived
    for message in late:
        if isinstance(message, BucketReady) and message.step == step:
            arrived[message.bucket][message.device] = 1
        elif isinstance(message, ForwardDone) and message.step == step:
            progress.losses_in += 1
    # A device still waiting for its first-step turn, or for the thread it shares with the
    # other devices, is held up by another device, which is named.
    blamed = [
        device
        for device in range(num_devices)
        if not devices[device].queued and (turns is None or not turns.queued(device))
    ] or list(range(num_devices))
    missing_pairs = [
        (devices[device].name, bucket)
        for bucket in range(num_buckets)
        for device in blamed
        if not arrived[bucket][device]
    ]
    through_step, through_bucket = reduced_through
    unreduced = list(range(max(progress.reduced, through_bucket + 1 if through_step == step else 0), progress.next_launch))
    stalled = {device for device in blamed if not all(arrived[b][device] for b in range(num_buckets))}
    last_seen = {devices[d].name: devices[d].where() for d in stalled}
    site = "gradient sync"
    if progress.reduced == num_buckets and progress.losses_in < num_devices:
        site = "loss check (reading a device's loss)"
    elif progress.reduced == num_buckets:
        site = "closing collectives (buffer broadcast, agreement across processes)"
    elif not missing_pairs:
        site = "gradient sync (waiting on the collective; with several processes, on another rank)"
    return SyncTimeout(step, timeout, missing_pairs, unreduced, site=site, last_seen=last_seen)
