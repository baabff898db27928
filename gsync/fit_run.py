"""One ``fit``: build the replicas, actors, server and feeder, run them as one task group, tear down.

Everything here is per call, so an engine can ``fit`` again afterwards.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch
from torch import nn

from ._threads import LoopHandle, WorkerThread
from .actor import ActorContext, DeviceActor, LossFn, ReplicaFingerprints, Shard
from .buckets import BucketPlan
from .buffers import BufferSync
from .checkpoint import Checkpoint
from .comm.base import Collective
from .comm.local import LocalCollective
from .comm.nccl import NcclCollective
from .comm.process_group import ProcessGroupCollective
from .devices import DeviceSpec
from .distributed import FailureReport, peer_failed
from .distributed.runtime import ProcessGroupRuntime
from .errors import ConfigError, GsyncError, InputTypeError, SyncFailed, SyncTimeout
from .feeder import Feeder
from .mailbox import Mailbox
from .messages import ServerMessage
from .outcome import first_failure
from .result import FitResult, FitStats
from .server import SyncServer
from .streams import CudaStreamSync, StreamSync, make_stream_sync
from .topology import Topology
from .trace import Trace

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ("FitRun", "OptimizerFactory")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# How long teardown waits for worker threads to finish their current job
# before leaving them (they are daemons and stop at their next phase boundary
# or gradient hook).
_THREAD_GRACE_S = 0.5
# Upper bound on reporting a failure to other ranks and closing a process group.
_DIST_TEARDOWN_S = 10.0


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _build_optimizer(factory: OptimizerFactory, replica: nn.Module) -> torch.optim.Optimizer:
    optimizer = factory(_trainable(replica))
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


class FitRun:
    """Everything one ``fit`` owns; built fresh per call so an engine can fit again."""

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        data: Iterable[Any] | AsyncIterable[Any],
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        epochs: int,
        resume: Checkpoint | None,
        process_local_data: bool,
    ) -> None:
        self.engine = engine
        self.process_local_data = bool(process_local_data)
        self.model = model
        self.data = data
        self.optimizer_factory = optimizer
        self.loss_fn = loss_fn
        self.epochs = epochs
        self.resume = resume
        self.first_step = 0 if resume is None else resume.next_step
        self.reported: GsyncError | None = None
        """The failure already published to the other ranks, if any."""

    def _replicate(self) -> list[nn.Module]:
        replicas = []
        for spec in self.engine.devices:
            replica = copy.deepcopy(self.model).to(spec.torch_device)
            if self.resume is not None:
                replica.load_state_dict(self.resume.model_state)
            # Modes are kept as given (a frozen BatchNorm in eval mode stays so), as DDP does.
            replicas.append(replica)
        return replicas

    def _optimizers(self, replicas: list[nn.Module]) -> list[torch.optim.Optimizer]:
        optimizers = [_build_optimizer(self.optimizer_factory, replica) for replica in replicas]
        if self.resume is not None:
            for optimizer in optimizers:
                # load_state_dict keeps tensors that need no cast as they are:
                # without a copy, every replica would step one shared momentum buffer.
                optimizer.load_state_dict(copy.deepcopy(self.resume.optimizer_state))
        return optimizers

    async def execute(self) -> FitResult:
        engine = self.engine
        loop = LoopHandle()
        abort = threading.Event()
        if not engine.distributed:
            return await self._train(loop, abort, None, None)
        # Joining, checks, reports and teardown of a process group all block:
        # they run in a thread of their own, never on the event loop.
        setup = WorkerThread("gsync-dist", loop)
        runtime: ProcessGroupRuntime | None = None
        try:
            runtime = await setup.run(
                lambda: ProcessGroupRuntime.start(
                    engine.process_group,
                    engine.store,
                    engine.devices[0].type,
                    engine.devices[0].torch_device,
                    len(engine.devices),
                    engine.sync_timeout,
                    self.process_local_data,
                    abort,
                )
            )
            return await self._train(loop, abort, runtime, setup)
        except GsyncError as failure:
            if runtime is not None and failure is not self.reported and failure.__cause__ is not self.reported:
                # Before the group goes down, so peers learn why instead of seeing connections close.
                await _report(runtime, setup, failure)
            raise
        finally:
            # A start-up collective still waiting (the fit was cancelled, or a
            # peer died) leaves now, so the setup thread is free for teardown.
            abort.set()
            with anyio.CancelScope(shield=True), anyio.move_on_after(_DIST_TEARDOWN_S):
                if runtime is not None:
                    await setup.run(runtime.close)
            setup.stop()
            await setup.join(_THREAD_GRACE_S)

    async def _train(
        self, loop: LoopHandle, abort: threading.Event, runtime: ProcessGroupRuntime | None, setup: WorkerThread | None
    ) -> FitResult:
        engine = self.engine
        replicas = self._replicate()
        if runtime is not None and setup is not None:
            await setup.run(lambda: runtime.prepare(replicas))
        plan = BucketPlan.build(
            [(name, p) for name, p in replicas[0].named_parameters() if p.requires_grad],
            first_bucket_bytes=int(engine.first_bucket_mb * 2**20),
            bucket_cap_bytes=int(engine.bucket_cap_mb * 2**20),
        )
        optimizers = self._optimizers(replicas)
        topology = runtime.topology if runtime is not None else Topology(local_devices=len(replicas))
        streams = make_stream_sync([spec.torch_device for spec in engine.devices], len(plan.buckets))
        collective: Collective = (
            ProcessGroupCollective(runtime.session.group, topology, abort)
            if runtime is not None
            else _local_collective(engine.devices, streams)
        )
        trace = engine.trace if isinstance(engine.trace, Trace) else Trace() if engine.trace else None
        device_names = [spec.name for spec in engine.devices]
        buffers = BufferSync(replicas)
        server_mailbox: Mailbox[ServerMessage] = Mailbox("sync server", loop)
        context = ActorContext(
            plan=plan,
            loss_fn=self.loss_fn,
            server=server_mailbox,
            loop=loop,
            abort=abort,
            sync_timeout=engine.sync_timeout,
            on_nonfinite=engine.on_nonfinite,
            check_replicas_every=engine.check_replicas_every,
            fingerprints=ReplicaFingerprints(device_names) if engine.check_replicas_every else None,
            trace=trace,
            site_hooks=tuple(engine._site_hooks),
            first_bucket_bytes=int(engine.first_bucket_mb * 2**20),
            bucket_cap_bytes=int(engine.bucket_cap_mb * 2**20),
            streams=streams,
        )
        streams_of_shards = [anyio.create_memory_object_stream[Shard](1) for _ in replicas]
        # Worker threads start with their first job, so nothing below needs cleanup until the group runs.
        actors = []
        for index, (spec, replica, optimizer) in enumerate(zip(engine.devices, replicas, optimizers)):
            # Bucket buffers are allocated on the compute stream that uses them.
            with streams.compute_stream(index):
                actors.append(DeviceActor(index=index, spec=spec, replica=replica, optimizer=optimizer, context=context))

        def first_order() -> list[int]:
            order = _complete_order(context.plan, actors[0].readiness.order)
            return runtime.agree_order(order) if runtime is not None else order

        finish = None
        global_losses: dict[int, float] = {}
        if runtime is not None:
            group_runtime = runtime

            def finish(
                step: int, unused: tuple[int, ...], skip: bool, rows: int | None, last: bool
            ) -> tuple[tuple[int, ...], bool]:
                local_rows = rows if self.process_local_data else None
                local_loss = sum(actor.losses.get(step, 0.0) for actor in actors)
                agreed = group_runtime.agree_step(step, len(plan.names), unused, skip, local_rows, local_loss, last)
                global_losses[step] = agreed.loss
                return agreed.unused, agreed.skip

        server = SyncServer(
            mailbox=server_mailbox,
            context=context,
            device_names=device_names,
            flats=lambda bucket: [actor.grads.flats[bucket] for actor in actors],
            buffers=buffers,
            collective=collective,
            device_mailboxes=[actor.mailbox for actor in actors],
            loop=loop,
            last_seen=lambda device: f"step {actors[device].step}, {actors[device].site}",
            after_first_step=lambda order: _rebuild(context, order),
            first_order=first_order,
            finish=finish,
        )
        feeder = Feeder(
            data=self.data,
            epochs=self.epochs,
            server=server_mailbox,
            shard_streams=[send for send, _ in streams_of_shards],
            loop=loop,
            topology=topology,
            first_step=self.first_step,
            process_local=self.process_local_data,
        )
        failure: BaseException | None = None
        failure_group: BaseExceptionGroup[Any] | None = None
        try:
            try:
                async with anyio.create_task_group() as group:
                    if runtime is not None and setup is not None:
                        group.start_soon(_raise_on_peer_failure, runtime, setup, loop)
                    async with anyio.create_task_group() as work:
                        work.start_soon(server.run)
                        for actor, (_, receive) in zip(actors, streams_of_shards):
                            work.start_soon(actor.run, receive)
                        work.start_soon(feeder.run)
                    group.cancel_scope.cancel()
            except BaseExceptionGroup as errors:
                failure_group = errors
        finally:
            abort.set()
            for send, receive in streams_of_shards:
                send.close()
                receive.close()
            server_mailbox.discard()
            await _teardown(actors, server, feeder, streams)
            collective.close()
        if failure_group is not None:
            # Devices that failed while the group was already ending (up to the
            # end of teardown) had their tasks cancelled before they could
            # raise; their failures were kept on the actor.
            late = [a.failure for a in actors if a.failure is not None]
            failure = first_failure(failure_group, late)
            if runtime is not None and setup is not None and isinstance(failure, GsyncError):
                # Publish this rank's failure before looking for a peer's, so two
                # ranks whose collective failed do not each wait for the other.
                await _report(runtime, setup, failure)
                self.reported = failure
                if isinstance(failure, (SyncFailed, SyncTimeout)):
                    failure = await _blame_peer(runtime, setup, failure)

        if failure is None:
            failure = feeder.deferred_error
        if failure is not None:
            if isinstance(failure, GsyncError):
                self._attach_checkpoint(failure, actors, buffers)
            raise failure

        if server.steps_synced == 0 and self.resume is not None:
            raise ConfigError(
                f"resuming after step {self.resume.step} trained nothing: data has no batch past it in {self.epochs} "
                "epoch(s); epochs counts all epochs of the run, including those before the checkpoint"
            )
        with torch.no_grad():
            self.model.load_state_dict(replicas[0].state_dict())
        last_step = self.first_step + server.steps_synced - 1
        steps = range(self.first_step, last_step + 1)
        if runtime is not None:
            losses = [global_losses[step] for step in steps]
        else:
            losses = [sum(actor.losses.get(step, 0.0) for actor in actors) for step in steps]
        return FitResult(
            model=self.model,
            losses=losses,
            first_step=self.first_step,
            skipped_steps=list(server.skipped_steps),
            checkpoint=Checkpoint.capture(last_step, replicas[0], optimizers[0]),
            stats=FitStats(
                steps=server.steps_synced,
                buckets=len(context.plan.buckets),
                bucket_ready_messages=server.bucket_ready_received,
                bucket_sizes=tuple(b.nbytes for b in context.plan.buckets),
                bucket_params=tuple(tuple(context.plan.names[p] for p in b.params) for b in context.plan.buckets),
                rebuilt_buckets=context.plan is not plan,
            ),
            trace=trace,
        )

    def _attach_checkpoint(self, failure: GsyncError, actors: list[DeviceActor], buffers: BufferSync) -> None:
        """Give ``failure`` the most advanced consistent state any replica still holds."""
        try:
            checkpoint = self._last_consistent(actors, buffers)
        except Exception as error:  # noqa: BLE001 - the original failure matters more
            failure.add_note(f"gsync could not capture a checkpoint: {error!r}")
            return
        failure.checkpoint = checkpoint
        failure.last_step = checkpoint.step if checkpoint.step >= 0 else None

    def _last_consistent(self, actors: list[DeviceActor], buffers: BufferSync) -> Checkpoint:
        # A replica whose optimizer step was interrupted is half-updated; every
        # other replica holds the state after its own last applied step, and
        # each such step was reduced on every device before it was applied.
        clean = [actor for actor in actors if not actor.optimizer_dirty]
        if not clean:
            raise RuntimeError("every replica was interrupted inside its optimizer step")
        best = max(clean, key=lambda actor: actor.applied_step)
        if best.applied_step < self.first_step:
            if self.resume is not None:
                return self.resume
            return Checkpoint.capture(-1, self.model, best.optimizer)
        return Checkpoint.capture(best.applied_step, best.replica, best.optimizer, buffers.snapshot(best.applied_step))


def _local_collective(devices: Sequence[DeviceSpec], streams: StreamSync) -> Collective:
    """In-process arithmetic for CPU devices; NCCL on the comm streams for CUDA devices."""
    if isinstance(streams, CudaStreamSync):
        return NcclCollective([spec.torch_device for spec in devices], streams)
    return LocalCollective(len(devices))


async def _raise_on_peer_failure(runtime: ProcessGroupRuntime, setup: WorkerThread, loop: LoopHandle) -> None:
    """Wait for another rank's failure report and raise it as :class:`~gsync.PeerFailed`."""
    arrived = anyio.Event()
    reports: list[FailureReport] = []

    def deliver(report: FailureReport) -> None:
        reports.append(report)
        arrived.set()

    # Starting the watcher opens a store connection: not on the event loop.
    await setup.run(lambda: runtime.watch(lambda report: loop.call_soon(deliver, report)))
    await arrived.wait()
    raise peer_failed(reports[0])


