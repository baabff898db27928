"""The device actor: one async task per device, owning a replica, its optimizer and its shards.

Per step the actor runs forward and backward in its worker thread, once per
global batch the step accumulates. In the step's last backward, gradient
hooks (in the thread where backward runs) count readiness per bucket and post
one ``BucketReady`` per bucket to the sync server; the last bucket, launched
after all others anyway, has no hooks once the plan is final and is taken in
one pass when backward returns. The backward passes before the last only add
their weighted gradients into the buckets, so accumulation moves no bytes.
Buckets with gradients that never arrived (unused parameters, or a
device with an empty shard) are posted when the last backward returns, their
missing gradients zero. (In one process on CPU a step of one batch leaves
most gradients where autograd put them, and the reduction takes them
there: see :func:`~gsync._core.gradients.buckets.reduced_in_place`.) The actor then waits
for ``StepSynced``, runs the optimizer step (with clipping, the GradScaler
and the LR scheduler of the recipe) in its thread, and posts
``StepApplied`` to the session.

Nothing heavy runs on the event loop. If the actor is cancelled mid-job, the
job stops at its next phase boundary or gradient hook (the last bucket has
none once the plan is final), which poll the session's abort flag; its
result is discarded.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch
from torch import nn

from ..threads import FitAborted, JobTimedOut, WorkerThread
from ..data.batches import move_batch
from ..gradients.buckets import Readiness, ReplicaGrads, owns_its_memory, reduced_in_place
from .context import ActorContext, FirstStepInTurn, Shard
from ..devices import DeviceSpec
from ...errors import (
    GsyncError,
    InputTypeError,
    MailboxClosed,
    NonFiniteLoss,
    SyncFailed,
    SyncTimeout,
    WorkerFailed,
)
from .mailbox import Mailbox
from .messages import (
    BucketReady,
    Close,
    DeviceMessage,
    ForwardDone,
    StepApplied,
    StepSynced,
)
from .readout import LossReadout, ScalarReadout

from ...types import MetricFn

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
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.mailbox: Mailbox[DeviceMessage] = Mailbox(f"device {spec.name}", context.loop)
        self.shards: Mailbox[Shard] = Mailbox(f"shards of {spec.name}", context.loop)
        """The session posts each step's shard here, and closes it at the end of the data."""
        self._shares_thread = worker is not None
        if worker is None:
            threads = None if context.intra_op_threads is None else context.intra_op_threads[0]
            worker = WorkerThread(f"gsync-device-{index}", context.loop, torch_threads=threads)
        self.worker = worker
        """The thread that runs this device's jobs: its own, or one its process's CPU devices share."""
        self.queued = False
        """A job of this device waits for the shared thread, behind another device's (read by the sync server
        and the heartbeat: a device held up by another is not the one to blame)."""
        self.params = [p for _, p in replica.named_parameters() if p.requires_grad]
        self.site = "data"
        self.step = -1
        self.waiting = False
        """Waiting for the step's gradient sync, or for its turn on a shared thread (read by the heartbeat, from its
        thread)."""
        # Written only by the worker thread; read by the session once the thread
        # is idle, to pick the replica a checkpoint is taken from.
        self.applied_step = -1
        self.optimizer_dirty = False
        self.failure: GsyncError | None = None
        self._context = context
        # How the running backward treats gradients (see _hook_for); set per batch of a step.
        self._posting = True
        self._grad_scale = 1.0
        self._direct = False
        self._one_batch = True
        self._got_grad = bytearray(len(self.params))
        self._cuda = spec.torch_device.type == "cuda"
        self._losses = LossReadout(spec.torch_device, context.abort)
        self._grad_norm = ScalarReadout(spec.torch_device, context.abort)
        # Whether the optimizer's step ran in this optimizer job: with a GradScaler, that is whether the step
        # was skipped, known without GradScaler.get_scale(), a host sync (see _scaled_step).
        self._optimizer_stepped = False
        if scaler is not None and hasattr(optimizer, "register_step_post_hook"):
            optimizer.register_step_post_hook(self._on_optimizer_step)
        self._hooks: list[Any] = []
        self._unhooked: tuple[int, ...] = ()
        self._hooked_final_plan = False
        # Set by a post of the running forward/backward job that lets the server act: the job wakes the
        # server as it ends (see _post_ready). Only the worker thread writes and reads it (hooks, which may
        # run in autograd's thread, wake the server themselves), so it needs no lock.
        self._wake_server = False
        # The device runs kernels behind the host (an accelerator): a reduction launched early can still
        # overlap its queued work.
        self._queues_work = spec.torch_device.type != "cpu"
        self._adopt_plan()  # sets plan, grads, the in-place flags, readiness and the hooks

    @property
    def name(self) -> str:
        return self.spec.name

    def bucket_buffer(self, bucket: int) -> torch.Tensor:
        return self.grads.flat(bucket)

    def bucket_grads(self, bucket: int) -> list[torch.Tensor]:
        """The tensors that hold bucket ``bucket``'s gradients this step, once it is posted.

        Its buffer, where the step formed every gradient in it (several
        batches, or a bucket not reduced in place); otherwise its parameters'
        ``.grad`` in bucket order, each the step's dense gradient: autograd's
        own, a view into the bucket, or zeros. Every device of a step has as
        many batches and the same plan, so all answer alike.
        """
        if not (self._direct and self._in_place[bucket]):
            return [self.grads.flat(bucket)]
        params = self.params
        return [params[position].grad for position in self.plan.buckets[bucket].params]  # type: ignore[misc]

    def where(self) -> str:
        """Where this device was last seen, e.g. ``"step 2, backward"`` (for timeout reports)."""
        return f"step {self.step}, {self.site}"

    # -- in the worker thread (and autograd's, for the hooks) ------------------

    def _hook_for(self, position: int) -> Callable[[torch.Tensor], None]:
        context = self._context
        got_grad = self._got_grad

        def on_grad_ready(param: torch.Tensor) -> None:
            if context.abort.is_set():
                raise FitAborted
            bucket = self.readiness.mark(position)
            if not self._keeps_in_place(position, param.grad):  # type: ignore[arg-type]
                if self._cuda:
                    self._before_hook_copy(param.grad)  # type: ignore[arg-type]
                self.grads.take(position, self._grad_scale, add=bool(got_grad[position]))
            got_grad[position] = 1
            if bucket is not None and self._posting:
                self._post_ready(bucket, during_backward=True)

        return on_grad_ready

    def _before_hook_copy(self, grad: torch.Tensor) -> None:
        """CUDA, in a gradient hook: order the copy of ``grad`` into its bucket on the hook's stream.

        Autograd runs the hook on the stream of the parameter's gradient
        accumulation, which for a model that runs part of its forward on a
        stream of its own is that stream, not the compute stream: it must wait
        for the last round's reduction and optimizer step before it writes
        the bucket (``before_write``), and the gradient, which may have been
        made on yet another stream, must not be reused by that stream's
        allocator before the copy ran (``record_stream``).
        """
        self._context.streams.before_write(self.index)
        if not grad.is_sparse:
            grad.record_stream(torch.cuda.current_stream(self.spec.torch_device))

    def _copied_on_compute_stream(self, grads: list[torch.Tensor]) -> None:
        """CUDA, after a backward: ``grads``, just copied into their buckets on the compute stream, are dropped.

        A gradient made on a side stream belongs to that stream's pool: without
        ``record_stream`` the allocator could hand its memory to new side-stream
        work before the compute stream's copy has read it. (For a gradient made
        on the compute stream itself this is a no-op.)
        """
        stream = torch.cuda.current_stream(self.spec.torch_device)
        for grad in grads:
            if not grad.is_sparse:
                grad.record_stream(stream)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_stepped = True

    def _buckets_in_place(self) -> list[bool]:
        """Per bucket of the plan: whether a step of one batch leaves its gradients where autograd put them."""
        if self._context.alone:
            return [True] * len(self.plan.buckets)  # nothing is reduced
        return [self._context.grads_in_place and reduced_in_place(bucket) for bucket in self.plan.buckets]

    def _keeps_in_place(self, position: int, grad: torch.Tensor) -> bool:
        """Whether this step's gradient of parameter ``position`` stays where autograd put it, rather than being
        copied into its bucket slot.

        A sparse gradient goes through its (dense) slot. So does one that
        shares its memory with another tensor (see :func:`owns_its_memory`):
        the reduction writes into the gradients it takes, which must change
        nothing else.
        """
        if not (self._direct and self._in_place[self.plan.bucket_of[position]]) or grad.is_sparse:
            return False
        return self._context.alone or owns_its_memory(grad)

    def _post_ready(self, bucket: int, unused: tuple[int, ...] = (), during_backward: bool = False) -> None:
        """Tell the sync server ``bucket`` is final on this device (after ordering it behind its writes).

        Only the post that completes the bucket on every device wakes the
        server; the rest ride along. It wakes the server at once from a
        gradient hook, so the bucket's reduction overlaps the rest of
        backward, and on an accelerator, whose queue may still be running
        backward when the host is done with it. On CPU, once backward has
        returned, nothing is left to overlap: the wake-up waits for the end
        of the job (see :meth:`_forward_backward`).
        """
        context = self._context
        context.streams.mark_ready(self.index, bucket)
        context.server.post_threadsafe(BucketReady(self.index, self.step, bucket, unused), wake=False)
        if context.arrivals.completes(bucket):
            if during_backward or self._queues_work:
                context.server.wake()
            else:
                self._wake_server = True

    def _install_hooks(self) -> None:
        """A readiness hook on every parameter, except the last bucket's once the bucket plan is final.

        Each Python hook costs the thread running backward a turn at the
        GIL, and with several device threads a wait for the others. The
        last bucket is launched after every other bucket, so never before
        backward's last gradient: taking its gradients when backward
        returns, in one pass without hooks (:meth:`_take_unhooked`), costs
        no overlap. (A parameter of it reached twice by backward, which a
        hook reports as an error, is then simply summed, as in a plain
        loop.) While the plan may still be rebuilt every parameter keeps its
        hook: the first step's order is observed through them.
        """
        for hook in self._hooks:
            hook.remove()
        final = self._context.plan_final
        # In bucket order, as the bucket's slots are.
        self._unhooked = tuple(self.plan.buckets[-1].params) if final and self.plan.buckets else ()
        last = frozenset(self._unhooked)
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook_for(position))
            for position, param in enumerate(self.params)
            if position not in last
        ]
        self._hooked_final_plan = final

    def _take_unhooked(self) -> None:
        """After a backward: take the gradients of the parameters without a hook, as their hooks would have."""
        if self._take_whole_bucket():
            return
        params, got_grad = self.params, self._got_grad
        # release() left every .grad None before this backward: a gradient now is this backward's.
        arrived = [position for position in self._unhooked if params[position].grad is not None]
        slots: list[torch.Tensor] = []
        fresh: list[torch.Tensor] = []
        taken: list[torch.Tensor] = []
        for position in arrived:
            grad = params[position].grad
            if self._keeps_in_place(position, grad):  # type: ignore[arg-type]
                continue
            taken.append(grad)  # type: ignore[arg-type]
            if grad.is_sparse or got_grad[position] or self._grad_scale != 1.0:  # type: ignore[union-attr]
                self.grads.take(position, self._grad_scale, add=bool(got_grad[position]))
            else:
                view = self.grads.view(position)
                slots.append(view)
                fresh.append(grad)  # type: ignore[arg-type]
                params[position].grad = view
        if slots:
            # One call for the bucket, not one per tensor (each releases and retakes the GIL).
            torch._foreach_copy_(slots, fresh)
        if self._cuda and taken:
            self._copied_on_compute_stream(taken)
        for position in arrived:
            bucket = self.readiness.mark(position)
            got_grad[position] = 1
            if bucket is not None and self._posting:
                self._post_ready(bucket)

    def _take_whole_bucket(self) -> bool:
        """The common case of :meth:`_take_unhooked`, in a few calls for the whole bucket rather than several
        per parameter: a step of one batch gave every parameter of the unhooked bucket a fresh dense gradient,
        which goes into the bucket. Returns whether it was that case (if not, nothing was done)."""
        bucket = len(self.plan.buckets) - 1
        if not self._one_batch or (self._direct and self._in_place[bucket]):
            return False
        params = [self.params[position] for position in self._unhooked]
        grads = [param.grad for param in params]
        if any(grad is None or grad.is_sparse for grad in grads):
            return False
        views = self.grads.bucket_views(bucket)
        # One call for the bucket, not one per tensor (each releases and retakes the GIL).
        torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
        if self._cuda:
            self._copied_on_compute_stream(grads)  # type: ignore[arg-type]
        for param, view in zip(params, views):
            param.grad = view
        got_grad = self._got_grad
        for position in self._unhooked:
            got_grad[position] = 1
        if self.readiness.mark_all(self._unhooked) is not None and self._posting:
            self._post_ready(bucket)
        return True

    def _enter(self, site: str) -> AbstractContextManager[None]:
        """Start a site (phase): stop here if the session is ending; the returned context runs the site hooks
        as it is entered, and times the phase (hooks included) when tracing."""
        context = self._context
        if context.abort.is_set():
            raise FitAborted
        self.site = site
        if context.trace is None and not context.site_hooks:
            return nullcontext()
        return self._phase(site)

    @contextmanager
    def _phase(self, site: str) -> Iterator[None]:
        context = self._context
        # A fault a hook injects (a raise, a stall) happens inside the phase's span, as a real one would.
        with context.trace.span(site, self.step, self.index) if context.trace is not None else nullcontext():
            if context.site_hooks:
                for hook in context.site_hooks:
                    hook(self.index, self.step, site, context.abort)
                # A hook may have blocked while the session ended: do not start the phase then.
                if context.abort.is_set():
                    raise FitAborted
            yield

    def _adopt_plan(self) -> None:
        """Take the session's bucket plan: when built, and after a rebuild, between steps (each step writes every
        bucket slot afresh)."""
        self.plan = self._context.plan
        self.grads = ReplicaGrads(self.plan, self.params, self.spec.torch_device, lazy=self._context.grads_in_place)
        self._in_place = self._buckets_in_place()
        self.readiness = Readiness(self.plan)
        self._install_hooks()

    def _autocast(self) -> AbstractContextManager[Any]:
        dtype = self._context.recipe.autocast
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.spec.torch_device.type, dtype=dtype)

    def _forward_backward(self, shard: Shard) -> None:
        """Forward and backward of every batch of the step; only the last backward posts buckets.

        What the job posts once backward has returned (on CPU the last
        bucket and the unused buckets; ``ForwardDone`` on every device) wakes
        the server once, as the job ends: that wake-up and the job's own
        report then usually ride on one, where each post waking the loop
        would have it take the GIL from this thread in the middle of the
        job's last lines.
        """
        self._wake_server = False
        try:
            self._run_batches(shard)
        except BaseException:
            if self._wake_server:
                # The server still gets what was posted; if the session is already gone,
                # the job's own error is the one to report.
                with suppress(MailboxClosed):
                    self._context.server.wake()
            raise
        if self._wake_server:
            self._context.server.wake()

    def _run_batches(self, shard: Shard) -> None:
        self.step = shard.step
        with self._enter("data"):
            parts = [move_batch(data, self.spec.torch_device) for data in shard.data]
        if self.plan is not self._context.plan:
            self._adopt_plan()
        elif self._context.plan_final and not self._hooked_final_plan:
            self._install_hooks()
        weight = shard.weight
        batches = len(parts)
        readout = self._losses
        readout.start(batches)
        # With one batch, the gradient autograd delivers is the step's: where the
        # reduction can take it as it is, it stays in .grad (no copy into the bucket).
        self._one_batch = batches == 1
        self._direct = self._context.grads_in_place and self._one_batch
        last_backward_ran = False
        self._got_grad[:] = bytes(len(self._got_grad))
        for position, (rows, total, data) in enumerate(zip(shard.rows, shard.total_rows, parts)):
            if rows == 0:
                # An empty shard has nothing to learn from: the device posts its
                # buckets as unused (zeros), weighted by what it did see.
                continue
            last = position == batches - 1
            self.readiness.reset()
            self._posting = last
            # The device's gradient is the weighted mean over the step's
            # batches; the reduction weights it by ``weight`` as a whole.
            self._grad_scale = 1.0 if batches == 1 else rows / total / batches / weight
            with self._enter("forward"), self._autocast():
                loss = self._context.recipe.loss_fn(self.replica, data)
                self._check_loss(loss)
                # Read after backward is launched, not here: no host sync between the two.
                readout.add(loss, rows / total / batches)
            with self._enter("backward"):
                self.grads.release()
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                if self._unhooked:
                    self._take_unhooked()
            last_backward_ran = last
        if batches > 1:
            # Parameters that got gradients in earlier batches but not in the
            # last backward were left with grad None by its release().
            self.grads.attach()
        losses = readout.read()
        nonfinite = next((value for value, _ in losses if not math.isfinite(value)), None)
        if nonfinite is not None and self._context.on_nonfinite == "raise":
            # Before the server hears of this device's losses, so the step never completes anywhere.
            raise NonFiniteLoss(self.spec.name, self.index, self.step, nonfinite)
        if not last_backward_ran:
            # The last shard was empty: no bucket was posted this step, so every bucket is.
            self.readiness.reset()
        self._post_unfinished()
        # A non-finite loss (on_nonfinite="skip") had its backward too; the
        # server tells every device to leave the step's update out.
        self._post_forward_done(sum(value * share for value, share in losses), skip=nonfinite is not None)

    def _post_forward_done(self, loss_share: float, skip: bool) -> None:
        context = self._context
        # As with buckets, only the last device's losses let the server finish the step: the rest ride along.
        context.server.post_threadsafe(ForwardDone(self.index, self.step, loss_share, skip), wake=False)
        if context.arrivals.completes_losses():
            self._wake_server = True

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
        """Post the buckets the last backward did not complete; slots of parameters that got no gradient are zeroed."""
        for bucket, not_in_last in self.readiness.unfinished():
            unused = tuple(p for p in not_in_last if not self._got_grad[p])
            if self._direct and self._in_place[bucket]:
                for position in unused:
                    param = self.params[position]
                    # Alone in the run the optimizer sees None, as in a plain loop; otherwise the
                    # reduction needs this device's term, and the optimizer sees None only where no
                    # device had a gradient (StepSynced.unused). Fresh zeros, as autograd's gradients
                    # are fresh each step: a bucket slot would hold its whole bucket for the run.
                    param.grad = None if self._context.alone else torch.zeros_like(param)
            else:
                self.grads.fill_missing(unused)
            self._post_ready(bucket, unused)

    def _learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _step_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def _skip(self, synced: StepSynced) -> tuple[StepApplied, None]:
        # The step is left out, but the next step writes the buckets, which
        # must still wait for this step's reductions.
        self._context.streams.before_apply(self.index)
        lr = self._learning_rate()
        with self._enter("optimizer"):
            # The schedule follows the step count, as in a plain loop that skips a step; a checkpoint holds the
            # scheduler's state as of the parameters' step, as in _apply.
            self.optimizer_dirty = True
            self._step_scheduler()
            # Left out everywhere, so the replica is as consistent after it as before.
            self.applied_step = synced.step
            self.optimizer_dirty = False
        return StepApplied(self.index, synced.step, synced.loss, lr, None, True), None

    def _apply(self, synced: StepSynced) -> tuple[StepApplied, float | None]:
        self._context.streams.before_apply(self.index)
        recipe = self._context.recipe
        lr = self._learning_rate()
        grad_norm: float | None = None
        skipped = False
        with self._enter("optimizer"):
            # A parameter no device used must look untouched to the optimizer
            # (grad None), exactly as in one-process training.
            for position in synced.unused:
                self.params[position].grad = None
            self.optimizer_dirty = True
            try:
                scaler = self.scaler
                max_norm = recipe.clip_grad_norm
                clipping = max_norm is not None
                if max_norm is not None:
                    if scaler is not None:
                        scaler.unscale_(self.optimizer)
                    # The reduced gradient is the same on every replica, so every
                    # replica computes the same norm: no collective needed.
                    norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
                    # Read once the optimizer step is launched: float(norm) here would wait for the
                    # reduction before the step is even queued.
                    self._grad_norm.put(norm)
                if scaler is not None:
                    skipped = self._scaled_step(scaler)
                else:
                    self.optimizer.step()
                if clipping:
                    grad_norm = self._grad_norm.get()
                # Inside the dirty window: a checkpoint holds the scheduler's
                # state as of the same step as the parameters'.
                self._step_scheduler()
            finally:
                for position in synced.unused:
                    self.params[position].grad = None if self._context.grads_in_place else self.grads.view(position)
            # Only a step that returned leaves the replica consistent; the step
            # is recorded before the flag clears, so a reader never sees it late.
            self.applied_step = synced.step
            self.optimizer_dirty = False
        applied = StepApplied(self.index, synced.step, synced.loss, lr, grad_norm, skipped)
        every = self._context.check_replicas_every
        if every is not None and (synced.step + 1) % every == 0:
            with torch.no_grad():
                return applied, float(sum(p.detach().double().sum() for p in self.params))  # type: ignore[arg-type]
        return applied, None

    def _scaled_step(self, scaler: torch.amp.GradScaler) -> bool:
        """The optimizer step through the GradScaler; returns whether it was skipped (an inf or NaN gradient).

        The reduced (scaled) gradients are identical everywhere, so every
        replica finds the same infs and skips alike. The scaler calls the
        optimizer's step only when the gradients are finite, which the
        optimizer's step hook sees: that answers without
        ``GradScaler.get_scale()``, a host sync per call, the one after
        ``update()`` behind the whole optimizer step. (The scaler's own check
        of its inf flags before the step is a sync too; it is torch's, as in
        a plain loop.) An optimizer that handles the scaler itself (a fused
        one: its step runs either way and skips inside) and one without step
        hooks are asked the old way, by the scale going down.
        """
        if getattr(self.optimizer, "_step_supports_amp_scaling", False) or not hasattr(
            self.optimizer, "register_step_post_hook"
        ):
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            return scaler.get_scale() < scale
        self._optimizer_stepped = False
        scaler.step(self.optimizer)
        scaler.update()
        return scaler.is_enabled() and not self._optimizer_stepped

    def _evaluate(self, data: Any, rows: int, metric_fn: MetricFn) -> dict[str, float]:
        """``metric_fn`` on this device's shard, in eval mode without gradients; each value times ``rows``."""
        with self._enter("evaluate"):
            modes = [(module, module.training) for module in self.replica.modules()]
            self.replica.eval()
            try:
                with torch.no_grad(), self._autocast():
                    value = metric_fn(self.replica, move_batch(data, self.spec.torch_device))
            finally:
                for module, training in modes:
                    module.training = training
        return {name: _scalar(metric) * rows for name, metric in _metrics(value, metric_fn, self.spec.name).items()}

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

    def _job(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.queued:
            self.queued = self.waiting = False
        try:
            return self._on_compute_stream(fn, *args)
        finally:
            if self._shares_thread:
                # Its end reaches the loop only with the jobs queued behind it (a shared thread holds reports):
                # until then the heartbeat must count it as waiting, not as a device still working.
                self.waiting = True

    async def _in_thread(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` in the worker thread and return its result.

        With ``timeout``: raise :class:`~gsync._core.threads.JobTimedOut` once the
        job has run that long; its wait behind other devices' jobs on a shared
        thread does not count (see :meth:`WorkerThread.run`).
        """
        if self._shares_thread:
            self.queued = self.waiting = True
        try:
            return await self.worker.run(lambda: self._job(fn, *args), timeout)
        except FitAborted:
            if self.queued:  # the job never started: the thread had stopped
                self.queued = self.waiting = False
            raise

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
        self.step = after_step
        timeout = self._context.sync_timeout
        try:
            result: dict[str, float] = await self._in_thread(self._evaluate, data, rows, metric_fn, timeout=timeout)
        except JobTimedOut:
            # The job runs on (it cannot be interrupted); the abort flag stops it at its next phase boundary.
            self._context.abort.set()
            raise SyncTimeout(
                self.step, timeout, stalled_devices=[self.spec.name], site="evaluate",
                last_seen={self.spec.name: self.where()},
            ) from None
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
                    await self._in_thread(self._forward_backward, shard)
                if not await self._await_sync(shard.step, turns):
                    return
            message = await self.mailbox.receive()
            if not isinstance(message, Close):
                raise SyncFailed(self.step, None, f"protocol error: {message!r} after the last step")
        finally:
            self.shards.close()
            self.mailbox.close()

    async def _first_forward_backward(self, shard: Shard, turns: FirstStepInTurn) -> None:
        """The session's first forward and backward, after the device before this one's."""
        phase = "forward_backward"
        try:
            if self.index > 0:
                # Seen by the heartbeat and a timeout as waiting on a peer device, not as stuck.
                self.step, self.site, self.waiting = shard.step, "waiting for its first-step turn", True
                await turns.wait_turn(phase, self.index)
                self.waiting = False
            await self._in_thread(self._forward_backward, shard)
        finally:
            turns.done(phase, self.index)

    async def _await_sync(self, step: int, turns: FirstStepInTurn | None = None) -> bool:
        """Wait for ``step``'s sync and apply it; ``turns``: the first step's, whose optimizer steps go in turn."""
        self.waiting = True
        # Left set when the wait ends in cancellation: a device whose run is
        # ending while it waited for the sync was waiting, not stuck.
        message = await self.mailbox.receive()
        if turns is not None:
            await turns.wait_turn("optimizer", self.index)
        self.waiting = False
        try:
            return await self._apply_synced(step, message)
        finally:
            if turns is not None:
                turns.done("optimizer", self.index)

    async def _apply_synced(self, step: int, message: DeviceMessage) -> bool:
        match message:
            case StepSynced(step=synced_step, skip=skip) if synced_step == step:
                timeout = self._context.sync_timeout
                try:
                    # A skipped step still steps the LR scheduler: user code, under the same deadline.
                    job = self._skip if skip else self._apply
                    applied, fingerprint = await self._in_thread(job, message, timeout=timeout)
                except JobTimedOut:
                    self._context.abort.set()
                    raise SyncTimeout(
                        step, timeout, stalled_devices=[self.spec.name], site="optimizer step",
                        last_seen={self.spec.name: self.where()},
                    ) from None
                if fingerprint is not None and self._context.fingerprints is not None:
                    self._context.fingerprints.record(step, self.index, fingerprint)
                self._context.session.post(applied)
                return True
            case StepSynced():
                raise SyncFailed(step, None, f"protocol error: {self.spec.name} got {message!r} while at step {step}")
            case Close():
                return False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.worker.stop()


def _scalar(metric: Any) -> float:
    # .item() reads a one-element tensor or array whatever its shape (float() takes 0-d arrays only).
    item = getattr(metric, "item", None)
    return float(item() if callable(item) else metric)


def _metrics(value: Any, metric_fn: MetricFn, device: str) -> dict[str, Any]:
    """A metric function's result as a dict of scalars: a dict as is, a scalar under the function's name."""
    if isinstance(value, dict):
        metrics = value
    else:
        name = getattr(metric_fn, "__name__", "metric")
        metrics = {"metric" if name == "<lambda>" else name: value}
    for name, metric in metrics.items():
        if not isinstance(name, str):
            # Across processes the names are exchanged as strings; one process must not accept what many refuse.
            raise InputTypeError(
                f"the metric function returned the key {name!r} ({type(name).__name__}) on {device}; "
                "metric names must be str"
            )
        if isinstance(metric, torch.Tensor) and metric.numel() == 1:
            continue
        if isinstance(metric, numbers.Real):  # int, float, bool (a fraction of rows), NumPy's scalars
            continue
        # A one-element NumPy array (np.mean(..., keepdims=True)) is as much a scalar as a one-element tensor.
        if getattr(metric, "size", None) == 1 and callable(getattr(metric, "item", None)):
            if isinstance(metric.item(), numbers.Real):
                continue
        raise InputTypeError(
            f"the metric function returned {type(metric).__name__} for {name!r} on {device}; "
            "it must return a scalar (a number, a NumPy scalar or a one-element tensor) or a dict of scalars"
        )
    return metrics
