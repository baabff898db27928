"""SyncBatchNorm over gsync's devices and processes: each layer's batch statistics over the whole global batch.

torch's own ``nn.SyncBatchNorm.forward`` synchronizes over a process group
only: without one it quietly normalizes each shard by itself (plain
BatchNorm), and with one it needs CUDA tensors and the default group, which
gsync's gradient reductions use. So gsync gives the ``SyncBatchNorm`` layers
of its replicas a forward of its own (:func:`adopt_sync_batchnorm`), whose
statistics go through one :class:`BatchStatsExchange` per session:

- the devices of this process meet in a rendezvous per call (a layer's
  forward, or its backward), in call order: every replica runs the same
  code, so device ``i``'s ``k``-th call matches every other device's ``k``-th;
- the last device to arrive sums the contributions in device order (so the
  sum does not depend on which device came last) and, across processes,
  all-reduces that sum over a gloo group of the exchange's own. The
  gradient reductions run on the session's group in the communication
  thread while backward still runs; a second group keeps the two streams of
  collectives from interleaving differently on different ranks.

Forward exchanges each shard's row count, sum and sum of squares (float64,
from the shard's own mean and variance), so shards of any size weigh by
their rows. Backward exchanges the two sums the input gradient needs,
each scaled by the shard's share of the global batch (the weight its
gradient gets in the reduction), so the input gradient is the one the whole
batch's loss gives, divided by that share: the reduction multiplies it back.

A shard with no rows does not run forward, and contributes nothing: the
rendezvous waits only for the devices with rows. A *process* with no rows in
a batch (a global batch smaller than the devices, or a rank whose data
ended, ``uneven="join"``) still has to match the other ranks' collectives
without running the model: such batches follow a padded protocol, decided
alike on every rank from the batch's row counts. Every collective then has
one size (room for the widest layer, and an *active* count), and the ranks
with rows end the batch with one collective whose active count is zero; a
rank without rows all-reduces zeros until it sees that one.

The session's first step on several CPU devices runs their work one device
at a time, as :class:`~gsync._core.step.context.FirstStepInTurn` does for
models without these layers (torch sets CPU kernels up on their first use,
and two threads doing so at once now and then round differently): here the
devices cannot take whole turns, since each layer waits for the others, so
they take turns between meetings. The runnable device with the lowest index
runs; a device waiting in a rendezvous is not runnable until it completes.

A waiting device leaves with :class:`~gsync._core.threads.FitAborted` once
the session's abort flag is set (a peer device failed), and with
:class:`~gsync.SyncTimeout` after ``sync_timeout``; a collective that fails
(a peer process is gone) raises :class:`~gsync.SyncFailed`, which the
session turns into the peer's own failure.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .threads import FitAborted
from ..errors import SyncFailed, SyncTimeout

if TYPE_CHECKING:
    from .distributed.membership import GroupMembership

__all__ = (
    "BatchStatsExchange",
    "adopt_sync_batchnorm",
    "has_sync_batchnorm",
    "sync_batchnorm_width",
)

# How often a waiting device looks at the abort flag.
_WAIT_SLICE_S = 0.05


def has_sync_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(module, nn.SyncBatchNorm) for module in model.modules())


def sync_batchnorm_width(model: nn.Module) -> int:
    """The widest ``SyncBatchNorm`` layer's channels: the padded protocol's collectives make room for it."""
    return max((m.num_features for m in model.modules() if isinstance(m, nn.SyncBatchNorm)), default=0)


@dataclass
class _Batch:
    """What one device knows of the batch it runs now."""

    step: int
    position: int
    participants: int
    """This process's devices with rows in the batch (the rendezvous waits for as many)."""
    padded: bool
    """Some process of the run has no rows in the batch: the padded protocol."""
    share: float
    """This device's rows over the batch's global rows (its gradient's weight in the reduction)."""
    calls: int = 0


@dataclass
class _Slot:
    expected: int
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    taken: int = 0