async def _report(runtime: ProcessGroupRuntime, setup: WorkerThread, failure: GsyncError) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_DIST_TEARDOWN_S):
        await setup.run(lambda: runtime.report(failure))


async def _blame_peer(runtime: ProcessGroupRuntime, setup: WorkerThread, failure: GsyncError) -> GsyncError:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_DIST_TEARDOWN_S):
        return await setup.run(lambda: runtime.blame_peer(failure))
    return failure


def _complete_order(plan: BucketPlan, observed: Sequence[int]) -> list[int]:
    """The observed gradient order, then the parameters that got none, in reverse registration order."""
    seen = set(observed)
    return list(observed) + [p for p in reversed(range(len(plan.names))) if p not in seen]


def _rebuild(context: ActorContext, order: list[int]) -> None:
    """Rebuild the bucket plan once, from the order gradients became ready in the first step (as DDP does).

    ``order`` is complete (see :func:`_complete_order`) and, across
    processes, rank 0's. The plan changes only if the assignment differs, so
    models whose backward follows reverse registration order keep their buffers.
    """
    plan = context.plan
    rebuilt = BucketPlan.build(
        [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in zip(plan.names, plan.shapes, plan.dtypes)],
        first_bucket_bytes=context.first_bucket_bytes,
        bucket_cap_bytes=context.bucket_cap_bytes,
        order=order,
    )
    if [b.params for b in rebuilt.buckets] != [b.params for b in plan.buckets]:
        context.plan = rebuilt
        context.streams.rebuild(len(rebuilt.buckets))


async def _teardown(actors: list[DeviceActor], server: SyncServer, feeder: Feeder, streams: StreamSync) -> None:
    workers = [actor.worker for actor in actors]
    for actor in actors:
        actor.close()
        actor.mailbox.discard()
    # The last job of the communication thread waits for every stream's queued
    # work (a host sync, so never on the event loop), before replica state is
    # read and bucket buffers are freed.
    server.comm.submit(lambda: streams.close(timeout=_THREAD_GRACE_S * 10), lambda outcome: None)
    server.close()
    workers.append(server.comm)
    if feeder.worker is not None:
        workers.append(feeder.worker)
    deadline = time.monotonic() + _THREAD_GRACE_S
    for worker in workers:
        await worker.join(max(0.0, deadline - time.monotonic()))
