"""The messages actors exchange, one tagged union per mailbox.

Messages carry indices (device, step, bucket, parameter), never tensors:
gradient bytes stay in the bucket buffers. They are plain msgspec structs, so
they encode to msgpack as they are for traces and cross-process control
traffic; in-process they are passed as objects and never encoded.
"""

from __future__ import annotations

import msgspec

__all__ = (
    "StepDispatched",
    "BucketReady",
    "BucketReduced",
    "StepFinished",
    "CommFailed",
    "StepSynced",
    "Close",
    "ServerMessage",
    "DeviceMessage",
)


class _Message(msgspec.Struct, tag=True, frozen=True, gc=False, array_like=True):
    pass


class StepDispatched(_Message):
    """The feeder handed step ``step``'s shards to the local devices.

    ``rows[i]`` is local device i's shard size; ``total_rows`` the global
    batch size over all processes. The reduction weights follow from them.
    ``last`` says no step follows in this process's data.
    """

    step: int
    rows: tuple[int, ...]
    total_rows: int
    last: bool = False


class BucketReady(_Message):
    """Every gradient of ``bucket`` is final on ``device`` for ``step``.

    ``unused`` names the parameters (global indices) of the bucket that got no
    gradient on this device; their slots in the bucket hold zeros. ``skip``
    says the device's loss was not finite and the step must not be applied.
    """

    device: int
    step: int
    bucket: int
    unused: tuple[int, ...] = ()
    skip: bool = False


class BucketReduced(_Message):
    """The all-reduce of ``bucket`` for ``step`` finished on every device."""

    step: int
    bucket: int


class StepFinished(_Message):
    """The communication thread finished ``step``'s closing job: buffers broadcast, ranks agreed."""

    step: int


class CommFailed(_Message):
    """A collective raised; the server holds the exception. ``bucket`` is -1 for the step's closing job."""

    step: int
    bucket: int


class StepSynced(_Message):
    """Every bucket of ``step`` is reduced: the device may run its optimizer step.

    ``unused`` names the parameters that got no gradient on any device; the
    optimizer must see ``grad=None`` for them, as it would on one device.
    ``skip`` tells every device to leave this step's update out (a device's
    loss was not finite, with ``on_nonfinite="skip"``).
    """

    step: int
    unused: tuple[int, ...] = ()
    skip: bool = False


class Close(_Message):
    """No more work: the recipient finishes what it holds and returns."""

    reason: str = ""


ServerMessage = StepDispatched | BucketReady | BucketReduced | StepFinished | CommFailed | Close
DeviceMessage = StepSynced | Close