class _Across:
    """The cross-process half: a gloo group of the exchange's own, over the session's ranks."""

    def __init__(self, membership: GroupMembership, width: int, timeout_s: float, abort: threading.Event) -> None:
        self._membership = membership
        self._width = width
        self._timeout_s = timeout_s
        self._abort = abort
        self._group: Any = None
        self._lock = threading.Lock()

    def _built(self) -> Any:
        # Built at the first use, by whichever thread of this process gets there first; every rank builds it at
        # its first statistics collective, which every rank reaches in the same step.
        with self._lock:
            if self._group is None:
                membership = self._membership
                store = torch.distributed.PrefixStore(f"{membership.namespace}/batch-stats", membership.store)
                self._group = torch.distributed.ProcessGroupGloo(
                    store, membership.rank, membership.world_size, timedelta(seconds=self._timeout_s)
                )
            return self._group

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        from .distributed.runtime import host_all_reduce

        return host_all_reduce(self._built(), values, "sum", self._abort)

    def reduce(self, values: torch.Tensor, padded: bool) -> torch.Tensor:
        if not padded:
            return self._sum(values)
        frame = torch.zeros(2 + 2 * self._width, dtype=torch.float64)
        frame[0] = 1.0
        frame[1 : 1 + values.numel()] = values
        return self._sum(frame)[1 : 1 + values.numel()].clone()

    def end_batch(self) -> None:
        """A padded batch's last collective, from a rank with rows: its active count is zero."""
        self._sum(torch.zeros(2 + 2 * self._width, dtype=torch.float64))

    def shadow_batch(self) -> None:
        """A rank without rows in a padded batch: match the others' collectives until they end the batch."""
        while True:
            frame = self._sum(torch.zeros(2 + 2 * self._width, dtype=torch.float64))
            if frame[0] == 0:
                return

    def close(self) -> None:
        with self._lock:
            self._group = None


