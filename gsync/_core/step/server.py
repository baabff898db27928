"""The sync server: one coroutine that turns bucket readiness into reductions.

For each step the feeder dispatched, the server counts ``BucketReady``
messages. As soon as bucket ``b`` is ready on every device, and every bucket
before it has been launched, it submits ``b``'s all-reduce to the
communication thread: strictly in bucket order, so every process issues the
same collectives in the same order, and while backward is still producing
later buckets. When every bucket is reduced (and buffers are broadcast) it
posts the step's loss to the session, once, and ``StepSynced`` to each
device.

A step that does not complete within ``sync_timeout`` seconds of the server
starting on it raises :class:`~gsync.SyncTimeout` naming what never arrived.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import cast

import torch

from ..threads import FitAborted, Outcome, WorkerThread
from ..base.agreement import AgreedStep, StepAgreement, StepFacts
from ..gradients.buckets import BucketPlan
from ..gradients.buffers import BufferSync
from ...comm.base import Collective
from ...comm._capabilities import IN_PLACE, PER_BUCKET, ReducesBuckets, ReducesInPlace
from .context import ActorContext, DeviceEndpoint
from ...errors import GsyncError, SyncFailed
from .mailbox import Mailbox
from .progress import StepProgress, timed_out
from .messages import (
    BucketReady,
    BucketReduced,
    Close,
    CommFailed,
    ForwardDone,
    ServerMessage,
    StepDeadline,
    StepDispatched,
    StepFinished,
    StepLoss,
    StepSynced,
)
from .rebuild import PlanRebuild

__all__ = ("SyncServer",)

logger = logging.getLogger("gsync")

_FINISH = -1


class SyncServer:
    """Turns bucket readiness into reductions, for the devices of one process.

    ``agreement`` settles each step across processes (or locally);
    ``rebuild``, when given, rebuilds the bucket plan after the first step.
    """

    def __init__(
        self,
        *,
        mailbox: Mailbox[ServerMessage],
        context: ActorContext,
        devices: Sequence[DeviceEndpoint],
        buffers: BufferSync,
        collective: Collective,
        agreement: StepAgreement,
        rebuild: PlanRebuild | None = None,
    ) -> None:
        self.mailbox = mailbox
        threads = context.intra_op_threads
        self.comm = WorkerThread("gsync-comm", context.loop, torch_threads=None if threads is None else threads[1])
        self.bucket_ready_received = 0
        self.steps_synced = 0
        self.skipped_steps: list[int] = []
        self.reduced_bytes = 0
        """Bytes all-reduced per device, as they cross the transport (compressed, with a compression hook);
        written by the communication thread."""
        self.failure: GsyncError | None = None
        """The first gsync error a communication job raised (e.g. the agreement's ConfigError)."""
        self._context = context
        self._plan = context.plan
        self._devices = list(devices)
        self._buffers = buffers
        self._collective = collective
        # Gradients left in .grad (context.grads_in_place) are reduced where they are, which only the
        # in-process collective can do.
        # Asked once, not per bucket.
        capabilities = collective.capabilities
        self._bucket_reducer = cast(ReducesBuckets, collective) if PER_BUCKET in capabilities else None
        self._in_place_collective: ReducesInPlace | None = None
        if context.grads_in_place and not context.alone:
            if IN_PLACE not in capabilities:
                raise ValueError(f"gradients left in .grad need a collective that reduces in place, not {collective!r}")
            self._in_place_collective = cast(ReducesInPlace, collective)
        self._agreement = agreement
        self._rebuild = rebuild
        # shard_optimizer: buckets are reduce-scattered, and a step that clips or scales its loss sums the
        # shards' squared norms before StepSynced (see gsync._core.sharding.step).
        self._sharding = context.sharding
        # The session's settings (timeout, trace, fault hooks, abort flag) come
        # from the context the actors share, so the two never disagree.
        self._timeout = context.sync_timeout
        self._backlog: deque[ServerMessage] = deque()
        self._trace = context.trace
        self._site_hooks = context.site_hooks
        self._abort = context.abort
        self._agreed = AgreedStep((), False, 0.0)
        # The last (step, bucket) whose reduction finished, written by the communication thread: a timeout
        # names as unreduced only what really never finished, reported or not.
        self._reduced_through = (-1, -1)
        # Exceptions cannot travel in a message (messages are plain structs):
        # CommFailed names the (step, bucket) whose exception waits here.
        self._comm_errors: dict[tuple[int, int], BaseException] = {}

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan of the step in progress (the rebuilt one from the second step on, if it was rebuilt)."""
        return self._plan

    async def run(self) -> None:
        """Serve steps until ``Close`` arrives and every dispatched step is synced, then close every device.

        :raises ~gsync.SyncTimeout: when a step stalls.
        :raises ~gsync.SyncFailed: when a collective raises.
        """
        try:
            while True:
                message = self._backlog.popleft() if self._backlog else await self.mailbox.receive()
                match message:
                    case StepDispatched():
                        await self._sync_step(message)
                    case Close():
                        for device in self._devices:
                            # A device whose mailbox is closed has already ended.
                            device.mailbox.try_post(Close("end of data"))
                        return
                    case StepDeadline():
                        pass  # the deadline of a step that was synced before its timer's post was read
                    case _:
                        raise SyncFailed(-1, None, f"protocol error: {message!r} outside any step")
        finally:
            self.mailbox.close()

    async def _sync_step(self, dispatched: StepDispatched) -> None:
        """Launch a step's reductions as its buckets become ready, in bucket order, and post ``StepSynced``.

        :raises ~gsync.SyncTimeout: when the step is not synced within its deadline, naming what never arrived.
        :raises ~gsync.SyncFailed: when a reduction raises, or a message of another step arrives.
        """
        progress = StepProgress(dispatched, len(self._plan.buckets), len(self._devices))
        turns = self._context.first_step if self.steps_synced == 0 else None
        # Devices that run one after another (on one shared thread, or in the first step's turns) may take
        # as many times longer: each has the full timeout for its own part.
        in_turn = self._context.shared_thread or turns is not None
        timeout = self._timeout * (progress.num_devices if in_turn else 1)

        def deadline_passed() -> None:
            # From the moment the deadline passes it wins, as a cancel scope's would: a message read after that
            # only counts as arrived (in the report), so nothing is launched once the step has timed out. The
            # timer's post wakes the server if it is waiting.
            progress.expired = True
            self.mailbox.try_post(StepDeadline(dispatched.step))

        cancel_deadline = self._context.loop.call_later(timeout, deadline_passed)
        message: ServerMessage | None = None
        try:
            finished = False
            while not finished:
                message = await self.mailbox.receive()
                if progress.expired:
                    break
                finished = self._take(message, progress)
        finally:
            cancel_deadline()
        if progress.expired:
            late = [message] if message is not None else []
            while (queued := self.mailbox.receive_nowait()) is not None:
                late.append(queued)
            raise timed_out(progress, late, self._devices, turns, self._reduced_through, timeout)
        self._announce_synced(dispatched.step)

    def _take(self, message: ServerMessage, progress: StepProgress) -> bool:
        """Act on one message of the step in progress; whether the step is now finished. The server's one match."""
        step = progress.step
        match message:
            case BucketReady(device=device, step=at, bucket=bucket, unused=missing):
                # The most frequent message (devices x buckets per step): matched first.
                self._expect_step(step, at, message)
                self.bucket_ready_received += 1
                for ready in progress.bucket_ready(device, bucket, missing):
                    self._launch(step, ready, progress.weights)
                return False
            case ForwardDone(step=at, loss=share, skip=device_skips):
                self._expect_step(step, at, message)
                progress.loss += share
                progress.skip = progress.skip or device_skips
                progress.losses_in += 1
                return self._finish_if_complete(progress)
            case BucketReduced(step=at, bucket=through):
                self._expect_step(step, at, message)
                progress.reduced = max(progress.reduced, through + 1)
                return self._finish_if_complete(progress)
            case StepFinished(step=at):
                self._expect_step(step, at, message)
                return True
            case CommFailed(step=at, bucket=bucket):
                error = self._comm_errors.pop((at, bucket))
                if isinstance(error, (GsyncError, FitAborted)):
                    # FitAborted: the session is already ending for another reason.
                    raise error
                raise SyncFailed(at, None if bucket == _FINISH else bucket) from error
            case StepDeadline():
                return False  # an earlier step's, synced before its timer's post was read
            case StepDispatched() | Close():
                self._backlog.append(message)
                return False

    def _finish_if_complete(self, progress: StepProgress) -> bool:
        """Once every reduction is done and every device's loss read, the step's facts are all in: finish it."""
        if not progress.inputs_complete:
            return False
        return self._finish_step(progress.facts())

    def _announce_synced(self, step: int) -> None:
        """The step is agreed everywhere: tell the session its loss, and every device to apply it (with the plan
        from the next step on, after the first)."""
        agreed = self._agreed
        self.steps_synced += 1
        final: BucketPlan | None = None
        if self._rebuild is not None and self.steps_synced == 1:
            self._plan = final = self._rebuild.apply() or self._plan
        elif self._sharding is not None and self.steps_synced == 1:
            # The shards are cut from the first plan, which is never rebuilt: it is final, so the devices may
            # drop the last bucket's hooks.
            final = self._plan
        if agreed.skip:
            self.skipped_steps.append(step)
            logger.warning("gsync: step %d skipped on every device: a loss was not finite (on_nonfinite='skip')", step)
        self._context.session.post(StepLoss(step, agreed.loss))
        synced = StepSynced(step, agreed.unused, agreed.skip, final)
        for endpoint in self._devices:
            endpoint.mailbox.post(synced)

    def _finish_step(self, facts: StepFacts) -> bool:
        """After the last reduction: broadcast buffers, agree across ranks, observe the first step's order.

        Runs as one job on the communication thread, after the step's
        reductions, when there is anything to do; returns whether the step is
        already finished (nothing needed the thread).
        """
        observe = self._rebuild is not None and self.steps_synced == 0
        norm = self._sharding is not None and self._sharding.clips_or_scales
        if self._buffers.empty and self._agreement.local and not observe and not norm:
            self._agreed = self._agreement.agree(facts)
            return True

        def finish() -> None:
            if self._abort.is_set():
                raise FitAborted
            if not self._buffers.empty:
                self._broadcast_buffers(facts.step)
            if norm and self._sharding is not None:
                streams = self._context.streams
                with streams.comm_streams():
                    self._sharding.agree_norm(facts.step)
                streams.after_broadcast()
            self._agreed = self._agreement.agree(facts)
            if observe and self._rebuild is not None:
                self._rebuild.observe()

        self._submit(facts.step, _FINISH, finish)
        return False

    def _expect_step(self, step: int, at: int, message: ServerMessage) -> None:
        if at != step:
            raise SyncFailed(step, None, f"protocol error: {message!r} arrived during step {step}")

    def _launch(self, step: int, bucket: int, weights: list[float]) -> None:
        transfer: Callable[[], int] | None
        if self._context.alone:
            # One device in the whole run: the reduction is the identity, and its
            # bucket may not even exist (the gradients stay in .grad).
            transfer, nbytes = None, 0
        elif self._in_place_collective is not None:
            grads = [device.bucket_grads(bucket) for device in self._devices]
            nbytes = self._plan.buckets[bucket].numel * grads[0][0].element_size()
            transfer = partial(self._reduce_in_place, self._in_place_collective, grads, weights, nbytes)
        else:
            flats = [device.bucket_buffer(bucket) for device in self._devices]
            nbytes = flats[0].numel() * flats[0].element_size()
            transfer = partial(self._reduce_flats, bucket, flats, weights)
        self._submit(step, bucket, partial(self._reduce, step, bucket, transfer), nbytes)

    def _reduce(self, step: int, bucket: int, transfer: Callable[[], int] | None) -> None:
        if self._abort.is_set():
            # The session is ending: queued reductions would only delay teardown.
            raise FitAborted
        for hook in tuple(self._site_hooks):  # the engine's list, which the loop's thread may change meanwhile
            hook(-1, step, "all_reduce", self._abort)
        streams = self._context.streams
        streams.before_reduce(bucket)
        if transfer is not None:
            with streams.comm_streams():
                self.reduced_bytes += transfer()
        streams.after_reduce(bucket)
        self._reduced_through = (step, bucket)

    def _reduce_flats(self, bucket: int, flats: list[torch.Tensor], weights: list[float]) -> int:
        if self._bucket_reducer is not None:
            # Compression reduces whole buckets even when sharded (its hook keeps state per bucket).
            return self._bucket_reducer.reduce_bucket(bucket, flats, weights)
        if self._sharding is not None:
            self._collective.reduce_scatter(flats, weights)
            return flats[0].numel() * flats[0].element_size()
        self._collective.all_reduce(flats, weights)
        return flats[0].numel() * flats[0].element_size()

    @staticmethod
    def _reduce_in_place(
        collective: ReducesInPlace, grads: list[list[torch.Tensor]], weights: list[float], nbytes: int
    ) -> int:
        collective.all_reduce_each(grads, weights)
        return nbytes

    def _broadcast_buffers(self, step: int) -> None:
        streams = self._context.streams
        with streams.comm_streams():
            self._buffers.broadcast(self._collective, step)
        streams.after_broadcast()

    def _submit(self, step: int, bucket: int, job: Callable[[], None], nbytes: int = 0) -> None:
        if self._trace is not None:
            name = "finish_step" if bucket == _FINISH else "all_reduce"
            job = partial(self._traced, self._trace.span(name, step, bucket=bucket, nbytes=nbytes), job)
        # Reductions run in bucket order on one thread, so the step's last one
        # finishing means all have: only its success is worth waking the loop
        # for (a failure always is). A timeout reads how far they got from
        # ``_reduced_through`` instead.
        report_success = bucket == _FINISH or bucket == len(self._plan.buckets) - 1
        self.comm.submit(job, partial(self._on_comm_done, step, bucket), report_success=report_success)

    @staticmethod
    def _traced(span: AbstractContextManager[None], job: Callable[[], None]) -> None:
        with span:
            job()

    def _on_comm_done(self, step: int, bucket: int, outcome: Outcome[None]) -> None:
        # Runs on the loop after the server may already be gone (fit cancelled):
        # try_post, so a late completion is dropped instead of raising in a callback.
        if outcome.error is not None:
            if isinstance(outcome.error, GsyncError) and self.failure is None:
                # Kept for the session even if the server is already gone: the
                # agreement's ConfigError is raised on every rank alike, and must
                # not lose to a peer's report of the same error.
                self.failure = outcome.error
            self._comm_errors[(step, bucket)] = outcome.error
            self.mailbox.try_post(CommFailed(step, bucket))
        elif bucket == _FINISH:
            self.mailbox.try_post(StepFinished(step))
        else:
            self.mailbox.try_post(BucketReduced(step, bucket))

    def close(self) -> None:
        self.comm.stop()
