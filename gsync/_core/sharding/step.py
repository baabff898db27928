"""``shard_optimizer=True``: each device steps the optimizer on its own shard of every bucket only.

The shards are :func:`~gsync.comm._shards.shard_bounds`'s: device ``g`` of ``N`` (across
processes) owns a contiguous range of each bucket, so a parameter may be cut between devices. A step:

1. every bucket is reduce-scattered instead of all-reduced (the sync server), so each device holds the
   reduced gradient of its own shard;
2. when the recipe clips or scales the loss, the server's last job of the step sums each device's squared
   shard norm over every device (one all-reduce of a number per device): the global norm clips, and a
   non-finite sum is the one answer every device's GradScaler gives (a skipped step is skipped on every
   shard);
3. each device's optimizer steps its shard (:class:`ReplicaShard`);
4. once every local device has stepped, the updated shards are all-gathered back into every replica, one
   bucket at a time (:class:`ShardedStep`), and only then does each device report the step applied and
   start the next one.

**Why per-parameter slices.** The optimizer is the user's factory's, built over the replica's whole
parameters (so groups chosen by shape, name or a flag come out as unsharded), whose parameter groups
then have each parameter replaced by this device's slice of it, before any state exists: a 1-D
``nn.Parameter`` sharing the parameter's memory (a slice of nothing where the device owns none of it).
Every elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...: all of ``torch.optim`` except
LBFGS, whose closure reevaluates the model, and Adafactor, which factors a matrix's state by rows and
columns) then steps each element exactly as unsharded, with its state for the shard only, groups and
learning rates kept, and the scheduler working as it does. One flat tensor per shard would lose the
groups; whole parameters per device would keep even Adafactor exact but not split a bucket evenly.

**Checkpoints** hold the whole state, as unsharded ones: an optimizer's ``state_dict()`` gathers every
local device's slices into whole tensors (``register_state_dict_post_hook``), and a whole state is cut
into this device's slices as it is loaded, so a sharded run resumes unsharded, on another device count,
or sharded again. Across processes the other ranks' slices come from a collective every rank enters at
the same point between steps (:mod:`gsync._core.sharding.checkpoint`), held here
(:meth:`ShardedStep.holding`) while the checkpoint is captured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import torch
from torch import nn

from ...comm.base import Collective
from ...errors import CheckpointError, ConfigError, GsyncError, SyncFailed
from ..gradients.buckets import BucketPlan, ReplicaGrads
from ..streams import StreamSync
from ..streams.cuda import CudaStreamSync, on_device
from ..threads import FitAborted, Outcome, WorkerThread
from ...trace import Trace
from ...comm._shards import shard_bounds
from ..step.mailbox import Mailbox
from ..step.messages import SessionMessage, StepApplied

__all__ = ("ReplicaShard", "ShardedStep")


class ReplicaShard:
    """Device ``index``'s slice of every parameter it trains (``params``, in the plan's order), and its optimizer.

    ``global_index`` is the device's index among ``world_devices``.
    """

    def __init__(
        self,
        index: int,
        global_index: int,
        world_devices: int,
        plan: BucketPlan,
        params: Sequence[nn.Parameter],
        grads: Callable[[], ReplicaGrads],
    ) -> None:
        self.index = index
        self.params = list(params)
        self._plan = plan
        self._grads = grads
        # Per parameter position: (start, stop) of its flattened elements this device owns.
        self.ranges: list[tuple[int, int]] = []
        self.slices: list[nn.Parameter] = []
        for position, param in enumerate(self.params):
            bucket = plan.buckets[plan.bucket_of[position]]
            offset = bucket.offsets[bucket.params.index(position)]
            first, last = shard_bounds(bucket.numel, world_devices)[global_index]
            start = min(max(first - offset, 0), param.numel())
            stop = max(min(last - offset, param.numel()), start)
            self.ranges.append((start, stop))
            # Shares the parameter's memory: the optimizer's in-place update is the replica's.
            self.slices.append(nn.Parameter(param.detach().view(-1)[start:stop]))
        self.owned = [stop > start for start, stop in self.ranges]
        # This device's range of each bucket, where its reduced gradient lies after the reduce-scatter.
        self.bucket_ranges = [shard_bounds(bucket.numel, world_devices)[global_index] for bucket in plan.buckets]
        self._positions = {id(piece): position for position, piece in enumerate(self.slices)}
        self.optimizer: torch.optim.Optimizer | None = None
        self.squared_norm: torch.Tensor | None = None
        """The squared norm of the reduced gradient over every shard, float64 (the server's, each step that
        clips or scales)."""

    # -- the optimizer -------------------------------------------------------------

    def take_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        peers: Callable[[], Sequence[ReplicaShard]],
        across: Callable[[], dict[int, dict[str, Any]] | None] = lambda: None,
    ) -> None:
        """Make ``optimizer`` (built over the whole parameters, perhaps with a whole state loaded) step this
        device's slices only; its ``state_dict()`` then gathers ``peers()``' slices (or is ``across()``'s whole
        state, when a checkpoint across processes gathered one), and loading cuts a whole state."""
        kind = type(optimizer).__name__
        if kind in _NOT_ELEMENTWISE:
            raise ConfigError(
                f"shard_optimizer=True steps each device's slice of every parameter on its own, and {kind} "
                f"{_NOT_ELEMENTWISE[kind]}: it would not train as unsharded; drop shard_optimizer= for it, or use an "
                "elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...)"
            )
        slice_of = {id(param): piece for param, piece in zip(self.params, self.slices)}
        whole_of = {id(piece): param for param, piece in zip(self.params, self.slices)}
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for group in optimizer.param_groups:
            group["params"] = [slice_of[id(param)] for param in group["params"]]
            for piece in group["params"]:
                whole = whole_of[id(piece)]
                if whole in optimizer.state and piece.numel() > 0:
                    state[piece] = self._cut(optimizer.state[whole], whole, piece)
        optimizer.state = state
        self.optimizer = optimizer
        optimizer.register_state_dict_post_hook(lambda _, whole: _gathered(whole, peers(), across()))
        optimizer.register_load_state_dict_pre_hook(lambda _, whole: self._cut_state_dict(whole))

    def _cut(self, values: dict[str, Any], whole: torch.Tensor, piece: nn.Parameter) -> dict[str, Any]:
        start, stop = self.ranges[self._position(piece)]
        return {
            key: value.detach().reshape(-1)[start:stop].clone() if _per_element(value, whole.shape) else value
            for key, value in values.items()
        }

    def _position(self, piece: nn.Parameter) -> int:
        return self._positions[id(piece)]

    def _cut_state_dict(self, whole: dict[str, Any]) -> dict[str, Any]:
        """A whole (unsharded) state dict, as this device's optimizer loads it: per-element values cut to its
        slices, the state of parameters it owns none of left out."""
        optimizer = self.optimizer
        if optimizer is None:
            return whole
        pieces = [piece for group in optimizer.param_groups for piece in group["params"]]
        cut: dict[Any, Any] = {}
        for key, values in whole["state"].items():
            if not isinstance(key, int) or key >= len(pieces):
                cut[key] = values  # load_state_dict itself says what does not fit
                continue
            piece = pieces[key]
            position = self._position(piece)
            if not self.owned[position]:
                continue
            cut[key] = self._cut(values, self.params[position], piece)
        return {**whole, "state": cut}

    # -- a step --------------------------------------------------------------------

    def attach(self, unused: tuple[int, ...]) -> None:
        """Before the optimizer step: each slice's gradient is its range of the reduced bucket; none where no
        device used the parameter (as unsharded) or this device owns none of it."""
        grads = self._grads()
        skip = set(unused)
        for position, (piece, (start, stop)) in enumerate(zip(self.slices, self.ranges)):
            if position in skip or start == stop:
                piece.grad = None
            else:
                piece.grad = grads.view(position).reshape(-1)[start:stop]

    def grads(self) -> list[torch.Tensor]:
        return [piece.grad for piece in self.slices if piece.grad is not None]

    def shard_squared_norm(self) -> torch.Tensor:
        """The squared norm of this device's shard of the reduced gradient, in float64 (so a large finite
        gradient cannot overflow into a false inf, and any inf or NaN stays one)."""
        grads = self._grads()
        device = self.params[0].device
        # One element rather than none: NCCL's all-reduce takes no 0-dim tensor.
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for bucket, (start, stop) in enumerate(self.bucket_ranges):
            if stop > start:
                # The shard's range of the bucket: a gradient no device had is zeros there, as it is left
                # out of clip_grad_norm_ unsharded.
                part = grads.flat(bucket)[start:stop]
                total += torch.linalg.vector_norm(part, 2, dtype=torch.float64).square()
        return total

    def clip(self, max_norm: float, inv_scale: torch.Tensor | None) -> torch.Tensor:
        """Clip this shard by the norm over every shard, as ``clip_grad_norm_`` clips the whole gradient; returns
        that norm (of the unscaled gradient)."""
        if self.squared_norm is None:
            raise RuntimeError("the step's squared norm was not computed")  # the server's job, every clipped step
        norm = self.squared_norm.sqrt().reshape(())
        if inv_scale is not None:
            norm = norm * inv_scale.double()
        norm = norm.to(torch.float32)
        grads = self.grads()
        if grads:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return norm

    def agree_found_inf(self, scaler: torch.amp.GradScaler) -> None:
        """After ``scaler.unscale_``: the scaler's inf flags become the whole gradient's, so every shard's
        scaler skips (and lowers its scale) alike."""
        if self.squared_norm is None or self.optimizer is None:
            raise RuntimeError("the step's squared norm was not computed")
        found = (~torch.isfinite(self.squared_norm)).to(torch.float32).reshape(())
        state = scaler._per_optimizer_states[id(self.optimizer)]
        flags = state.get("found_inf_per_device", {})
        for flag in flags.values():
            flag.copy_(found)
        if not flags:
            # A shard without a gradient has no flag of its own; the step still depends on the others'.
            flags[found.device] = found.clone()

    def pack(self, bucket: int, scratch: torch.Tensor) -> list[int]:
        """Copy this device's updated slices of ``bucket`` into their places in ``scratch``; the positions."""
        plan = self._plan.buckets[bucket]
        targets, sources = [], []
        for position, offset in zip(plan.params, plan.offsets):
            start, stop = self.ranges[position]
            if stop > start:
                targets.append(scratch[offset + start : offset + stop])
                sources.append(self.slices[position].detach())
        if targets:
            torch._foreach_copy_(targets, sources)
        return list(plan.params)

    def unpack(self, bucket: int, scratch: torch.Tensor) -> None:
        """Every parameter of ``bucket`` from the gathered ``scratch``."""
        plan = self._plan.buckets[bucket]
        params = [self.params[position].detach().view(-1) for position in plan.params]
        sources = [scratch[offset : offset + param.numel()] for param, offset in zip(params, plan.offsets)]
        torch._foreach_copy_(params, sources)


