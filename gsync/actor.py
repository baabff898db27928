"""The device actor: one async task per device, owning a replica, its optimizer and its shards.

Per step the actor runs forward and backward in its worker thread. Gradient
hooks, in the thread where backward runs, count readiness per bucket and post
one ``BucketReady`` per bucket to the sync server; buckets with gradients that
never arrived (unused parameters, or a device with an empty shard) are posted
when backward returns, their missing slots left at zero. The actor then waits
for ``StepSynced`` and runs the optimizer step in its thread.

Nothing heavy runs on the event loop. If the actor is cancelled mid-job, the
job stops at its next phase boundary or gradient hook, which poll the fit's
abort flag; its result is discarded.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import torch
from anyio.abc import ObjectReceiveStream
from torch import nn

from ._threads import FitAborted, LoopHandle, WorkerThread
from .batches import move_batch
from .buckets import BucketPlan, Readiness, ReplicaGrads
from .devices import DeviceSpec
from .errors import (
    GsyncError,
    InputTypeError,
    NonFiniteLoss,
    ReplicasDiverged,
    SyncFailed,
    SyncTimeout,
    WorkerFailed,
)
from .mailbox import Mailbox
from .messages import BucketReady, Close, DeviceMessage, ServerMessage, StepSynced
from .streams import HostStreamSync, StreamSync
from .trace import Trace

__all__ = ("Shard", "DeviceActor", "ActorContext", "SiteHook")


@dataclass(frozen=True)
class Shard:
    step: int
    rows: int
    total_rows: int
    data: Any


LossFn = Callable[[nn.Module, Any], torch.Tensor]
SiteHook = Callable[[int, int, str, threading.Event], None]
"""Called as ``hook(device_index, step, site, abort)`` in the worker thread as each phase starts."""


class ReplicaFingerprints:
    """Collects one parameter fingerprint per device per checked step and compares them."""

    def __init__(self, device_names: Sequence[str]) -> None:
        self._names = list(device_names)
        self._pending: dict[int, dict[int, float]] = {}

    def record(self, step: int, device: int, value: float) -> None:
        """Called on the loop. :raises ~gsync.ReplicasDiverged: when the last device's value disagrees."""
        values = self._pending.setdefault(step, {})
        values[device] = value
        if len(values) < len(self._names):
            return
        del self._pending[step]
        reference = values[0]
        if any(not math.isclose(v, reference, rel_tol=1e-9, abs_tol=1e-12) for v in values.values()):
            raise ReplicasDiverged(step, {self._names[d]: values[d] for d in sorted(values)})


@dataclass
class ActorContext:
    """What every actor of one ``fit`` shares.

    ``plan`` may be replaced once, by the bucket rebuild after the first step;
    each actor adopts the new plan at the start of its next step.
    """

    plan: BucketPlan
    loss_fn: LossFn
    server: Mailbox[ServerMessage]
    loop: LoopHandle
    abort: threading.Event
    sync_timeout: float
    on_nonfinite: Literal["raise", "skip"] = "raise"
    check_replicas_every: int | None = None
    fingerprints: ReplicaFingerprints | None = None
    trace: Trace | None = None
    site_hooks: Sequence[SiteHook] = field(default_factory=tuple)
    first_bucket_bytes: int = 1 << 20
    bucket_cap_bytes: int = 25 << 20
    streams: StreamSync = field(default_factory=lambda: HostStreamSync(1, 1))
    """Orders bucket production, reduction and the optimizer step (CUDA streams, or host checks on CPU)."""


