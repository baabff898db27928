"""The device actor: one async task per device, owning a replica, its optimizer and its shards.

Per step the actor runs forward and backward in its worker thread, once per
global batch the step accumulates; its gradients reach the sync server
through :class:`~gsync._core.step.capture.GradientCapture`. The actor then
waits for ``StepSynced``, runs the optimizer step
(:class:`~gsync._core.step.update.ReplicaUpdate`) in its thread, and posts
``StepApplied`` to the session.

Nothing heavy runs on the event loop. If the actor is cancelled mid-job, the
job stops at its next phase boundary or gradient hook (the last bucket has
none once the plan is final), which poll the session's abort flag; its
result is discarded.
"""

from __future__ import annotations

import math
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from ..threads import WorkerThread
from ..data.batches import move_batch
from .capture import GradientCapture
from .context import ActorContext, FirstStepInTurn, Shard
from ..devices import DeviceSpec
from ..gradients.buckets import BucketPlan, ReplicaGrads
from ...errors import GsyncError, InputTypeError, MailboxClosed, NonFiniteLoss, SyncFailed
from .evaluation import MetricFn, evaluate_shard
from .jobs import DeviceJobs
from .mailbox import Mailbox
from .messages import Close, DeviceMessage, ForwardDone, StepSynced
from .readout import LossReadout
from .update import ReplicaUpdate

__all__ = ("DeviceActor", "MetricFn")


