"""Assembling a session: every part a session runs, built from the engine's settings and the user's recipe.

Nothing here starts a thread or a task: worker threads start with their
first job, so an assembly that is never run needs no cleanup beyond closing
its mailboxes and streams (the session's teardown does).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..threads import LoopHandle, WorkerThread
from ..step.actor import DeviceActor
from ..base.agreement import LocalAgreement, StepAgreement
from ..gradients.buckets import BucketPlan
from ..gradients.buffers import BufferSync
from ...comm.base import Collective
from ...comm._capabilities import IN_PLACE
from ..transports.compressed import CompressedCollective
from ...comm.local import LocalCollective
from ..transports.nccl import NcclCollective
from ..transports.process_group import ProcessGroupCollective
from ..step.context import ActorContext, FirstStepInTurn, Recipe, ReplicaFingerprints
from ..distributed.runtime import GROUP_TIMEOUT_MARGIN_S, ProcessGroupAgreement, ProcessGroupRuntime
from ..batchnorm import BatchStatsExchange, adopt_sync_batchnorm, has_sync_batchnorm, sync_batchnorm_width
from ..step.inbox import ServerInbox
from ..step.mailbox import Mailbox
from ..step.messages import ServerMessage, SessionMessage
from ..step.rebuild import PlanRebuild
from ..state.replicas import Replica
from ..step.server import SyncServer
from ..sharding.step import ReplicaShard, ShardedStep
from ..streams import CudaStreamSync, StreamSync, make_stream_sync
from ..topology import Topology
from ...trace import Trace

if TYPE_CHECKING:
    from ..settings import EngineSettings

__all__ = ("Assembly", "assemble", "plan_buckets", "session_trace")


@dataclass
class Assembly:
    topology: Topology
    context: ActorContext
    actors: list[DeviceActor]
    server: SyncServer
    collective: Collective
    streams: StreamSync
    buffers: BufferSync
    rebuild: PlanRebuild
    server_mailbox: Mailbox[ServerMessage]
    session_mailbox: Mailbox[SessionMessage]
    trace: Trace | None
    sharding: ShardedStep | None
    """``shard_optimizer=True``: the shards and their gather (the step's parts see it as ``context.sharding``)."""


def plan_buckets(settings: EngineSettings, named_params: Sequence[tuple[str, object]]) -> BucketPlan:
    """The first bucket plan, from the model itself (replicas have the same names, shapes and dtypes).

    :raises ~gsync.ConfigError: when nothing requires grad, or a parameter is not materialized yet (a lazy module).
    """
    return BucketPlan.build(
        named_params,  # type: ignore[arg-type]
        first_bucket_bytes=int(settings.first_bucket_mb * 2**20),
        bucket_cap_bytes=int(settings.bucket_cap_mb * 2**20),
    )


def assemble(
    settings: EngineSettings,
    recipe: Recipe,
    plan: BucketPlan,
    replicas: Sequence[Replica],
    runtime: ProcessGroupRuntime | None,
    abort: threading.Event,
    loop: LoopHandle,
    process_local_data: bool,
    trace: Trace | None,
) -> Assembly:
    """Every part of a session, wired together: actors, sync server, collective, streams, mailboxes; recording
    into the session's ``trace`` (one across an elastic run's generations)."""
    topology = runtime.topology if runtime is not None else Topology(local_devices=len(settings.devices))
    streams = make_stream_sync([spec.torch_device for spec in settings.devices], len(plan.buckets))
    collective = _collective(settings, runtime, topology, streams, abort)
    buffers = BufferSync([replica.module for replica in replicas])
    server_mailbox: Mailbox[ServerMessage] = Mailbox("sync server", loop)
    session_mailbox: Mailbox[SessionMessage] = Mailbox("session", loop)
    batch_stats = _batch_stats(settings, replicas, runtime, abort, _first_step_in_turn(settings, len(replicas)))
    sharding = _sharding(settings, recipe, plan, topology)
    context = _context(
        settings, recipe, plan, len(replicas), collective, streams, trace, server_mailbox, session_mailbox, loop, abort,
        batch_stats, sharding,
    )
    actors = _actors(settings, replicas, context, streams, loop)
    first = actors[0]
    rebuild = PlanRebuild(context, lambda: first.capture.readiness.order, runtime.agree_order if runtime is not None else None)
    agreement: StepAgreement = (
        ProcessGroupAgreement(runtime, len(plan.names), process_local_data) if runtime is not None else LocalAgreement()
    )
    server = SyncServer(
        mailbox=server_mailbox,
        context=context,
        devices=actors,
        buffers=buffers,
        collective=collective,
        agreement=agreement,
        # Sharded, the shards and the optimizers' slices are cut from the first plan, which stays.
        rebuild=rebuild if sharding is None else None,
    )
    if sharding is not None:
        _shard_optimizers(sharding, actors, topology, plan)
        sharding.bind(
            comm=server.comm,
            collective=collective,
            exact=collective.inner if isinstance(collective, CompressedCollective) else collective,
            streams=streams,
            session=session_mailbox,
            abort=abort,
            fingerprint=context.fingerprints.record if context.fingerprints is not None else None,
            check_every=settings.check_replicas_every,
            trace=trace,
        )
    return Assembly(
        topology, context, actors, server, collective, streams, buffers, rebuild,
        server_mailbox, session_mailbox, trace, sharding,
    )


def _collective(
    settings: EngineSettings,
    runtime: ProcessGroupRuntime | None,
    topology: Topology,
    streams: StreamSync,
    abort: threading.Event,
) -> Collective:
    """The transport for this session's devices and processes, compressed when the engine compresses."""
    collective: Collective
    if runtime is not None:
        collective = ProcessGroupCollective(runtime.membership.group, topology, abort)
    elif isinstance(streams, CudaStreamSync):
        # Single-process multi-GPU: NCCL on the communication streams.
        collective = NcclCollective([spec.torch_device for spec in settings.devices], streams)
    else:
        collective = LocalCollective(len(settings.devices))
    if settings.compression is not None:
        # Every transport compresses through the same wrapper, so the arithmetic does not depend on the topology.
        collective = CompressedCollective(collective, settings.compression)
    return collective


def _sharding(settings: EngineSettings, recipe: Recipe, plan: BucketPlan, topology: Topology) -> ShardedStep | None:
    """``shard_optimizer=True`` on more than one device in the run (on one, a shard is everything)."""
    if not settings.shard_optimizer or topology.world_devices == 1:
        return None
    sharding = ShardedStep(topology.local_devices, topology.world_devices, topology.device_offset, plan, settings.sync_timeout)
    sharding.clips_or_scales = recipe.clip_grad_norm is not None or recipe.scales_loss
    return sharding


def _shard_optimizers(sharding: ShardedStep, actors: Sequence[DeviceActor], topology: Topology, plan: BucketPlan) -> None:
    """Each device's optimizer made to step its slices only (its state, if resumed, cut to them)."""
    for actor in actors:
        capture = actor.capture
        shard = ReplicaShard(
            actor.index, topology.device_offset + actor.index, topology.world_devices, plan, capture.params,
            lambda capture=capture: capture.grads,  # type: ignore[misc]
        )
        sharding.shards.append(shard)
    for shard, actor in zip(sharding.shards, actors):
        shard.take_optimizer(actor.optimizer, lambda: sharding.shards, lambda: sharding.across)
        actor.update.shard = shard


def _first_step_in_turn(settings: EngineSettings, num_replicas: int) -> bool:
    # CPU kernels only: on GPUs the devices' first steps stay concurrent. On one shared thread the devices take
    # turns anyway.
    return (
        num_replicas > 1
        and settings.device_threads == "per_device"
        and all(spec.torch_device.type == "cpu" for spec in settings.devices)
    )


def _batch_stats(
    settings: EngineSettings,
    replicas: Sequence[Replica],
    runtime: ProcessGroupRuntime | None,
    abort: threading.Event,
    in_turn: bool,
) -> BatchStatsExchange | None:
    """Where the replicas' ``nn.SyncBatchNorm`` layers sum their statistics, each layer given gsync's forward."""
    if not replicas or not has_sync_batchnorm(replicas[0].module):
        return None
    exchange = BatchStatsExchange(
        [spec.name for spec in settings.devices],
        abort,
        settings.sync_timeout * settings.devices_in_turn,
        sync_batchnorm_width(replicas[0].module),
        runtime.membership if runtime is not None else None,
        settings.sync_timeout * settings.devices_in_turn + GROUP_TIMEOUT_MARGIN_S,
        first_step_in_turn=in_turn,
    )
    for index, replica in enumerate(replicas):
        adopt_sync_batchnorm(replica.module, index, exchange)
    return exchange


def session_trace(settings: EngineSettings) -> Trace | None:
    """The trace a session records into: the engine's own ``Trace``, or (``True`` or a file path) a fresh one."""
    return settings.trace if isinstance(settings.trace, Trace) else Trace() if settings.trace is not False else None


def _context(
    settings: EngineSettings,
    recipe: Recipe,
    plan: BucketPlan,
    num_replicas: int,
    collective: Collective,
    streams: StreamSync,
    trace: Trace | None,
    server_mailbox: Mailbox[ServerMessage],
    session_mailbox: Mailbox[SessionMessage],
    loop: LoopHandle,
    abort: threading.Event,
    batch_stats: BatchStatsExchange | None = None,
    sharding: ShardedStep | None = None,
) -> ActorContext:
    """What the actors of the session share, and where its gradients live."""
    # One device in the whole run and no compression: a reduction is the identity. In one process on CPU the
    # reduction takes the gradients where autograd put them, so none is copied into a bucket first.
    alone = collective.world_devices == 1 and settings.compression is None
    grads_in_place = alone or (settings.compression is None and IN_PLACE in collective.capabilities and sharding is None)
    device_names = [spec.name for spec in settings.devices]
    return ActorContext(
        plan=plan,
        recipe=recipe,
        # CPU devices' posts after backward can wait for their job's end; an accelerator's cannot (see ServerInbox).
        server=ServerInbox(
            server_mailbox, len(plan.names), [spec.torch_device.type != "cpu" for spec in settings.devices]
        ),
        session=session_mailbox,
        loop=loop,
        abort=abort,
        sync_timeout=settings.sync_timeout,
        on_nonfinite=settings.on_nonfinite,
        check_replicas_every=settings.check_replicas_every,
        fingerprints=ReplicaFingerprints(device_names) if settings.check_replicas_every else None,
        trace=trace,
        site_hooks=settings.site_hooks,
        first_bucket_bytes=int(settings.first_bucket_mb * 2**20),
        bucket_cap_bytes=int(settings.bucket_cap_mb * 2**20),
        streams=streams,
        grads_in_place=grads_in_place,
        alone=alone,
        shared_thread=settings.device_threads == "shared",
        intra_op_threads=settings.intra_op_threads,
        batch_stats=batch_stats,
        sharding=sharding,
        # With SyncBatchNorm the devices take their forward and backward turns inside the job (batchnorm.py), and
        # their optimizer steps in turn here.
        first_step=FirstStepInTurn(num_replicas) if _first_step_in_turn(settings, num_replicas) else None,
    )


def _actors(
    settings: EngineSettings, replicas: Sequence[Replica], context: ActorContext, streams: StreamSync, loop: LoopHandle
) -> list[DeviceActor]:
    """One actor per local device, each with its replica, optimizer, scheduler and scaler."""
    # Started by its first job, like every worker thread; the teardown joins it once.
    # Its jobs are the devices' shares of one step (or evaluation), which the step waits for anyway: a report held
    # until the others' jobs end delays nothing (see WorkerThread).
    shared = WorkerThread("gsync-devices", loop, hold_reports=True) if settings.device_threads == "shared" else None
    actors = []
    for index, (spec, replica) in enumerate(zip(settings.devices, replicas)):
        # Bucket buffers are allocated on the compute stream that uses them.
        with streams.compute_stream(index):
            actors.append(
                DeviceActor(
                    index=index,
                    spec=spec,
                    replica=replica.module,
                    optimizer=replica.optimizer,
                    context=context,
                    scheduler=replica.scheduler,
                    scaler=replica.scaler,
                    worker=shared,
                )
            )
    return actors
