"""The engine: validates, replicates, and runs one ``fit`` as one anyio task group.

A ``fit`` builds a replica, optimizer and bucket buffers per device, starts
the feeder, the sync server and one actor per device in one task group, and
turns however that group ends into one result or one exception.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from torch import nn

from ._threads import LoopHandle
from .actor import DeviceActor, LossFn, Shard
from .buckets import BucketPlan
from .buffers import BufferSync
from .comm.local import LocalCollective
from .devices import DeviceSpec, parse_devices
from .errors import ConfigError, FitError, GsyncError, InputTypeError
from .feeder import Feeder
from .mailbox import Mailbox
from .messages import ServerMessage
from .server import SyncServer
from .trace import Trace

__all__ = ("Engine", "FitResult", "FitStats")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# How long teardown waits for worker threads to finish their current job
# before leaving them (they are daemons and stop at their next gradient hook).
_THREAD_GRACE_S = 0.5


@dataclass
class FitStats:
    """Counters of one ``fit``, for tests and benchmarks."""

    steps: int = 0
    buckets: int = 0
    bucket_ready_messages: int = 0
    bucket_sizes: tuple[int, ...] = ()


@dataclass
class FitResult:
    model: nn.Module
    """The module passed to ``fit``, holding the trained parameters and buffers."""
    losses: list[float]
    """The global mean loss of each optimizer step."""
    stats: FitStats = field(default_factory=FitStats)
    trace: Trace | None = None
    """The timeline of the fit, when the engine was built with ``trace=True``."""


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class Engine:
    """Data-parallel training over several devices in one process.

    :param devices: device strings or ``torch.device``s; ``"cpu:N"`` is the
        N-th virtual CPU device. Default: every visible CUDA device, else ``["cpu"]``.
    :param bucket_cap_mb: largest gradient bucket, in MiB.
    :param first_bucket_mb: size of the first bucket, kept small so the first
        reduction starts early in backward.
    :param sync_timeout: seconds a step may take to synchronize before
        :class:`~gsync.SyncTimeout` is raised.
    :param trace: record a timeline of every phase and reduction in
        ``FitResult.trace`` (see :class:`gsync.Trace`); ``True`` for a fresh
        trace per fit, or a ``Trace`` instance to record into.
    :raises ~gsync.ConfigError: for any invalid value, before anything is built.
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        sync_timeout: float = 300.0,
        trace: bool | Trace = False,
    ) -> None:
        self.bucket_cap_mb = _positive("bucket_cap_mb", bucket_cap_mb)
        self.first_bucket_mb = _positive("first_bucket_mb", first_bucket_mb)
        self.sync_timeout = _positive("sync_timeout", sync_timeout)
        self.devices: list[DeviceSpec] = parse_devices(devices)
        self.trace = trace
        self._running = False

    def __repr__(self) -> str:
        return f"Engine(devices={[d.name for d in self.devices]})"

    async def fit(
        self,
        model: nn.Module,
        data: Iterable[Any] | AsyncIterable[Any],
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        epochs: int = 1,
    ) -> FitResult:
        """Train ``model`` on ``data`` with one replica per device and return it trained.

        ``data`` yields *global* batches; each is split along dim 0 into one
        contiguous shard per device. ``loss_fn(model, shard)`` returns the mean
        loss of its shard; shards are weighted by their row counts, so every
        step equals one step of single-device training on the whole batch.

        The model passed in is only read until training succeeds; then it
        receives the first replica's parameters and buffers. Cancelling the
        calling task stops every actor and worker thread and leaves the model
        as it was.

        :raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError` for bad
            input, before any optimizer step.
        :raises ~gsync.WorkerFailed: when training code raises on a device.
        :raises ~gsync.SyncFailed: when a reduction raises.
        :raises ~gsync.SyncTimeout: when a step stalls for ``sync_timeout`` seconds.
        """
        _check_fit_args(model, data, optimizer, loss_fn, epochs)
        if self._running:
            raise ConfigError("this engine is already running a fit; await it before starting another")
        self._running = True
        try:
            return await _FitRun(self, model, data, optimizer, loss_fn, epochs).execute()
        finally:
            self._running = False


