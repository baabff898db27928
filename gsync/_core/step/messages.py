"""The messages actors exchange, one tagged union per mailbox.

Messages carry indices (device, step, bucket, parameter), never tensors:
gradient bytes stay in the bucket buffers. They are msgspec structs (tagged,
frozen, untracked by the garbage collector) because that makes them cheap to
build and to ``match`` on; they are passed between tasks and threads as
objects and never encoded. What does cross processes (a failure report, the
per-step agreement) is encoded by :mod:`gsync._core.distributed`, in
structures of its own.
(:class:`StepSynced` carries one object, the rebuilt bucket plan, once per session.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ..gradients.buckets import BucketPlan

__all__ = (
    "StepDispatched",
    "ForwardDone",
    "BucketReady",
    "BucketReduced",
    "StepFinished",
    "CommFailed",
    "StepDeadline",
    "StepSynced",
    "StepLoss",
    "StepApplied",
    "Close",
    "ServerMessage",
    "DeviceMessage",
    "SessionMessage",
)


class _Message(msgspec.Struct, tag=True, frozen=True, gc=False, array_like=True):
    pass


class StepDispatched(_Message, frozen=True):
    """The session handed step ``step``'s shards to the local devices.

    ``weights[i]`` is local device i's share of the step's gradient (its rows
    over the global batch's, averaged over the step's batches when it
    accumulates several); ``rows`` this process's rows in the step, which
    ranks fed process-local data check against each other. ``last`` says no
    step follows in this process's data (known to ``fit``, which reads ahead).
    """

    step: int
    weights: tuple[float, ...]
    rows: int
    last: bool = False


class ForwardDone(_Message, frozen=True):
    """``device`` finished the forward passes of ``step`` and read their losses.

    Posted after the device's backward passes were launched and its last
    ``BucketReady`` (reading a loss waits for its forward pass, so it is not
    read between forward and backward); the server completes a step only
    once every device's ``ForwardDone`` and every reduction are in.

    ``loss`` is the device's share of the step's global mean loss (its shard
    loss weighted by its rows); ``skip`` says a loss was not finite and the
    step must not be applied (``on_nonfinite="skip"``).
    """

    device: int
    step: int
    loss: float
    skip: bool = False


class BucketReady(_Message, frozen=True):
    """Every gradient of ``bucket`` is final on ``device`` for ``step``.

    ``unused`` names the parameters (global indices) of the bucket that got no
    gradient on this device; their slots in the bucket hold zeros.
    """

    device: int
    step: int
    bucket: int
    unused: tuple[int, ...] = ()


class BucketReduced(_Message, frozen=True):
    """The all-reduces of ``step``'s buckets up to and including ``bucket`` finished on every device.

    Reductions run in bucket order on one thread, so one message covers every
    bucket before it: the communication thread sends it once per step, for
    the last bucket.
    """

    step: int
    bucket: int


class StepFinished(_Message, frozen=True):
    """The communication thread finished ``step``'s closing job: buffers broadcast, ranks agreed."""

    step: int


class CommFailed(_Message, frozen=True):
    """A collective raised; the server holds the exception. ``bucket`` is -1 for the step's closing job."""

    step: int
    bucket: int


class StepDeadline(_Message, frozen=True):
    """``step``'s ``sync_timeout`` has passed (posted by the sync server's own timer; ignored once the step is
    synced)."""

    step: int


class StepSynced(_Message, frozen=True):
    """Every bucket of ``step`` is reduced: the device may run its optimizer step.

    ``unused`` names the parameters that got no gradient on any device; the
    optimizer must see ``grad=None`` for them, as it would on one device.
    ``skip`` tells every device to leave this step's update out (a device's
    loss was not finite, with ``on_nonfinite="skip"``). ``plan``, sent once
    (with the first step the server syncs, when it rebuilds the plan), is the
    bucket plan from the next step on, for good: the same object when the
    rebuild kept the plan.
    """

    step: int
    unused: tuple[int, ...] = ()
    skip: bool = False
    plan: BucketPlan | None = None


class StepLoss(_Message, frozen=True):
    """``step``'s global mean loss, agreed over every device of every process; the server posts it to the session
    once, as the step syncs (before any device's ``StepApplied``)."""

    step: int
    loss: float


class StepApplied(_Message, frozen=True):
    """``device`` applied (or skipped) ``step``: its replica holds the state after it.

    ``lr`` is the learning rate the step used (the first parameter group's;
    ``lrs`` every group's), ``grad_norm`` the reduced gradient's norm when
    clipping, and ``skipped`` whether the update was left out (a non-finite
    loss, or a GradScaler that found infs).
    """

    device: int
    step: int
    lr: float
    grad_norm: float | None = None
    skipped: bool = False
    lrs: tuple[float, ...] = ()


class Close(_Message, frozen=True):
    """No more work: the recipient finishes what it holds and returns."""

    reason: str = ""


ServerMessage = (
    StepDispatched | ForwardDone | BucketReady | BucketReduced | StepFinished | CommFailed | StepDeadline | Close
)
DeviceMessage = StepSynced | Close
SessionMessage = StepLoss | StepApplied
