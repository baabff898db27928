"""Ordering between gradient producers, the communication thread and the optimizer step.

Three kinds of thread touch a step's gradient buckets:

* the thread where backward runs (autograd's; on CUDA, autograd's per-device
  thread) writes them, and calls :meth:`StreamSync.mark_ready` once a bucket is
  final on that device;
* gsync's communication thread reduces them, between
  :meth:`~StreamSync.before_reduce` and :meth:`~StreamSync.after_reduce`;
* each device's worker thread reads them in ``optimizer.step``, after
  :meth:`~StreamSync.before_apply`.

gsync's messages already order these calls on the host (``BucketReady`` is
posted after ``mark_ready``, a reduction is launched after every device's
``BucketReady``, ``StepSynced`` after every reduction). On CPU a call's work is
done when it returns, so host order is data order and :class:`HostStreamSync`
only *checks* that the calls come in the contract's order. On CUDA a call only
queues kernels, so :class:`CudaStreamSync` turns the same host order into
device order with events: a stream waits on an event (``cudaStreamWaitEvent``),
the host never does, and the event loop and the device threads never block on
the GPU.

The contract, per device and per step (a *round*):

1. ``mark_ready(device, bucket)`` once per bucket, in the thread where that
   bucket's gradients became final, *before* ``BucketReady`` is posted; a
   gradient hook calls ``before_write(device)`` before it writes a bucket.
2. ``before_reduce(bucket)`` in the communication thread once every device
   marked the bucket, before the bucket's collective is enqueued;
   ``after_reduce(bucket)`` right after it, in the same job.
3. ``after_broadcast()`` in the communication thread after the buffer
   broadcast, when there is one (every bucket reduced, before ``StepSynced``).
4. ``before_apply(device)`` in the device's worker thread after ``StepSynced``
   and before the device touches its buckets or parameters again: before
   ``optimizer.step``, and on a skipped step too (the next step writes the
   buckets, which must wait for the reduction as much as the optimizer does).

A device's round ends with its ``before_apply``, so rounds are tracked per
device: a fast device may mark buckets of step ``k + 1`` while a slow one has
not yet applied step ``k``, which a single global "new step" reset could not
express without a barrier.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from ...errors import ConfigError, GsyncError

__all__ = ("StreamOrderError", "StreamSync", "positive_int")


class StreamOrderError(GsyncError, RuntimeError):
    """A :class:`StreamSync` method was called out of the contract's order.

    This is a bug in the caller (gsync's engine or a custom loop), not in the
    training code: on CUDA the same call sequence would be a data race.
    """


@runtime_checkable
class StreamSync(Protocol):
    """Orders gradient production, reduction and application without blocking the host.

    ``device`` is a position in the device list the object was built with
    (gsync's local device index), ``bucket`` a bucket index of the current plan.
    No method blocks the calling thread on device work except :meth:`close`.
    Methods raise :class:`StreamOrderError` when called out of order or after
    :meth:`close`, and :class:`IndexError` for a device or bucket out of range.
    """

    @property
    def num_devices(self) -> int:
        """How many devices this object orders."""
        ...

    @property
    def num_buckets(self) -> int:
        """How many buckets the current plan has."""
        ...

    def mark_ready(self, device: int, bucket: int) -> None:
        """Bucket ``bucket`` is final on ``device`` for this round.

        Called in the thread where backward runs (the gradient hook), or in the
        device's worker thread for buckets zero-filled after backward, before
        ``BucketReady`` is posted. CUDA: records the bucket's ready event on
        the caller's current stream for that device (the compute stream, when
        backward runs under :meth:`compute_stream`).
        """
        ...

    def before_write(self, device: int) -> None:
        """The calling thread is about to write ``device``'s buckets on its current stream (a gradient hook).

        Called in the thread where backward runs, before a hook copies a
        gradient into its bucket slot. CUDA: where that stream is not the
        compute stream (a model that runs part of its forward on a stream of
        its own, whose gradients autograd accumulates, and runs the hook, on
        that stream), it waits for the compute stream as of the start of the
        running job, which is behind the last round's reductions and
        optimizer step. The compute stream is in order already; CPU: nothing
        to wait for.
        """
        ...

    def before_reduce(self, bucket: int) -> None:
        """The communication thread is about to enqueue ``bucket``'s collective.

        CUDA: each device's comm stream waits on that device's ready event for
        the bucket (a stream wait, no host sync).
        """
        ...

    def after_reduce(self, bucket: int) -> None:
        """The communication thread has enqueued ``bucket``'s collective.

        CUDA: after the round's last reduction, records each device's done
        event on its comm stream (what :meth:`before_apply` waits on).
        """
        ...

    def after_broadcast(self) -> None:
        """The communication thread has enqueued the step's buffer broadcast (after every bucket).

        CUDA: records each device's done event on its comm stream, so
        ``before_apply`` orders the next forward after the broadcast too.
        """
        ...

    def before_apply(self, device: int) -> None:
        """``device``'s worker thread is about to use the reduced buckets (``optimizer.step``), or to skip the step.

        Ends the device's round. CUDA: the caller's current stream for that
        device (the compute stream, under :meth:`compute_stream`) waits on the
        device's done event, which the in-order comm stream recorded after the
        round's last reduction (and broadcast).
        """
        ...

    def compute_stream(self, device: int) -> AbstractContextManager[None]:
        """Context for ``device``'s worker thread: forward, backward and the optimizer step run inside it.

        CUDA: selects the device and its compute stream; on entry the compute
        stream waits for the work the caller queued before (replicas, loaded
        state, bucket buffers made on the default stream), on exit the
        caller's stream waits for the compute stream (so state read there
        afterwards is current). Both are stream waits, not host syncs.
        """
        ...

    def comm_stream(self, device: int) -> AbstractContextManager[None]:
        """Context for the communication thread: ``device``'s comm stream is current inside it."""
        ...

    def comm_streams(self) -> AbstractContextManager[None]:
        """Context for the communication thread: every device's comm stream is current inside it.

        Wrap work that touches several devices' tensors outside a collective
        (the buffer broadcast's concatenation and copy-back) in it.
        """
        ...

    def rebuild(self, num_buckets: int) -> None:
        """Switch to a plan of ``num_buckets`` buckets.

        Called on the event loop between a round's last reduction (and
        broadcast) and ``StepSynced``, where the engine rebuilds the plan after
        the first step. CUDA: allocates the new plan's ready events (once per fit).
        """
        ...

    def close(self, timeout: float | None = None) -> None:
        """Wait until every stream's queued work is done; later calls raise. Idempotent.

        The only host sync here: call it after the worker and communication
        threads have stopped and before bucket buffers are freed or replica
        state is read outside :meth:`compute_stream`. Blocks the calling thread
        (so not the event loop for long runs).

        :raises TimeoutError: if ``timeout`` seconds pass first (the streams
            are left running; the object counts as closed).
        """
        ...


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value
