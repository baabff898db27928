"""A replica's update from the reduced gradient: clipping, the GradScaler, the optimizer and the LR scheduler.

Runs in the device's worker thread once the sync server posted
``StepSynced``. ``applied_step`` and ``optimizer_dirty`` tell the session,
once the thread is idle, which replica holds a consistent state to take a
checkpoint from.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .capture import GradientCapture
from .context import ActorContext
from .messages import StepApplied, StepSynced
from .readout import ScalarReadout
from .features import DeviceShard

__all__ = ("ReplicaUpdate",)


class ReplicaUpdate:
    """Device ``index``'s optimizer step over the gradients ``capture`` holds; ``enter`` starts a site."""

    def __init__(
        self,
        *,
        index: int,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler | None,
        capture: GradientCapture,
        context: ActorContext,
        device: torch.device,
        enter: Callable[[str], AbstractContextManager[None]],
    ) -> None:
        self.index = index
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self._capture = capture
        self._context = context
        self._enter = enter
        self._grad_norm = ScalarReadout(device, context.abort)
        # Written only by the worker thread; read by the session once the thread
        # is idle, to pick the replica a checkpoint is taken from.
        self.applied_step = -1
        self.optimizer_dirty = False
        # Whether the optimizer's step ran in this optimizer job: with a GradScaler, that is whether the step
        # was skipped, known without GradScaler.get_scale(), a host sync (see _scaled_step).
        self._optimizer_stepped = False
        self.shard: DeviceShard | None = None
        """``shard_optimizer=True``: this device's slices, which its optimizer steps (set as the session is assembled)."""
        self._step_hook = (
            optimizer.register_step_post_hook(self._on_optimizer_step)
            if scaler is not None and hasattr(optimizer, "register_step_post_hook")
            else None
        )

    def holds(self, step: int) -> None:
        """The replica starts out holding the state after ``step`` (kept from an elastic run's last generation)."""
        self.applied_step = step

    def close(self) -> None:
        """Let go of the optimizer: a replica kept for the next generation is stepped by that one's update."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def skip(self, synced: StepSynced) -> tuple[StepApplied, None]:
        # The step is left out, but the next step writes the buckets, which
        # must still wait for this step's reductions.
        self._context.streams.before_apply(self.index)
        lrs = self._learning_rates()
        with self._enter("optimizer"):
            # The schedule follows the step count, as in a plain loop that skips a step; a checkpoint holds the
            # scheduler's state as of the parameters' step, as in apply.
            self.optimizer_dirty = True
            self._step_scheduler()
            # Left out everywhere, so the replica is as consistent after it as before.
            self.applied_step = synced.step
            self.optimizer_dirty = False
        return StepApplied(self.index, synced.step, lrs[0], None, True, lrs), None

    def apply(self, synced: StepSynced) -> tuple[StepApplied, float | None]:
        """The optimizer step; and the replica's fingerprint when this step's replicas are compared."""
        self._context.streams.before_apply(self.index)
        lrs = self._learning_rates()
        with self._enter("optimizer"):
            shard = self.shard
            if shard is not None:
                shard.attach(synced.unused)
            else:
                self._capture.hide_unused(synced.unused)
            self.optimizer_dirty = True
            try:
                grad_norm, skipped = self._step() if shard is None else self._sharded_step(shard)
                # Inside the dirty window: a checkpoint holds the scheduler's
                # state as of the same step as the parameters'.
                self._step_scheduler()
            finally:
                if shard is None:
                    self._capture.restore_unused(synced.unused)
            # Only a step that returned leaves the replica consistent; the step
            # is recorded before the flag clears, so a reader never sees it late.
            self.applied_step = synced.step
            self.optimizer_dirty = False
        applied = StepApplied(self.index, synced.step, lrs[0], grad_norm, skipped, lrs)
        every = self._context.check_replicas_every
        if every is not None and (synced.step + 1) % every == 0 and self.shard is None:
            # Sharded, the replicas agree only once the shards are gathered, where they are compared.
            with torch.no_grad():
                params = self._capture.params
                return applied, float(sum(p.detach().double().sum() for p in params))  # type: ignore[arg-type]
        return applied, None

    def _step(self) -> tuple[float | None, bool]:
        """Clip (when the recipe clips), then step; the gradient's norm, and whether the step was skipped."""
        scaler = self.scaler
        max_norm = self._context.recipe.clip_grad_norm
        if max_norm is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            # The reduced gradient is the same on every replica, so every
            # replica computes the same norm: no collective needed.
            norm = torch.nn.utils.clip_grad_norm_(self._capture.params, max_norm)
            # Read once the optimizer step is launched: float(norm) here would wait for the
            # reduction before the step is even queued.
            self._grad_norm.put(norm)
        skipped = False
        if scaler is not None:
            skipped = self._scaled_step(scaler)
        else:
            self.optimizer.step()
        return (self._grad_norm.get() if max_norm is not None else None), skipped

    def _sharded_step(self, shard: DeviceShard) -> tuple[float | None, bool]:
        """:meth:`_step` on this device's shard: clipped by the norm over every shard, and with a GradScaler
        whose inf flags are the whole gradient's, so every shard skips alike."""
        scaler = self.scaler
        max_norm = self._context.recipe.clip_grad_norm
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            shard.agree_found_inf(scaler)
        if max_norm is not None:
            inv_scale = None
            if scaler is not None and scaler.is_enabled():
                inv_scale = scaler._scale.double().reciprocal()  # type: ignore[union-attr]
            self._grad_norm.put(shard.clip(max_norm, inv_scale))
        skipped = self._scaled_step(scaler) if scaler is not None else False
        if scaler is None:
            self.optimizer.step()
        return (self._grad_norm.get() if max_norm is not None else None), skipped

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

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_stepped = True

    def _learning_rates(self) -> tuple[float, ...]:
        """Every parameter group's, in the optimizer's order (a factory may set one per group: no decay, a head)."""
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups)

    def _step_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
