"""What the actors of one session share: the recipe, the settings, and the context they run in.

The device actors, the sync server and the session import these; none of
them imports another's module for a shared type.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import torch

from ..threads import LoopHandle
from ..gradients.buckets import BucketPlan
from ...errors import ReplicasDiverged
from .mailbox import Mailbox
from .inbox import ServerInbox
from .features import BatchStatsSync, ShardedUpdate
from .messages import DeviceMessage, SessionMessage
from ..streams import HostStreamSync, StreamSync
from ...trace import Trace

from ...types import LossFn, OptimizerFactory, SchedulerFactory

__all__ = (
    "ActorContext",
    "DeviceEndpoint",
    "LossFn",
    "OptimizerFactory",
    "Recipe",
    "ReplicaFingerprints",
    "SchedulerFactory",
    "Shard",
    "SiteHook",
)

SiteHook = Callable[[int, int, str, threading.Event], None]
"""Called as ``hook(device_index, step, site, abort)`` in the worker thread as each site (phase) starts."""


@dataclass(frozen=True)
class Recipe:
    """How each replica trains: the user's loss and optimizer, and the recipe features around them.

    ``scheduler`` builds one LR scheduler per replica, stepped once after
    every optimizer step; ``clip_grad_norm`` clips the *reduced* gradient
    (identical on every replica, so no collective is needed); ``autocast``
    runs ``loss_fn`` under ``torch.autocast`` with that dtype, and float16
    adds one ``GradScaler`` per replica.
    """

    loss_fn: LossFn
    optimizer: OptimizerFactory
    scheduler: SchedulerFactory | None = None
    clip_grad_norm: float | None = None
    autocast: torch.dtype | None = None

    @property
    def scales_loss(self) -> bool:
        return self.autocast == torch.float16

    def autocast_in(self, device: torch.device) -> AbstractContextManager[Any]:
        """Where the loss function runs: under ``torch.autocast`` when the recipe autocasts."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


@dataclass(frozen=True)
class Shard:
    """One device's part of one optimizer step: one shard per global batch the step accumulates.

    ``rows[i]`` and ``data[i]`` are this device's rows and shard of batch
    ``i``; ``total_rows[i]`` that batch's rows over every device of every process.
    """

    step: int
    rows: tuple[int, ...]
    total_rows: tuple[int, ...]
    data: tuple[Any, ...]
    local_rows: tuple[tuple[int, ...], ...] = ()
    """Per batch, the rows of every device of this process: SyncBatchNorm's rendezvous waits for those with rows."""
    padded: tuple[bool, ...] = ()
    """Per batch, whether some process of the run may have no rows of it: SyncBatchNorm's statistics then follow
    the padded protocol (see :mod:`gsync._core.batchnorm`)."""

    @property
    def weight(self) -> float:
        """The device's share of the step's gradient: its share of each batch, averaged over the batches."""
        return sum(rows / total for rows, total in zip(self.rows, self.total_rows)) / len(self.rows)


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


class FirstStepInTurn:
    """A session's first step runs its CPU devices one at a time, in device order.

    Torch sets up some CPU kernels on their first use in a process, and when
    two threads make those first calls at once, one of them now and then
    gets a result that differs in the last bit (reproduced in plain PyTorch,
    two threads and no gsync: 1 fresh process in 30). Runs must be
    reproducible to the bit (a resumed run ends exactly where an
    uninterrupted one does), so the first step, where the first uses
    happen, takes its forward and backward, and then its optimizer step, in
    turn; every later step runs its devices at once. The cost is one step's
    overlap per session.
    """

    PHASES = ("forward_backward", "optimizer")

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self._done = {phase: [anyio.Event() for _ in range(devices)] for phase in self.PHASES}

    async def wait_turn(self, phase: str, index: int) -> None:
        if index > 0:
            await self._done[phase][index - 1].wait()

    def done(self, phase: str, index: int) -> None:
        """``index``'s turn ended (or failed: the next device goes on, and stops if the session is ending)."""
        self._done[phase][index].set()

    def queued(self, index: int) -> bool:
        """Whether device ``index`` is (or will be) waiting behind another device's first forward and backward."""
        return index > 0 and not self._done["forward_backward"][index - 1].is_set()


@dataclass(frozen=True)
class ActorContext:
    """What every actor of one session shares, fixed for the session's life.

    ``plan`` is the first bucket plan; the sync server sends the one that
    replaces it after the first step (``StepSynced.plan``). ``server`` is where
    devices post to the sync server, ``session`` where the server and the
    devices post to the session.
    """

    plan: BucketPlan
    recipe: Recipe
    server: ServerInbox
    session: Mailbox[SessionMessage]
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
    first_step: FirstStepInTurn | None = None
    """The devices' turns for the first step (see :class:`FirstStepInTurn`); ``None``: all at once."""
    grads_in_place: bool = False
    """Gradients stay where autograd put them, as in a plain loop, rather than being copied into the bucket
    buffers: the run has one device in all (nothing to reduce), or its reduction takes each device's gradient
    tensors as they are (:meth:`~gsync.LocalCollective.all_reduce_each`). Buckets then hold only what must be
    formed first (a step's accumulated batches, sparse gradients) and buckets of many small tensors (see
    :func:`~gsync._core.gradients.buckets.reduced_in_place`)."""
    alone: bool = False
    """One device in the whole run, without compression: a reduction is the identity."""
    shared_thread: bool = False
    """This process's devices take turns on one compute thread (``Engine(device_threads=...)``)."""
    intra_op_threads: tuple[int, int] | None = None
    """Torch intra-op threads for each device thread and for the communication thread, where this process's CPU
    devices split its cores (``Engine.intra_op_threads``); ``None``: the count of the thread that opens the session."""
    batch_stats: BatchStatsSync | None = None
    """Where the replicas' ``nn.SyncBatchNorm`` layers sum their batch statistics; ``None``: the model has none."""
    sharding: ShardedUpdate | None = None
    """``shard_optimizer=True``: each device steps its shard of every bucket, gathered back after each step
    (see :mod:`gsync._core.sharding.step`); ``None``: every device steps every parameter."""


class DeviceEndpoint(Protocol):
    """What the sync server sees of a device actor: its mailbox, its bucket buffers (or the gradients a bucket
    holds, where they stay in ``.grad``), where it is."""

    @property
    def name(self) -> str: ...

    @property
    def mailbox(self) -> Mailbox[DeviceMessage]: ...

    def bucket_buffer(self, bucket: int) -> torch.Tensor: ...

    def bucket_grads(self, bucket: int) -> list[torch.Tensor]: ...

    def where(self) -> str: ...

    @property
    def queued(self) -> bool:
        """Its job waits for the thread it shares with other devices (so another device holds it up)."""
        ...