class DeviceActor:
    def __init__(
        self,
        *,
        index: int,
        spec: DeviceSpec,
        replica: nn.Module,
        optimizer: torch.optim.Optimizer,
        context: ActorContext,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        worker: WorkerThread | None = None,
    ) -> None:
        self.index = index
        self.spec = spec
        self.replica = replica
        self.mailbox: Mailbox[DeviceMessage] = Mailbox(f"device {spec.name}", context.loop)
        self.shards: Mailbox[Shard] = Mailbox(f"shards of {spec.name}", context.loop)
        """The session posts each step's shard here, and closes it at the end of the data."""
        self.jobs = DeviceJobs(index, spec.name, context, worker)
        self.params = [p for _, p in replica.named_parameters() if p.requires_grad]
        self.capture = GradientCapture(index, self.params, spec.torch_device, context)
        self.update = ReplicaUpdate(
            index=index, optimizer=optimizer, scheduler=scheduler, scaler=scaler, capture=self.capture,
            context=context, device=spec.torch_device, enter=self.jobs.enter,
        )
        self._context = context
        self._losses = LossReadout(spec.torch_device, context.abort)

    # What the session, the sync server, the heartbeat and a checkpoint read of the device.

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.update.optimizer

    @property
    def scheduler(self) -> Any:
        return self.update.scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.update.scaler

    @property
    def applied_step(self) -> int:
        return self.update.applied_step

    @property
    def optimizer_dirty(self) -> bool:
        return self.update.optimizer_dirty

    @property
    def worker(self) -> WorkerThread:
        return self.jobs.worker

    @property
    def failure(self) -> GsyncError | None:
        return self.jobs.failure

    # Settable, as the heartbeat's DevicePosition says; only the actor's own jobs set them.
    @property
    def step(self) -> int:
        return self.jobs.step

    @step.setter
    def step(self, step: int) -> None:
        self.jobs.step = step

    @property
    def site(self) -> str:
        return self.jobs.site

    @site.setter
    def site(self, site: str) -> None:
        self.jobs.site = site

    @property
    def waiting(self) -> bool:
        return self.jobs.waiting

    @waiting.setter
    def waiting(self, waiting: bool) -> None:
        self.jobs.waiting = waiting

    @property
    def queued(self) -> bool:
        return self.jobs.queued

    @property
    def plan(self) -> BucketPlan:
        return self.capture.plan

    @property
    def grads(self) -> ReplicaGrads:
        return self.capture.grads

    def bucket_buffer(self, bucket: int) -> torch.Tensor:
        return self.capture.bucket_buffer(bucket)

    def bucket_grads(self, bucket: int) -> list[torch.Tensor]:
        return self.capture.bucket_grads(bucket)

    def where(self) -> str:
        return self.jobs.where()

    # -- in the worker thread --------------------------------------------------

    def _forward_backward(self, shard: Shard) -> None:
        """Forward and backward of every batch of the step; only the last backward posts buckets.

        The server's inbox is told when the job ends, however it ends: what
        the job posted after its backward returned wakes the server then.
        """
        inbox = self._context.server
        inbox.job_started(self.index)
        stats = self._context.batch_stats
        try:
            if stats is not None:
                stats.job_started(self.index, shard.step)
            try:
                self._run_batches(shard)
            finally:
                if stats is not None:
                    stats.job_ended(self.index)
        except BaseException:
            # The server still gets what was posted; if the session is already gone,
            # the job's own error is the one to report.
            with suppress(MailboxClosed):
                inbox.job_ended(self.index)
            raise
        inbox.job_ended(self.index)

    def _run_batches(self, shard: Shard) -> None:
        jobs, capture = self.jobs, self.capture
        jobs.step = shard.step
        with jobs.enter("data"):
            # None: no batch there on this rank (uneven="join"), so nothing to move.
            parts = [None if data is None else move_batch(data, self.spec.torch_device) for data in shard.data]
        batches = len(parts)
        capture.start_step(shard.step, batches)
        weight = shard.weight
        readout = self._losses
        readout.start(batches)
        recipe = self._context.recipe
        stats = self._context.batch_stats
        last_backward_ran = False
        for position, (rows, total, data) in enumerate(zip(shard.rows, shard.total_rows, parts)):
            local_rows = shard.local_rows[position] if shard.local_rows else ()
            padded = bool(shard.padded) and shard.padded[position]
            if rows == 0:
                # An empty shard has nothing to learn from: the device posts its
                # buckets as unused (zeros), weighted by what it did see.
                if stats is not None and self.index == 0:
                    # A process without rows still matches the other ranks' SyncBatchNorm collectives.
                    with jobs.enter("forward"):
                        stats.skip_batch(shard.step, position, local_rows, padded)
                continue
            if stats is not None:
                stats.begin_batch(self.index, shard.step, position, local_rows, padded, rows / total)
            last = position == batches - 1
            jobs.shard_rows = (rows, total)
            # The device's gradient is the weighted mean over the step's
            # batches; the reduction weights it by ``weight`` as a whole.
            capture.start_batch(last, 1.0 if batches == 1 else rows / total / batches / weight)
            with jobs.enter("forward"), recipe.autocast_in(self.spec.torch_device):
                loss = recipe.loss_fn(self.replica, data)
                self._check_loss(loss)
                # Read after backward is launched, not here: no host sync between the two.
                readout.add(loss, rows / total / batches)
            with jobs.enter("backward"):
                capture.before_backward()
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                capture.after_backward()
            if stats is not None:
                stats.end_batch(self.index)
            last_backward_ran = last
        capture.finish(batches)
        self._post_losses(readout.read(), last_backward_ran)

    def _post_losses(self, losses: list[tuple[float, float]], last_backward_ran: bool) -> None:
        nonfinite = next((value for value, _ in losses if not math.isfinite(value)), None)
        if nonfinite is not None and self._context.on_nonfinite == "raise":
            # Before the server hears of this device's losses, so the step never completes anywhere.
            raise NonFiniteLoss(self.spec.name, self.index, self.step, nonfinite)
        self.capture.post_unfinished(last_backward_ran)
        # A non-finite loss (on_nonfinite="skip") had its backward too; the
        # server tells every device to leave the step's update out.
        share = sum(value * weight for value, weight in losses)
        self._context.server.forward_done(ForwardDone(self.index, self.step, share, nonfinite is not None))

    def _check_loss(self, loss: object) -> None:
        where = f"on {self.spec.name} at step {self.step}"
        if not isinstance(loss, torch.Tensor):
            raise InputTypeError(f"loss_fn returned a {type(loss).__name__} {where}; it must return a scalar tensor")
        if loss.numel() != 1:
            raise InputTypeError(
                f"loss_fn returned a tensor of shape {tuple(loss.shape)} {where}; it must return a scalar "
                "(the mean loss of its shard): reduce it, e.g. with .mean()"
            )
        if not loss.requires_grad:
            raise InputTypeError(
                f"loss_fn returned a tensor that does not require grad {where}: compute it from the model's "
                "output, outside torch.no_grad()"
            )

    def _evaluate(self, data: Any, rows: int, metric_fn: MetricFn) -> dict[str, float]:
        with self.jobs.enter("evaluate"):
            autocast = self._context.recipe.autocast_in(self.spec.torch_device)
            return evaluate_shard(self.replica, self.spec.torch_device, self.name, data, rows, metric_fn, autocast)

    # -- on the event loop -----------------------------------------------------

    async def evaluate(self, data: Any, rows: int, metric_fn: MetricFn, after_step: int) -> dict[str, float]:
        """Evaluate this device's shard of one batch in its worker thread; values are row-weighted sums.

        ``after_step``: the session's last step, which its errors name (a
        session resumed after step N evaluates after step N before this
        device has run a step of its own).

        :raises ~gsync.WorkerFailed: when ``metric_fn`` raises.
        :raises ~gsync.SyncTimeout: when it runs longer than ``sync_timeout`` (its wait behind other devices on a
            shared thread does not count), as an optimizer step would.
        """
        if rows == 0:
            return {}
        self.jobs.step = after_step
        result: dict[str, float] = await self.jobs.run_timed(self._evaluate, data, rows, metric_fn, site="evaluate")
        return result

    async def run(self) -> None:
        """Train on every shard received, until the session closes :attr:`shards` and ``Close`` arrives.

        :raises ~gsync.WorkerFailed: when this device's training code raises.
        :raises ~gsync.SyncTimeout: when this device's optimizer step stalls.
        """
        try:
            first = True
            while True:
                try:
                    shard = await self.shards.receive()
                except MailboxClosed:
                    break  # the end of the data
                turns = self._context.first_step if first else None
                first = False
                if turns is not None:
                    await self._first_forward_backward(shard, turns)
                else:
                    await self.jobs.run(self._forward_backward, shard)
                if not await self._await_sync(shard.step, turns):
                    return
                if self._context.sharding is not None:
                    # The other devices' updated shards must be in this replica before it runs again.
                    await self._context.sharding.gathered(shard.step)
            message = await self.mailbox.receive()
            if not isinstance(message, Close):
                raise SyncFailed(self.step, None, f"protocol error: {message!r} after the last step")
        finally:
            self.shards.close()
            self.mailbox.close()

    async def _first_forward_backward(self, shard: Shard, turns: FirstStepInTurn) -> None:
        """The session's first forward and backward, after the device before this one's."""
        phase = "forward_backward"
        jobs = self.jobs
        try:
            # With SyncBatchNorm the devices meet inside the job: they take their turns there (batchnorm.py).
            if self.index > 0 and self._context.batch_stats is None:
                # Seen by the heartbeat and a timeout as waiting on a peer device, not as stuck.
                jobs.step, jobs.site, jobs.waiting = shard.step, "waiting for its first-step turn", True
                await turns.wait_turn(phase, self.index)
                jobs.waiting = False
            await jobs.run(self._forward_backward, shard)
        finally:
            turns.done(phase, self.index)

    async def _await_sync(self, step: int, turns: FirstStepInTurn | None = None) -> bool:
        """Wait for ``step``'s sync and apply it; ``turns``: the first step's, whose optimizer steps go in turn."""
        self.jobs.waiting = True
        # Left set when the wait ends in cancellation: a device whose run is
        # ending while it waited for the sync was waiting, not stuck.
        message = await self.mailbox.receive()
        if turns is not None:
            await turns.wait_turn("optimizer", self.index)
        self.jobs.waiting = False
        try:
            return await self._apply_synced(step, message)
        finally:
            if turns is not None:
                turns.done("optimizer", self.index)

    async def _apply_synced(self, step: int, message: DeviceMessage) -> bool:
        """The actor's one match: apply the step, or end."""
        match message:
            case StepSynced(step=synced_step, skip=skip, plan=plan) if synced_step == step:
                if plan is not None:
                    self.capture.plan_is_final(plan)
                # A skipped step still steps the LR scheduler: user code, under the same deadline.
                job = self.update.skip if skip else self.update.apply
                applied, fingerprint = await self.jobs.run_timed(job, message, site="optimizer step")
                if fingerprint is not None and self._context.fingerprints is not None:
                    self._context.fingerprints.record(step, self.index, fingerprint)
                if self._context.sharding is not None:
                    self._context.sharding.applied(self.index, applied)  # reported once the shards are gathered
                else:
                    self._context.session.post(applied)
                return True
            case StepSynced():
                raise SyncFailed(step, None, f"protocol error: {self.spec.name} got {message!r} while at step {step}")
            case Close():
                return False

    def close(self) -> None:
        self.capture.remove_hooks()
        self.update.close()
        self.jobs.worker.stop()
        if self.index == 0 and self._context.batch_stats is not None:
            self._context.batch_stats.close()
