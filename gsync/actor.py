"""The device actor: one async task per device, owning a replica, its optimizer and its shards.

Per step the actor runs forward and backward in its worker thread. Gradient
hooks, in the thread where backward runs, count readiness per bucket and post
one ``BucketReady`` per bucket to the sync server; buckets with gradients that
never arrived (unused parameters, or a device with an empty shard) are posted
when backward returns, their missing slots left at zero. The actor then waits
for ``StepSynced`` and runs the optimizer step in its thread.

Nothing heavy runs on the event loop. If the actor is cancelled mid-job, the
job finishes or stops at the next gradient hook (which polls the engine's
abort flag); its result is discarded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from anyio.abc import ObjectReceiveStream
from torch import nn

from ._threads import LoopHandle, WorkerThread
from .batches import move_batch
from .buckets import BucketPlan, Readiness, ReplicaGrads
from .devices import DeviceSpec
from .errors import ConfigError, GsyncError, InputTypeError, SyncFailed, WorkerFailed
from .mailbox import Mailbox
from .trace import Trace
from .messages import BucketReady, Close, DeviceMessage, ServerMessage, StepSynced

__all__ = ("Shard", "DeviceActor", "FitAborted")


class FitAborted(Exception):
    """Raised inside a worker thread to stop a job early once ``fit`` is ending."""


@dataclass(frozen=True)
class Shard:
    step: int
    rows: int
    total_rows: int
    data: Any


LossFn = Callable[[nn.Module, Any], torch.Tensor]
StepObserver = Callable[[int, str], None]


class DeviceActor:
    def __init__(
        self,
        *,
        index: int,
        spec: DeviceSpec,
        replica: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: BucketPlan,
        loss_fn: LossFn,
        server: Mailbox[ServerMessage],
        loop: LoopHandle,
        abort: threading.Event,
        trace: Trace | None = None,
        on_site: StepObserver | None = None,
    ) -> None:
        self.index = index
        self.spec = spec
        self.replica = replica
        self.optimizer = optimizer
        self.mailbox: Mailbox[DeviceMessage] = Mailbox(f"device {spec.name}", loop)
        self.worker = WorkerThread(f"gsync-device-{index}", loop)
        self.params = [p for _, p in replica.named_parameters() if p.requires_grad]
        self.grads = ReplicaGrads(plan, self.params, spec.torch_device)
        self.readiness = Readiness(plan)
        self.losses: dict[int, float] = {}
        self.site = "data"
        self.step = -1
        self.applied_step: int | None = None
        self._plan = plan
        self._loss_fn = loss_fn
        self._server = server
        self._abort = abort
        self._on_site = on_site
        self._trace = trace
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook_for(position))
            for position, param in enumerate(self.params)
        ]

    # -- in the backward thread ------------------------------------------------

    def _hook_for(self, position: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if self._abort.is_set():
                raise FitAborted
            bucket = self.readiness.mark(position)
            if param.grad is not self.grads.views[position]:
                raise ConfigError(
                    f"the .grad of parameter {self._plan.names[position]!r} on {self.spec.name} was replaced "
                    "during backward; gsync keeps gradients in its bucket buffers, so modify grads in place"
                )
            if bucket is not None:
                self._server.post_threadsafe(BucketReady(self.index, self.step, bucket))

        return on_grad_ready

    def _enter(self, site: str) -> AbstractContextManager[None]:
        """Mark the start of a phase; the returned context times it when tracing."""
        self.site = site
        if self._on_site is not None:
            self._on_site(self.step, site)
        if self._trace is None:
            return nullcontext()
        return self._trace.span(site, self.step, self.index)

    def _forward_backward(self, shard: Shard) -> float | None:
        self.step = shard.step
        self._enter("data")
        data = move_batch(shard.data, self.spec.torch_device)
        self.grads.zero_()
        self.readiness.reset()
        if shard.rows == 0:
            # An empty shard has nothing to learn from: it posts every bucket
            # as unused (all zeros) and is weighted zero in the reduction.
            self._post_unfinished()
            return None
        with self._enter("forward"):
            loss = self._loss_fn(self.replica, data)
            self._check_loss(loss)
        with self._enter("backward"):
            loss.backward()
        self._post_unfinished()
        return loss.item()

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

    def _post_unfinished(self) -> None:
        for bucket, unused in self.readiness.unfinished():
            self._server.post_threadsafe(BucketReady(self.index, self.step, bucket, unused))

    def _apply(self, unused: tuple[int, ...]) -> None:
        # A parameter no device used must look untouched to the optimizer
        # (grad None), exactly as in one-process training.
        for position in unused:
            self.params[position].grad = None
        try:
            with self._enter("optimizer"):
                self.optimizer.step()
        finally:
            for position in unused:
                self.params[position].grad = self.grads.views[position]

    # -- on the event loop -----------------------------------------------------

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await self.worker.run(lambda: fn(*args))
        except GsyncError:
            self._abort.set()
            raise
        except Exception as error:
            self._abort.set()
            raise WorkerFailed(self.spec.name, self.index, self.step, self.site) from error

    async def run(self, shards: ObjectReceiveStream[Shard]) -> None:
        """Train on every shard received, until the feeder closes ``shards`` and ``Close`` arrives.

        :raises ~gsync.WorkerFailed: when this device's training code raises.
        """
        try:
            async with shards:
                async for shard in shards:
                    loss = await self._in_thread(self._forward_backward, shard)
                    if loss is not None:
                        self.losses[shard.step] = loss * shard.rows / shard.total_rows
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
            case StepSynced(step=synced, unused=unused) if synced == step:
                await self._in_thread(self._apply, unused)
                self.applied_step = step
                return True
            case StepSynced():
                raise SyncFailed(step, None, f"protocol error: {self.spec.name} got {message!r} while at step {step}")
            case Close():
                return False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.worker.stop()
