"""``shard_optimizer=True``: each device steps the optimizer on its own shard of every bucket only.

The shards are :func:`~gsync._core.transports.sharding.shard_bounds`'s: device ``g`` of ``N`` (across
processes) owns a contiguous range of each bucket, so a parameter may be cut between devices. A step:

1. every bucket is reduce-scattered instead of all-reduced (the sync server), so each device holds the
   reduced gradient of its own shard;
2. when the recipe clips or scales the loss, the server's last job of the step sums each device's squared
   shard norm over every device (one all-reduce of a number per device): the global norm clips, and a
   non-finite sum is the one answer every device's GradScaler gives (a skipped step is skipped on every
   shard);
3. each device's optimizer steps its shard (:class:`ReplicaShard`);
4. once every local device has stepped, each device reports the step applied and the updated shards are
   all-gathered back into every replica, one bucket at a time, the last bucket (the first parameters) first
   (:class:`ShardedStep`), while the next step's forward already runs: a module waits for the buckets of its
   own parameters only, and whatever else reads a replica (the next optimizer step, an evaluation, a
   checkpoint, the model handed back) for the whole gather.

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
the same point between steps (:mod:`gsync._core.session.sharded_checkpoint`), held here
(:meth:`ShardedStep.holding`) while the checkpoint is captured.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import anyio
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...comm.base import Collective
from ...errors import CheckpointError, ConfigError, GsyncError, SyncFailed
from ..gradients.buckets import BucketPlan, ReplicaGrads
from ..streams import StreamSync
from ..streams.cuda import CudaStreamSync, on_device
from ..threads import FitAborted, Outcome, WorkerThread
from ...trace import Trace
from ..transports.sharding import shard_bounds
from .mailbox import Mailbox
from .messages import SessionMessage, StepApplied

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
        """Every parameter of ``bucket`` from the gathered ``scratch``, but for this device's own slices, which
        the optimizer updated in place (and :meth:`pack` copied from)."""
        plan = self._plan.buckets[bucket]
        targets, sources = [], []
        for position, offset in zip(plan.params, plan.offsets):
            param = self.params[position].detach().view(-1)
            start, stop = self.ranges[position]
            for first, last in ((0, start), (stop, param.numel())) if stop > start else ((0, param.numel()),):
                if last > first:
                    targets.append(param[first:last])
                    sources.append(scratch[offset + first : offset + last])
        if targets:
            torch._foreach_copy_(targets, sources)


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

    Each device reports its applied step here (:meth:`applied`); once every local device has, the updated
    shards are all-gathered on the communication thread, bucket by bucket in :attr:`gather_order` (the reverse
    of the bucket order, so the parameters a forward uses first come first; the same on every process, which
    issues the same collectives in the same order), and every device's ``StepApplied`` goes to the session at
    once: the next step may start while the gather runs.

    The next step's forward waits per bucket, in the device's thread: :meth:`watch` gives each module of a
    replica holding trainable parameters a forward pre-hook that waits for the buckets of its own parameters
    only (so a module runs as soon as its parameters are in, while later buckets are still gathered), and the
    replica itself a forward post-hook and a ``state_dict`` pre-hook that wait for every bucket (a compiled
    model, whose graph the hooks would be compiled into, waits for every bucket before its forward instead).
    Everything else that reads a replica waits for the whole gather (:meth:`whole`, :meth:`wait_whole`): a device before
    its next optimizer step (which writes the slices the gather read), an evaluation, the end of the session's
    data. A wait leaves on the session's abort flag, with the gather's error when it failed, and when the
    gather made no progress for ``sync_timeout``.
    """

    def __init__(self, local_devices: int, world_devices: int, device_offset: int, plan: BucketPlan, sync_timeout: float) -> None:
        self.local_devices = local_devices
        self.world_devices = world_devices
        self.device_offset = device_offset
        self.plan = plan
        self.shards: list[ReplicaShard] = []
        self.clips_or_scales = False
        self.gather_order = tuple(reversed(range(len(plan.buckets))))
        """The buckets in the order they are gathered: the last bucket holds the first parameters registered,
        which a forward typically uses first (the plan fills buckets in reverse registration order)."""
        self._timeout = sync_timeout
        self._pending: dict[int, StepApplied] = {}
        self._done: dict[int, anyio.Event] = {}
        self._errors: dict[int, BaseException] = {}
        self._latest: int | None = None
        # Shared with the device threads (and the loop, reading a replica's state_dict): under _changed.
        self._changed = threading.Condition()
        self._wanted = -1
        """The last step whose gather was submitted: a bucket is whole once ``_through`` reaches it."""
        self._through = [-1] * len(plan.buckets)
        """Per bucket, the last step whose updated shards are in every local replica (written by the comm thread)."""
        self._complete = -1
        """The last step whose every bucket is in (what a hook reads first, once the gather is done)."""
        self._broken: BaseException | None = None
        """The error that ended the gather of ``_wanted`` early."""
        self._moved_at = time.monotonic()
        """When the gather in progress was submitted or last finished a bucket (a wait's timeout runs from it)."""
        self._start_events: list[Any] = []
        self._bucket_events: list[list[Any]] = [[] for _ in plan.buckets]
        # CUDA: per device and bucket, the last step whose gather its compute stream was made to wait for.
        self._compute_waited = [[-1] * len(plan.buckets) for _ in range(local_devices)]
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

    # -- the replicas' hooks: in the device threads (and wherever a state_dict is read) --

    def watch(
        self, device: int, replica: nn.Module, params: Sequence[nn.Parameter], waiting: Callable[[bool], None]
    ) -> tuple[list[RemovableHandle], bool]:
        """Hooks on device ``device``'s ``replica`` (``params``: its trainable parameters, in the plan's order):
        a module's forward waits for the buckets of its own parameters, the replica's forward returns, and its
        ``state_dict()`` reads, once every bucket is in; and whether its forward may start before the gather is
        done (not for a ``torch.compile``-d model, into whose graph the hooks would be compiled: its forward waits
        for the whole gather first, :meth:`wait_whole`). ``waiting(True)`` while a hook blocks, ``waiting(False)``
        after (the device waits on the gather's peers then, as in a collective)."""
        every = tuple(range(len(self.plan.buckets)))
        handles = [replica.register_state_dict_pre_hook(partial(self._before_state_dict, device, every))]
        if any(_compiled(module) for module in replica.modules()):
            return handles, False
        position = {id(param): index for index, param in enumerate(params)}
        bucket_of = self.plan.bucket_of
        for module in replica.modules():
            # Its own parameters only: a parent does not wait for its children's, which their own hooks do (but
            # for those of a container it reads itself, such as an nn.ParameterList).
            buckets = sorted({bucket_of[position[id(p)]] for p in _own_parameters(module) if id(p) in position})
            if buckets:
                # Ahead of the model's own hooks, which may read the parameters (torch.nn.utils.weight_norm's).
                hook = partial(self._before_forward, device, tuple(buckets), waiting)
                handles.append(module.register_forward_pre_hook(hook, prepend=True))
        # A loss_fn reading parameters after the model's forward (a penalty on the weights) reads them whole.
        handles.append(replica.register_forward_hook(partial(self._after_forward, device, every, waiting), prepend=True))
        return handles, True

    def _before_forward(
        self, device: int, buckets: tuple[int, ...], waiting: Callable[[bool], None], module: nn.Module, args: Any
    ) -> None:
        self.wait_buckets(device, buckets, waiting, compute=True)

    def _after_forward(
        self, device: int, buckets: tuple[int, ...], waiting: Callable[[bool], None], module: nn.Module, args: Any, output: Any
    ) -> None:
        self.wait_buckets(device, buckets, waiting, compute=True)

    def _before_state_dict(self, device: int, buckets: tuple[int, ...], module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # Read by a checkpoint, the model a session hands back, session.model; a failure's checkpoint (the abort
        # flag is set) does not wait: it puts every local shard into the replica it reads itself.
        if self._abort is not None and self._abort.is_set():
            return
        self.wait_buckets(device, buckets, _not_told)

    def ready(self, buckets: Sequence[int]) -> bool:
        """Whether the last step's updated shards of every bucket in ``buckets`` are in every local replica."""
        wanted = self._wanted
        if self._complete >= wanted:
            return True
        through = self._through
        return all(through[bucket] >= wanted for bucket in buckets)

    def wait_whole(self, device: int | None = None, waiting: Callable[[bool], None] | None = None) -> None:
        """:meth:`wait_buckets` for every bucket, in device ``device``'s jobs (on its compute stream)."""
        self.wait_buckets(device, range(len(self.plan.buckets)), waiting or _not_told, compute=True)

    def wait_buckets(
        self, device: int | None, buckets: Sequence[int], waiting: Callable[[bool], None], compute: bool = False
    ) -> None:
        """Block until the last step's gather of ``buckets`` is done; with CUDA, ``device``'s current stream
        then waits for it too (``compute``: the device's compute stream, in its jobs, which waits for each
        bucket's gather once).

        :raises ~gsync._core.threads.FitAborted: when the session's abort flag is set meanwhile.
        :raises ~gsync.SyncFailed: when the gather failed, or made no progress for ``sync_timeout``.
        """
        if not self.ready(buckets):
            waiting(True)
            try:
                self._block(buckets)
            finally:
                waiting(False)
        if device is not None:
            self._cuda_wait(device, buckets, compute)

    def _block(self, buckets: Sequence[int]) -> None:
        started = time.monotonic()
        with self._changed:
            while not self.ready(buckets):
                broken = self._broken
                if broken is not None:
                    if isinstance(broken, (FitAborted, GsyncError)):
                        raise broken
                    raise SyncFailed(self._wanted, None, "the all-gather of the updated optimizer shards failed") from broken
                if self._abort is not None and self._abort.is_set():
                    raise FitAborted
                left = self._timeout - (time.monotonic() - max(started, self._moved_at))
                if left <= 0:
                    raise SyncFailed(
                        self._wanted, None,
                        f"the all-gather of the updated optimizer shards made no progress for {self._timeout} s",
                    )
                # The abort flag is an event of its own: read it at least every _ABORT_POLL_S.
                self._changed.wait(min(left, _ABORT_POLL_S))

    def _cuda_wait(self, device: int, buckets: Sequence[int], compute: bool) -> None:
        streams = self._streams
        if not isinstance(streams, CudaStreamSync):
            return
        current = torch.cuda.current_stream(streams.devices[device])
        waited = self._compute_waited[device]
        for bucket in buckets:
            events, gathered = self._bucket_events[bucket], self._through[bucket]
            if not events or (compute and waited[bucket] >= gathered):
                continue
            current.wait_event(events[device])
            if compute:
                waited[bucket] = gathered

    # -- on the event loop -----------------------------------------------------------

    def applied(self, index: int, applied: StepApplied) -> None:
        """Device ``index`` applied ``applied.step``; the last local device's report starts the all-gather and
        reports every device's step applied to the session."""
        step = applied.step
        self._done.setdefault(step, anyio.Event())
        self._pending[index] = applied
        if len(self._pending) < self.local_devices:
            return
        reports = [self._pending.pop(i) for i in range(self.local_devices)]
        self._latest = step
        if all(report.skipped for report in reports):
            # Skipped on every device of every process alike (the skip is agreed): nothing changed to gather.
            self._finish(step, Outcome(None, None))
        else:
            if self._comm is None:
                raise RuntimeError("ShardedStep used before bind()")
            streams = self._streams
            if isinstance(streams, CudaStreamSync):
                # Recorded now, before any device queues the next step's forward: the gather's copies follow the
                # optimizer steps only.
                self._start_events = _recorded([streams.compute_cuda_stream(d) for d in range(streams.num_devices)])
            with self._changed:
                self._wanted = step
                self._broken = None
                self._moved_at = time.monotonic()
            # Submitted before the session hears of the step: every later collective (the next step's
            # reductions, a session call's) queues behind it on the communication thread.
            self._comm.submit(lambda: self._gather(step), lambda outcome: self._finish(step, outcome), report_success=True)
        if self._session is not None:
            for report in reports:
                self._session.try_post(report)

    async def whole(self) -> None:
        """Wait until the last step's gather is done (:meth:`gathered`); at once before any step."""
        if self._latest is not None:
            await self.gathered(self._latest)

    async def gathered(self, step: int) -> None:
        """Wait until ``step``'s updated shards are in every local replica (and the replicas were compared, on a
        step that compares them).

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

    def _finish(self, step: int, outcome: Outcome[Any]) -> None:
        # On the loop, as a callback: an error waits for the devices' next wait instead of raising here.
        try:
            if outcome.error is not None:
                self._errors[step] = outcome.error
                with self._changed:
                    if self._wanted == step and self._broken is None:
                        self._broken = outcome.error  # the thread never ran it (stopped): the hooks stop waiting
                    self._changed.notify_all()
                return
            fingerprints = outcome.value or {}
            for device in sorted(fingerprints):
                if self._fingerprint is not None:
                    self._fingerprint(step, device, fingerprints[device])
        except Exception as error:  # noqa: BLE001 - ReplicasDiverged, raised by the devices' next wait
            self._errors[step] = error
        finally:
            self._done.setdefault(step, anyio.Event()).set()

    # -- in the communication thread, after every local device applied ---------------

    def _gather(self, step: int) -> dict[int, float]:
        try:
            return self._gather_buckets(step)
        except BaseException as error:
            with self._changed:
                self._broken = error
                self._changed.notify_all()
            raise

    def _gather_buckets(self, step: int) -> dict[int, float]:
        if self._collective is None or self._streams is None:
            raise RuntimeError("ShardedStep used before bind()")
        streams = self._streams
        cuda = streams if isinstance(streams, CudaStreamSync) else None
        if cuda is not None:
            for device, event in enumerate(self._start_events):
                cuda.comm_cuda_stream(device).wait_event(event)
        for bucket in self.gather_order:
            if self._abort is not None and self._abort.is_set():
                raise FitAborted
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
            events = [] if cuda is None else _recorded([cuda.comm_cuda_stream(d) for d in range(cuda.num_devices)])
            with self._changed:
                self._bucket_events[bucket] = events
                self._through[bucket] = step
                self._moved_at = time.monotonic()
                self._changed.notify_all()
        with self._changed:
            self._complete = step
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


_ABORT_POLL_S = 0.05


def _not_told(waiting: bool) -> None:
    pass


def _own_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """``module``'s parameters, and those of the children it reads itself: children without a forward of their own
    (``nn.ParameterList``, ``nn.ParameterDict``), which are never called, so their hooks would never wait."""
    yield from module.parameters(recurse=False)
    for child in module.children():
        if type(child).forward is nn.Module.forward:
            yield from _own_parameters(child)


def _compiled(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper, or a module compiled in place (``module.compile()``)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def _on_comm(streams: CudaStreamSync | None, device: int) -> Any:
    if streams is None:
        return _Nothing()
    return on_device(streams.comm_cuda_stream(device))


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _recorded(streams: Sequence[torch.cuda.Stream]) -> list[torch.cuda.Event]:
    """A CUDA event recorded on each of ``streams`` now."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events
