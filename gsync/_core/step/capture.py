"""Gradient capture: how one device's backward passes fill its buckets and tell the sync server.

In the step's last backward, gradient hooks (in the thread where backward
runs) count readiness per bucket and post one ``BucketReady`` per bucket;
the last bucket, launched after all others anyway, has no hooks once the
plan is final and is taken in one pass when backward returns. The backward
passes before the last only add their weighted gradients into the buckets,
so accumulation moves no bytes. Buckets with gradients that never arrived
(unused parameters, or a device with an empty shard) are posted when the
last backward returns, their missing gradients zero. (In one process on CPU
a step of one batch leaves most gradients where autograd put them, and the
reduction takes them there: see
:func:`~gsync._core.gradients.buckets.reduced_in_place`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..threads import FitAborted
from ..gradients.buckets import BucketPlan, Readiness, ReplicaGrads, owns_its_memory, reduced_in_place
from .context import ActorContext
from .messages import BucketReady

__all__ = ("GradientCapture",)


class GradientCapture:
    """Device ``index``'s bucket plan, gradient buffers, readiness and hooks."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], device: torch.device, context: ActorContext) -> None:
        self.index = index
        self.params = params
        self._device = device
        self._context = context
        self._cuda = device.type == "cuda"
        self.step = -1
        # How the running backward treats gradients (see _hook_for); set per batch of a step.
        self._posting = True
        self._grad_scale = 1.0
        self._direct = False
        self._one_batch = True
        self._got_grad = bytearray(len(params))
        self._hooks: list[Any] = []
        self._unhooked: tuple[int, ...] = ()
        self._hooked_final_plan = False
        # The plan the sync server sent as final (StepSynced.plan): adopted at the start of the next step.
        self._final_plan: BucketPlan | None = None
        self._adopt(context.plan)

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

    def plan_is_final(self, plan: BucketPlan) -> None:
        """On the loop, between jobs: ``plan`` is the plan from the next step on, for good."""
        self._final_plan = plan

    # -- in the worker thread (and autograd's, for the hooks) ------------------

    def start_step(self, step: int, batches: int) -> None:
        """Before the step's first backward: adopt a final plan, and set how this step's gradients are held."""
        self.step = step
        final = self._final_plan
        if final is not None and final is not self.plan:
            self._adopt(final)
        elif final is not None and not self._hooked_final_plan:
            self._install_hooks()
        # With one batch, the gradient autograd delivers is the step's: where the
        # reduction can take it as it is, it stays in .grad (no copy into the bucket).
        self._one_batch = batches == 1
        self._direct = self._context.grads_in_place and self._one_batch
        self._got_grad[:] = bytes(len(self._got_grad))

    def start_batch(self, last: bool, grad_scale: float) -> None:
        """Before a batch's forward: only the last batch's backward posts buckets; ``grad_scale`` weights its
        gradients."""
        self.readiness.reset()
        self._posting = last
        self._grad_scale = grad_scale

    def before_backward(self) -> None:
        # After the forward, not before it: a loss function may look at the last step's gradients.
        self.grads.release()

    def after_backward(self) -> None:
        if self._unhooked:
            self._take_unhooked()

    def finish(self, batches: int) -> None:
        """After the step's backward passes."""
        if batches > 1:
            # Parameters that got gradients in earlier batches but not in the
            # last backward were left with grad None by its release().
            self.grads.attach()

    def post_unfinished(self, last_backward_ran: bool) -> None:
        """Post the buckets the last backward did not complete; slots of parameters that got no gradient are zeroed."""
        if not last_backward_ran:
            # The last shard was empty: no bucket was posted this step, so every bucket is.
            self.readiness.reset()
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

    def hide_unused(self, unused: tuple[int, ...]) -> None:
        """Before the optimizer step: a parameter no device used looks untouched (grad None), as on one device."""
        for position in unused:
            self.params[position].grad = None

    def restore_unused(self, unused: tuple[int, ...]) -> None:
        """After the optimizer step: the parameters :meth:`hide_unused` hid get their bucket slots back."""
        for position in unused:
            self.params[position].grad = None if self._context.grads_in_place else self.grads.view(position)

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
                self._post_ready(bucket, in_hook=True)

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
            grad.record_stream(torch.cuda.current_stream(self._device))

    def _copied_on_compute_stream(self, grads: list[torch.Tensor]) -> None:
        """CUDA, after a backward: ``grads``, just copied into their buckets on the compute stream, are dropped.

        A gradient made on a side stream belongs to that stream's pool: without
        ``record_stream`` the allocator could hand its memory to new side-stream
        work before the compute stream's copy has read it. (For a gradient made
        on the compute stream itself this is a no-op.)
        """
        stream = torch.cuda.current_stream(self._device)
        for grad in grads:
            if not grad.is_sparse:
                grad.record_stream(stream)

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

    def _post_ready(self, bucket: int, unused: tuple[int, ...] = (), in_hook: bool = False) -> None:
        """Tell the sync server ``bucket`` is final on this device, after ordering it behind its writes."""
        self._context.streams.mark_ready(self.index, bucket)
        self._context.server.bucket_ready(BucketReady(self.index, self.step, bucket, unused), in_hook)

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
        self.remove_hooks()
        final = self._final_plan is not None
        # In bucket order, as the bucket's slots are.
        self._unhooked = tuple(self.plan.buckets[-1].params) if final and self.plan.buckets else ()
        last = frozenset(self._unhooked)
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook_for(position))
            for position, param in enumerate(self.params)
            if position not in last
        ]
        self._hooked_final_plan = final

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

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

    def _adopt(self, plan: BucketPlan) -> None:
        """Take a bucket plan: when built, and after a rebuild, between steps (each step writes every bucket slot
        afresh)."""
        self.plan = plan
        self.grads = ReplicaGrads(plan, self.params, self._device, lazy=self._context.grads_in_place)
        self._in_place = self._buckets_in_place()
        self.readiness = Readiness(plan)
        self._install_hooks()