def _check_fit_args(model: object, data: object, optimizer: object, loss_fn: object, epochs: object) -> None:
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(
            "optimizer must be a factory, called once per replica with that replica's parameters, "
            "e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    if not callable(loss_fn):
        raise InputTypeError("loss_fn must be callable as loss_fn(model, shard) -> scalar tensor")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs must be a positive int, got {epochs!r}")
    if isinstance(data, torch.Tensor):
        raise InputTypeError("data is a single tensor; pass an iterable of batches, e.g. [tensor] or a DataLoader")
    if not isinstance(data, (Iterable, AsyncIterable)):
        raise InputTypeError(f"data must be an iterable or async iterable of batches, got {type(data).__name__}")
    one_shot = (isinstance(data, Iterable) and iter(data) is data) or (
        isinstance(data, AsyncIterable) and aiter(data) is data
    )
    if one_shot and epochs > 1:
        raise ConfigError(
            f"data is a one-shot iterator but epochs={epochs}: pass a re-iterable (a list or a DataLoader) "
            "so each epoch can start over"
        )


def _replicate(model: nn.Module, device: torch.device) -> nn.Module:
    replica = copy.deepcopy(model).to(device)
    replica.train()
    return replica


def _build_optimizer(factory: OptimizerFactory, replica: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer(params) returned a {type(optimizer).__name__}; it must return a torch.optim.Optimizer")
    own = {id(p) for p in replica.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in own:
                raise ConfigError(
                    "the optimizer factory built an optimizer over parameters it was not given (often "
                    "`lambda params: SGD(model.parameters(), ...)`); build it over the params argument"
                )
    return optimizer


class _FitRun:
    """Everything one ``fit`` owns; built fresh per call so an engine can fit again."""

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        data: Iterable[Any] | AsyncIterable[Any],
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        epochs: int,
    ) -> None:
        self.engine = engine
        self.model = model
        self.data = data
        self.optimizer_factory = optimizer
        self.loss_fn = loss_fn
        self.epochs = epochs

    async def execute(self) -> FitResult:
        engine = self.engine
        loop = LoopHandle()
        abort = threading.Event()
        replicas = [_replicate(self.model, spec.torch_device) for spec in engine.devices]
        named = [(name, p) for name, p in replicas[0].named_parameters() if p.requires_grad]
        plan = BucketPlan.build(
            named,
            first_bucket_bytes=int(engine.first_bucket_mb * 2**20),
            bucket_cap_bytes=int(engine.bucket_cap_mb * 2**20),
        )
        optimizers = [
            _build_optimizer(self.optimizer_factory, replica, [p for _, p in replica.named_parameters() if p.requires_grad])
            for replica in replicas
        ]
        collective = LocalCollective(len(replicas))
        trace = engine.trace if isinstance(engine.trace, Trace) else Trace() if engine.trace else None
        actors: list[DeviceActor] = []
        server: SyncServer | None = None
        feeder: Feeder | None = None
        failure: BaseException | None = None
        streams = [anyio.create_memory_object_stream[Shard](1) for _ in replicas]
        try:
            server_mailbox: Mailbox[ServerMessage] = Mailbox("sync server", loop)
            for index, (spec, replica, optimizer) in enumerate(zip(engine.devices, replicas, optimizers)):
                actors.append(
                    DeviceActor(
                        index=index,
                        spec=spec,
                        replica=replica,
                        optimizer=optimizer,
                        plan=plan,
                        loss_fn=self.loss_fn,
                        server=server_mailbox,
                        loop=loop,
                        abort=abort,
                        trace=trace,
                    )
                )
            server = SyncServer(
                mailbox=server_mailbox,
                plan=plan,
                device_names=[spec.name for spec in engine.devices],
                grads=[actor.grads for actor in actors],
                buffers=BufferSync(replicas),
                collective=collective,
                device_mailboxes=[actor.mailbox for actor in actors],
                loop=loop,
                sync_timeout=engine.sync_timeout,
                trace=trace,
            )
            feeder = Feeder(
                data=self.data,
                epochs=self.epochs,
                server=server_mailbox,
                shard_streams=[send for send, _ in streams],
                loop=loop,
            )
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(server.run)
                    for actor, (_, receive) in zip(actors, streams):
                        group.start_soon(actor.run, receive)
                    group.start_soon(feeder.run)
            except BaseExceptionGroup as errors:
                failure = _first_failure(errors)
        finally:
            abort.set()
            for send, receive in streams:
                send.close()
                receive.close()
            await self._teardown(actors, server, feeder)
            collective.close()
        if failure is not None:
            raise failure

        with torch.no_grad():
            self.model.load_state_dict(replicas[0].state_dict())
        losses = [sum(actor.losses.get(step, 0.0) for actor in actors) for step in range(server.steps_synced)]
        stats = FitStats(
            steps=server.steps_synced,
            buckets=len(plan.buckets),
            bucket_ready_messages=server.bucket_ready_received,
            bucket_sizes=tuple(b.nbytes for b in plan.buckets),
        )
        return FitResult(self.model, losses, stats, trace)

    async def _teardown(self, actors: list[DeviceActor], server: SyncServer | None, feeder: Feeder | None) -> None:
        workers = [actor.worker for actor in actors]
        for actor in actors:
            actor.close()
            actor.mailbox.discard()
        if server is not None:
            server.close()
            server.mailbox.discard()
            workers.append(server.comm)
        if feeder is not None and feeder.worker is not None:
            workers.append(feeder.worker)
        deadline = time.monotonic() + _THREAD_GRACE_S
        for worker in workers:
            await worker.join(max(0.0, deadline - time.monotonic()))


def _flatten(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found.extend(_flatten(error))
        else:
            found.append(error)
    return found


def _first_failure(group: BaseExceptionGroup[Any]) -> BaseException:
    """Pick the one exception ``fit`` raises out of everything the task group collected.

    Bad input comes first (it is the root cause of anything that followed);
    then gsync's failures by time, the earliest carrying the others; then
    anything else (a bug, or a cancellation).
    """
    errors = [e for e in _flatten(group) if not isinstance(e, anyio.get_cancelled_exc_class())]
    if not errors:
        return group.exceptions[0]
    for error in errors:
        if isinstance(error, (ConfigError, InputTypeError)):
            return error
    failures = sorted((e for e in errors if isinstance(e, FitError)), key=lambda e: e.at)
    if failures:
        first, others = failures[0], tuple(failures[1:])
        first.others = others  # type: ignore[attr-defined]
        for other in others:
            first.add_note(f"also failed: {other}")
        return first
    gsync_errors = [e for e in errors if isinstance(e, GsyncError)]
    return (gsync_errors or errors)[0]