class BatchStatsExchange:
    """Sums the ``SyncBatchNorm`` statistics of one session's devices (see the module docstring).

    ``membership``: the session's process group, when it has other ranks; ``width``: the widest layer's channels.
    """

    def __init__(
        self,
        device_names: Sequence[str],
        abort: threading.Event,
        sync_timeout: float,
        width: int,
        membership: GroupMembership | None = None,
        group_timeout_s: float | None = None,
        first_step_in_turn: bool = False,
    ) -> None:
        self._names = list(device_names)
        self._runnable: set[int] | None = set(range(len(device_names))) if first_step_in_turn else None
        """During the first step in turns: the devices that may run (see the module docstring); ``None`` after."""
        self._abort = abort
        self._timeout = sync_timeout
        self._batches: list[_Batch | None] = [None] * len(self._names)
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._changed = threading.Condition()
        self._across = (
            _Across(membership, width, group_timeout_s or sync_timeout, abort)
            if membership is not None and membership.world_size > 1
            else None
        )

    # -- in the device threads -------------------------------------------------

    def job_started(self, device: int, step: int) -> None:
        """Device ``device``'s forward and backward job of ``step`` begins: in the first step, once it is its turn."""
        if self._runnable is not None:
            self._await_turn(device, step)

    def job_ended(self, device: int) -> None:
        """Device ``device``'s forward and backward job ended (however it ended): the next device runs."""
        if self._runnable is None:
            return
        with self._changed:
            if self._runnable is not None:
                self._runnable.discard(device)
                if not self._runnable:
                    self._runnable = None  # every device's first step is done: from now on they run at once
                self._changed.notify_all()

    def _await_turn(self, device: int, step: int) -> None:
        deadline = time.monotonic() + self._timeout * len(self._names)
        with self._changed:
            while self._runnable is not None and min(self._runnable, default=device) != device:
                if self._abort.is_set():
                    raise FitAborted
                left = deadline - time.monotonic()
                if left <= 0:
                    self._abort.set()
                    raise SyncTimeout(step, self._timeout, stalled_devices=[self._names[min(self._runnable)]], site="first-step turn")
                self._changed.wait(min(_WAIT_SLICE_S, left))

    def begin_batch(self, device: int, step: int, position: int, local_rows: Sequence[int], padded: bool, share: float) -> None:
        """Device ``device`` starts forward of batch ``position`` of ``step`` (it has rows in it)."""
        participants = sum(1 for rows in local_rows if rows > 0) if local_rows else len(self._names)
        self._batches[device] = _Batch(step, position, participants, padded and self._across is not None, share)

    def end_batch(self, device: int) -> None:
        """Device ``device``'s backward of the batch returned: a padded batch ends for this process once every
        device with rows is here."""
        batch = self._batches[device]
        if batch is not None and batch.padded:
            self._rendezvous(device, batch, None, end=True)
        self._batches[device] = None

    def skip_batch(self, step: int, position: int, local_rows: Sequence[int], padded: bool) -> None:
        """No device of this process has rows in the batch: in a padded batch, device 0 calls this to match the
        other ranks' collectives."""
        if self._across is not None and padded and not any(rows > 0 for rows in local_rows):
            try:
                self._across.shadow_batch()
            except (FitAborted, SyncFailed):
                raise
            except RuntimeError as error:
                raise SyncFailed(step, None, "the batch statistics of SyncBatchNorm could not be exchanged") from error

    def active(self, device: int) -> bool:
        """Whether ``device`` is in a batch's forward or backward, whose statistics it shares."""
        return self._batches[device] is not None

    def share(self, device: int) -> float:
        batch = self._batches[device]
        return 1.0 if batch is None else batch.share

    def reduce(self, device: int, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a float64 vector) summed over every device with rows in the batch, of every process."""
        batch = self._batches[device]
        if batch is None:
            return values
        result = self._rendezvous(device, batch, values.detach().to("cpu", torch.float64), end=False)
        return result.to(values.device) if result is not None else values

    def _rendezvous(self, device: int, batch: _Batch, values: torch.Tensor | None, *, end: bool) -> torch.Tensor | None:
        key = (batch.step, batch.position, batch.calls)
        batch.calls += 1
        with self._changed:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(batch.participants)
            slot.parts[device] = values if values is not None else torch.empty(0)
            last = len(slot.parts) == slot.expected
            if self._runnable is not None and not last:
                self._runnable.discard(device)  # waiting here: the next device takes its turn
                self._changed.notify_all()
        if last:
            try:
                total = None if end else _sum_in_order(slot.parts)
                if self._across is not None:
                    if end:
                        self._across.end_batch()
                    elif total is not None:
                        total = self._across.reduce(total, batch.padded)
            except BaseException as error:
                with self._changed:
                    slot.error = error
                    self._changed.notify_all()
                if isinstance(error, RuntimeError):
                    raise SyncFailed(batch.step, None, "the batch statistics of SyncBatchNorm could not be exchanged") from error
                raise
            with self._changed:
                slot.result = total if total is not None else torch.empty(0)
                if self._runnable is not None:
                    self._runnable.update(slot.parts)
                self._changed.notify_all()
        else:
            self._wait(slot, batch)
        with self._changed:
            slot.taken += 1
            if slot.taken == slot.expected:
                del self._slots[key]
        if self._runnable is not None:
            self._await_turn(device, batch.step)
        return slot.result

    def _wait(self, slot: _Slot, batch: _Batch) -> None:
        deadline = time.monotonic() + self._timeout
        with self._changed:
            while slot.result is None:
                if slot.error is not None or self._abort.is_set():
                    # The device that summed failed (its own error is the session's), or the session is ending.
                    raise FitAborted
                left = deadline - time.monotonic()
                if left <= 0:
                    self._abort.set()
                    missing = [self._names[i] for i in range(len(self._names)) if i not in slot.parts]
                    raise SyncTimeout(
                        batch.step, self._timeout, stalled_devices=missing, site="SyncBatchNorm statistics",
                    )
                self._changed.wait(min(_WAIT_SLICE_S, left))

    def close(self) -> None:
        if self._across is not None:
            self._across.close()


def _sum_in_order(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    # In device order, whichever device arrived last: the sum is the same bits every time.
    ordered = [parts[index] for index in sorted(parts)]
    total = ordered[0].clone()
    for part in ordered[1:]:
        total.add_(part)
    return total


# -- the layers' forward and backward ----------------------------------------------


def adopt_sync_batchnorm(replica: nn.Module, device: int, exchange: BatchStatsExchange) -> None:
    """Give every ``nn.SyncBatchNorm`` of ``replica`` (device ``device``'s) gsync's forward, on ``exchange``."""
    for module in replica.modules():
        if isinstance(module, nn.SyncBatchNorm):
            # An instance attribute: the class, and so the user's own model and any other copy, keep torch's.
            module.forward = types.MethodType(_forward_on(exchange, device), module)  # type: ignore[method-assign]


def _forward_on(exchange: BatchStatsExchange, device: int) -> Any:
    def forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        if not (self.training and exchange.active(device)):
            # Evaluation (running statistics), or a forward outside a step's batch: this shard's own, as torch's.
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, exchange, device)

    return forward


def _per_channel(values: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return values.view(1, -1, *([1] * (input.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
        exchange: BatchStatsExchange,
        device: int,
    ) -> torch.Tensor:
        channels = input.shape[1]
        count = input.numel() // channels
        exact = input if input.dtype in (torch.float32, torch.float64) else input.float()
        # The shard's mean and (biased) variance in one fused pass; torch.var_mean takes several times as long.
        mean, var = torch.batch_norm_update_stats(exact, None, None, 0.0)
        # (rows, sum, sum of squares), the last from the shard's own variance: summed in float64, the global
        # variance loses nothing to cancellation a float32 sum of squares would.
        mean64, var64 = mean.double(), var.double()
        local = torch.cat([mean64.new_full((1,), float(count)), mean64 * count, (var64 + mean64 * mean64) * count])
        total = exchange.reduce(device, local)
        rows = float(total[0])
        global_mean = total[1 : 1 + channels] / rows
        global_var = (total[1 + channels :] / rows - global_mean * global_mean).clamp_(min=0.0)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = global_var * (rows / (rows - 1)) if rows > 1 else global_var
                running_mean.mul_(1.0 - factor).add_(global_mean.to(running_mean), alpha=factor)
                running_var.mul_(1.0 - factor).add_(unbiased.to(running_var), alpha=factor)
        mean_t = global_mean.to(device=input.device, dtype=exact.dtype)
        var_t = global_var.to(device=input.device, dtype=exact.dtype)
        # Normalizing by given statistics is batch norm in eval mode: one fused kernel.
        output = F.batch_norm(
            exact, mean_t, var_t, None if weight is None else weight.to(exact.dtype),
            None if bias is None else bias.to(exact.dtype), False, 0.0, eps,
        )
        ctx.save_for_backward(exact, weight, mean_t, var_t)
        ctx.exchange, ctx.device, ctx.rows, ctx.input_dtype, ctx.eps = exchange, device, rows, input.dtype, eps
        ctx.share = exchange.share(device)
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        exact, weight, mean, var = ctx.saved_tensors
        grad = grad_output.to(exact.dtype).contiguous()
        invstd = torch.rsqrt(var + ctx.eps)
        # Eval-mode batch norm's backward, fused: the shard's sum of dy and of dy * (x - mean) * invstd, which are
        # the bias's and the weight's gradients (whatever the weight, so ones stand in for a missing one).
        scale_in = torch.ones_like(mean) if weight is None else weight.to(exact.dtype)
        _, dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad, exact, scale_in, mean, var, None, None, False, ctx.eps, [False, True, True]
        )
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            share = ctx.share
            # Each shard's sums weighted by its share of the batch, as its gradient will be in the reduction.
            local = torch.cat([sum_dy, dy_xhat / invstd]).double() * share
            total = ctx.exchange.reduce(ctx.device, local)
            channels = sum_dy.numel()
            scale = ctx.rows * share
            mean_dy = (total[:channels] / scale).to(device=exact.device, dtype=exact.dtype)
            mean_dy_xmu = (total[channels:] / scale).to(device=exact.device, dtype=exact.dtype)
            # dx = w * invstd * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean))), per channel.
            gain = invstd * scale_in
            slope = -gain * invstd * invstd * mean_dy_xmu
            # In place on one temporary, centred first: x * slope - mean * slope would cancel where |mean| >> std.
            grad_input = exact - _per_channel(mean, exact)
            grad_input.mul_(_per_channel(slope, exact)).sub_(_per_channel(gain * mean_dy, exact))
            grad_input.addcmul_(grad, _per_channel(gain, exact))
            grad_input = grad_input.to(ctx.input_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None