_NOT_ELEMENTWISE = {
    "LBFGS": "reevaluates the whole model in its closure and keeps a history over all parameters",
    "Adafactor": "factors a matrix's second moment by rows and columns, which a slice does not have",
}


def _per_element(value: object, shape: torch.Size) -> bool:
    # An optimizer's per-element state has the parameter's shape (exp_avg, momentum_buffer); what does not
    # (a step count) is the same on every device.
    return isinstance(value, torch.Tensor) and value.shape == shape and value.dim() > 0


def _gathered(
    state: dict[str, Any], shards: Sequence[ReplicaShard], across: dict[int, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A device's sharded state dict as the whole one: each parameter's per-element values concatenated from
    the devices that own its slices, in shard order (the unsharded format, so any run can load it).

    ``across``: the whole state a checkpoint across processes gathered from every rank, which is the answer.

    :raises ~gsync.CheckpointError: when part of a parameter's state is on other processes' devices and
        ``across`` is ``None``.
    """
    if across is not None:
        return {**state, "state": across}
    if len(shards) == 0 or shards[0].optimizer is None:
        return state
    pieces = [piece for group in shards[0].optimizer.param_groups for piece in group["params"]]
    states = [shard.optimizer.state if shard.optimizer is not None else {} for shard in shards]
    lists = [[piece for group in shard.optimizer.param_groups for piece in group["params"]] for shard in shards if shard.optimizer is not None]
    whole_state: dict[int, dict[str, Any]] = {}
    for key in range(len(pieces)):
        whole = shards[0].params[shards[0]._position(pieces[key])]
        owners = [(shard, per[key]) for shard, per in zip(shards, lists) if per[key].numel() > 0]
        covered = sum(piece.numel() for _, piece in owners)
        if covered != whole.numel():
            raise CheckpointError(
                f"parameter {key}'s optimizer state is sharded across processes (this process holds {covered} of its "
                f"{whole.numel()} elements): only a checkpoint every rank takes at the same point between steps "
                "gathers it (session.checkpoint() on every rank, fit's checkpoint_dir= files and result), not one "
                "rank's optimizer.state_dict(), nor a failure's checkpoint (a peer may be gone): resume from the last "
                "checkpoint file"
            )
        found = [states[shards.index(shard)].get(piece) for shard, piece in owners]
        if not any(found):
            continue
        if not all(found):
            raise CheckpointError(f"parameter {key}'s optimizer state exists on some devices' shards only")
        merged: dict[str, Any] = {}
        for name, value in found[0].items():  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == owners[0][1].numel():
                # Joined on the CPU, where a checkpoint keeps it: no device ever holds the whole state at once.
                parts = [values[name].detach().reshape(-1).to("cpu") for values in found]  # type: ignore[index]
                merged[name] = torch.cat(parts).view(whole.shape)
            else:
                merged[name] = value
        whole_state[key] = merged
    return {**state, "state": whole_state}


class ShardedStep:
    """What a session's devices share when the optimizer is sharded: the all-gather after each step.

    Each device reports its applied step here instead of to the session (:meth:`applied`); once every local
    device has, the updated shards are all-gathered on the communication thread, in bucket order (every
    process issues the same collectives in the same order), and then every device's ``StepApplied`` goes
    to the session. A device awaits :meth:`gathered` before its next step.
    """

    def __init__(self, local_devices: int, world_devices: int, device_offset: int, plan: BucketPlan, sync_timeout: float) -> None:
        self.local_devices = local_devices
        self.world_devices = world_devices
        self.device_offset = device_offset
        self.plan = plan
        self.shards: list[ReplicaShard] = []
        self.clips_or_scales = False
        self._timeout = sync_timeout
        self._pending: dict[int, StepApplied] = {}
        self._done: dict[int, anyio.Event] = {}
        self._errors: dict[int, BaseException] = {}
        self._scratch: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(local_devices)]
        self._comm: WorkerThread | None = None
        self._collective: Collective | None = None
        self._exact: Collective | None = None
        self._streams: StreamSync | None = None
        self._session: Mailbox[SessionMessage] | None = None
        self._fingerprint: Callable[[int, int, float], None] | None = None
        self._check_every: int | None = None
        self._abort: Any = None
        self._trace: Trace | None = None
        self.across: dict[int, dict[str, Any]] | None = None
        """While a checkpoint across processes is captured: the whole optimizer state gathered from every rank,
        which each local optimizer's ``state_dict()`` then is (:meth:`holding`)."""

    def bind(
        self,
        *,
        comm: WorkerThread,
        collective: Collective,
        exact: Collective,
        streams: StreamSync,
        session: Mailbox[SessionMessage],
        abort: Any,
        fingerprint: Callable[[int, int, float], None] | None,
        check_every: int | None,
        trace: Trace | None = None,
    ) -> None:
        """The session's parts it gathers with (built after the actors' shared context)."""
        self._trace = trace
        self._comm = comm
        self._collective = collective
        self._exact = exact
        self._streams = streams
        self._session = session
        self._abort = abort
        self._fingerprint = fingerprint
        self._check_every = check_every

    @property
    def comm(self) -> WorkerThread:
        """The communication thread the session's collectives run in, in the order they were submitted."""
        if self._comm is None:
            raise RuntimeError("ShardedStep used before bind()")
        return self._comm

    @property
    def timeout(self) -> float:
        """``sync_timeout``: how long one collective may take."""
        return self._timeout

    @contextmanager
    def holding(self, whole: dict[int, dict[str, Any]]) -> Iterator[None]:
        """Within the block, every local optimizer's ``state_dict()`` is ``whole`` (the state every rank's slices
        make, gathered by a checkpoint across processes)."""
        self.across = whole
        try:
            yield
        finally:
            self.across = None

    # -- in the server's communication thread, before StepSynced ---------------------

    def agree_norm(self, step: int) -> None:
        """Every device's squared norm of the whole reduced gradient: each shard's, summed over every device."""
        if self._exact is None:
            raise RuntimeError("ShardedStep used before bind()")
        parts = [shard.shard_squared_norm() for shard in self.shards]
        self._exact.all_reduce(parts, [1.0] * len(parts))
        for shard, part in zip(self.shards, parts):
            shard.squared_norm = part

    # -- on the event loop -----------------------------------------------------------

    def applied(self, index: int, applied: StepApplied) -> None:
        """Device ``index`` applied ``applied.step``; the last local device's report starts the all-gather."""
        step = applied.step
        self._done.setdefault(step, anyio.Event())
        self._pending[index] = applied
        if len(self._pending) < self.local_devices:
            return
        reports = [self._pending.pop(i) for i in range(self.local_devices)]
        if all(report.skipped for report in reports):
            # Skipped on every device of every process alike (the skip is agreed): nothing changed to gather.
            self._finish(step, reports, Outcome(None, None))
            return
        if self._comm is None:
            raise RuntimeError("ShardedStep used before bind()")
        self._comm.submit(
            lambda: self._gather(step), lambda outcome: self._finish(step, reports, outcome), report_success=True
        )

    async def gathered(self, step: int) -> None:
        """Wait until ``step``'s updated shards are in every local replica.

        :raises ~gsync.SyncFailed: when the all-gather failed, or did not finish within ``sync_timeout``.
        """
        event = self._done.setdefault(step, anyio.Event())
        # The devices' optimizer steps may run one after another (a shared thread): each has the timeout.
        with anyio.move_on_after(self._timeout * self.local_devices) as scope:
            await event.wait()
        if scope.cancelled_caught:
            raise SyncFailed(
                step, None, f"the all-gather of the updated optimizer shards did not finish within {self._timeout} s"
            )
        error = self._errors.get(step)
        if error is not None:
            if isinstance(error, (FitAborted, GsyncError)):
                raise error
            raise SyncFailed(step, None, "the all-gather of the updated optimizer shards failed") from error
        self._done.pop(step - 2, None)
        self._errors.pop(step - 2, None)

    def _finish(self, step: int, reports: list[StepApplied], outcome: Outcome[Any]) -> None:
        # On the loop, as a callback: an error waits for the devices' gathered() instead of raising here.
        try:
            if outcome.error is not None:
                self._errors[step] = outcome.error
                return
            fingerprints = outcome.value or {}
            for report in reports:
                if self._fingerprint is not None and report.device in fingerprints:
                    self._fingerprint(step, report.device, fingerprints[report.device])
            if self._session is not None:
                for report in reports:
                    self._session.try_post(report)
        except Exception as error:  # noqa: BLE001 - ReplicasDiverged, reported by the devices
            self._errors[step] = error
        finally:
            self._done.setdefault(step, anyio.Event()).set()

    # -- in the communication thread, after every local device applied ---------------

    def _gather(self, step: int) -> dict[int, float]:
        if self._collective is None or self._streams is None:
            raise RuntimeError("ShardedStep used before bind()")
        if self._abort is not None and self._abort.is_set():
            raise FitAborted
        streams = self._streams
        cuda = streams if isinstance(streams, CudaStreamSync) else None
        if cuda is not None:
            _order_after(cuda, compute_first=True)
        for bucket in range(len(self.plan.buckets)):
            scratches = [self._scratch_for(device, bucket) for device in range(self.local_devices)]
            nbytes = scratches[0].numel() * scratches[0].element_size()
            with self._trace.span("all_gather", step, bucket=bucket, nbytes=nbytes) if self._trace else _Nothing():
                for shard, scratch in zip(self.shards, scratches):
                    with _on_comm(cuda, shard.index):
                        shard.pack(bucket, scratch)
                self._collective.all_gather(scratches)
                for shard, scratch in zip(self.shards, scratches):
                    with _on_comm(cuda, shard.index):
                        shard.unpack(bucket, scratch)
        if cuda is not None:
            _order_after(cuda, compute_first=False)
        every = self._check_every
        if every is None or (step + 1) % every != 0:
            return {}
        with torch.no_grad():
            return {
                shard.index: float(sum(p.detach().double().sum() for p in shard.params))  # type: ignore[arg-type]
                for shard in self.shards
            }

    def _scratch_for(self, device: int, bucket: int) -> torch.Tensor:
        """A buffer of one bucket's size per device and dtype, kept for the session: the all-gather's."""
        plan = self.plan.buckets[bucket]
        kept = self._scratch[device]
        scratch = kept.get(plan.dtype)
        if scratch is None or scratch.numel() < plan.numel:
            largest = max(b.numel for b in self.plan.buckets if b.dtype == plan.dtype)
            scratch = kept[plan.dtype] = torch.empty(largest, dtype=plan.dtype, device=self.shards[device].params[0].device)
        return scratch[: plan.numel]


def _on_comm(streams: CudaStreamSync | None, device: int) -> Any:
    if streams is None:
        return _Nothing()
    return on_device(streams.comm_cuda_stream(device))


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _order_after(streams: CudaStreamSync, *, compute_first: bool) -> None:
    """CUDA: the all-gather's copies wait for each device's optimizer step (compute stream), and the next step's
    forward waits for the all-gather (comm stream)."""
    for device in range(streams.num_devices):
        compute, comm = streams.compute_cuda_stream(device), streams.comm_cuda_stream(device)
        source, target = (compute, comm) if compute_first else (comm, compute)
        event = torch.cuda.Event()
        event.record(source)
        target.wait_event(event)