class DeviceActor:
    def __init__(
        self,
        *,
        index: int,
        spec: DeviceSpec,
        replica: nn.Module,
        optimizer: torch.optim.Optimizer,
        context: ActorContext,
    ) -> None:
        self.index = index
        self.spec = spec
        self.replica = replica
        self.optimizer = optimizer
        self.mailbox: Mailbox[DeviceMessage] = Mailbox(f"device {spec.name}", context.loop)
        self.worker = WorkerThread(f"gsync-device-{index}", context.loop)
        self.params = [p for _, p in replica.named_parameters() if p.requires_grad]
        self.plan = context.plan
        self.grads = ReplicaGrads(self.plan, self.params, spec.torch_device)
        self.readiness = Readiness(self.plan)
        self.losses: dict[int, float] = {}
        self.site = "data"
        self.step = -1
        # Written only by the worker thread; read by the engine once the thread
        # is idle, to pick the replica a checkpoint is taken from.
        self.applied_step = -1
        self.optimizer_dirty = False
        self.failure: GsyncError | None = None
        self._context = context
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook_for(position))
            for position, param in enumerate(self.params)
        ]

    # -- in the worker thread (and autograd's, for the hooks) ------------------

    def _hook_for(self, position: int) -> Callable[[torch.Tensor], None]:
        context = self._context

        def on_grad_ready(param: torch.Tensor) -> None:
            if context.abort.is_set():
                raise FitAborted
            bucket = self.readiness.mark(position)
            self.grads.take(position)
            if bucket is not None:
                context.streams.mark_ready(self.index, bucket)
                context.server.post_threadsafe(BucketReady(self.index, self.step, bucket))

        return on_grad_ready

    def _enter(self, site: str) -> AbstractContextManager[None]:
        """Start a phase: stop here if the fit is ending; the returned context times the phase when tracing."""
        context = self._context
        if context.abort.is_set():
            raise FitAborted
        self.site = site
        if context.site_hooks:
            for hook in context.site_hooks:
                hook(self.index, self.step, site, context.abort)
            # A hook may have blocked while the fit ended: do not start the phase then.
            if context.abort.is_set():
                raise FitAborted
        if context.trace is None:
            return nullcontext()
        return context.trace.span(site, self.step, self.index)

    def _adopt_plan(self) -> None:
        """Switch to a rebuilt bucket plan, between steps (each step writes every bucket slot afresh)."""
        self.plan = self._context.plan
        self.grads = ReplicaGrads(self.plan, self.params, self.spec.torch_device)
        self.readiness = Readiness(self.plan)

    def _forward_backward(self, shard: Shard) -> None:
        self.step = shard.step
        with self._enter("data"):
            data = move_batch(shard.data, self.spec.torch_device)
        if self.plan is not self._context.plan:
            self._adopt_plan()
        self.readiness.reset()
        if shard.rows == 0:
            # An empty shard has nothing to learn from: it posts every bucket
            # as unused (all zeros) and is weighted zero in the reduction.
            self._post_unfinished()
            return
        with self._enter("forward"):
            loss = self._context.loss_fn(self.replica, data)
            self._check_loss(loss)
            value = loss.item()
        # Recorded here, before any bucket of this device is posted, so the
        # step's closing job (which follows every BucketReady) can read it.
        self.losses[self.step] = value * shard.rows / shard.total_rows
        if not math.isfinite(value):
            if self._context.on_nonfinite == "raise":
                raise NonFiniteLoss(self.spec.name, self.index, self.step, value)
            # Skipping: no backward, so the buckets are zero-filled; the server
            # sees the flag and tells every device to skip this step's update.
            self._post_unfinished(skip=True)
            return
        with self._enter("backward"):
            self.grads.release()
            loss.backward()
        self._post_unfinished()

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

    def _post_unfinished(self, skip: bool = False) -> None:
        for bucket, unused in self.readiness.unfinished():
            self.grads.fill_missing(unused)
            self._context.streams.mark_ready(self.index, bucket)
            self._context.server.post_threadsafe(BucketReady(self.index, self.step, bucket, unused, skip))

    def _skip(self, step: int) -> None:
        # The step is left out, but the next step writes the buckets, which
        # must still wait for this step's reductions.
        self._context.streams.before_apply(self.index)
        # Left out everywhere, so the replica is as consistent after it as before.
        self.applied_step = step

    def _apply(self, step: int, unused: tuple[int, ...]) -> float | None:
        self._context.streams.before_apply(self.index)
        with self._enter("optimizer"):
            # A parameter no device used must look untouched to the optimizer
            # (grad None), exactly as in one-process training.
            for position in unused:
                self.params[position].grad = None
            self.optimizer_dirty = True
            try:
                self.optimizer.step()
            finally:
                for position in unused:
                    self.params[position].grad = self.grads.views[position]
            # Only a step that returned leaves the replica consistent; the step
            # is recorded before the flag clears, so a reader never sees it late.
            self.applied_step = step
            self.optimizer_dirty = False
        every = self._context.check_replicas_every
        if every is not None and (step + 1) % every == 0:
            with torch.no_grad():
                return float(sum(p.detach().double().sum() for p in self.params))  # type: ignore[arg-type]
        return None

    # -- on the event loop -----------------------------------------------------

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a job in the worker thread, turning a failure into gsync's error right where it happens.

        The failure is stamped and kept on the actor before it propagates, and
        the abort flag is raised at once, so peers stop at their next phase
        boundary and a failure whose task was already cancelled is still reported.
        """
        try:
            return fn(*args)
        except FitAborted:
            raise
        except GsyncError as error:
            self.failure = error
            self._context.abort.set()
            raise
        except Exception as error:
            failure = WorkerFailed(self.spec.name, self.index, self.step, self.site)
            failure.__cause__ = error
            self.failure = failure
            self._context.abort.set()
            raise failure from error

    def _on_compute_stream(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._context.streams.compute_stream(self.index):
            return self._guarded(fn, *args)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.worker.run(lambda: self._on_compute_stream(fn, *args))

    async def run(self, shards: ObjectReceiveStream[Shard]) -> None:
        """Train on every shard received, until the feeder closes ``shards`` and ``Close`` arrives.

        :raises ~gsync.WorkerFailed: when this device's training code raises.
        :raises ~gsync.SyncTimeout: when this device's optimizer step stalls.
        """
        try:
            async with shards:
                async for shard in shards:
                    await self._in_thread(self._forward_backward, shard)
                    if not await self._await_sync(shard.step):
                        return
            message = await self.mailbox.receive()
            if not isinstance(message, Close):
                raise SyncFailed(self.step, None, f"protocol error: {message!r} after the last step")
        finally:
            self.mailbox.close()

    async def _await_sync(self, step: int) -> bool:
        message = await self.mailbox.receive()
        match message:
            case StepSynced(step=synced, unused=unused, skip=skip) if synced == step:
                if skip:
                    await self._in_thread(self._skip, step)
                    return True
                with anyio.move_on_after(self._context.sync_timeout) as deadline:
                    fingerprint = await self._in_thread(self._apply, step, unused)
                if deadline.cancelled_caught:
                    self._context.abort.set()
                    raise SyncTimeout(
                        step, self._context.sync_timeout, stalled_devices=[self.spec.name], phase="optimizer step"
                    )
                if fingerprint is not None and self._context.fingerprints is not None:
                    self._context.fingerprints.record(step, self.index, fingerprint)
                return True
            case StepSynced():
                raise SyncFailed(step, None, f"protocol error: {self.spec.name} got {message!r} while at step {step}")
            case Close():
                return False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.worker.stop()
