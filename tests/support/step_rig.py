"""Rigs that run the sync server or one device actor alone, the test playing the part of its peers.

Each rig builds one actor with real collaborators (mailboxes, bucket plan, LocalCollective, HostStreamSync, worker
threads); the test posts and reads messages, keeping to the protocol the peers keep: whoever fills a bucket calls
``streams.mark_ready`` before posting ``BucketReady``, whoever reduces it calls ``before_reduce``/``after_reduce``,
and a device calls ``before_apply`` after ``StepSynced``. "The server handled everything posted so far" is
observed through :class:`WatchedMailbox`, never with a sleep.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import torch
import torch.nn.functional as F
from torch import nn

import gsync
from gsync._core.threads import LoopHandle
from gsync._core.step.actor import DeviceActor
from gsync._core.base.agreement import LocalAgreement
from gsync._core.gradients.buckets import BucketPlan
from gsync._core.gradients.buffers import BufferSync
from gsync.comm.local import LocalCollective
from gsync._core.step.context import ActorContext, Recipe, Shard
from gsync._core.devices import parse_devices
from gsync._core.step.inbox import ServerInbox
from gsync._core.step.mailbox import Mailbox
from gsync._core.step.messages import (
    BucketReady,
    DeviceMessage,
    ForwardDone,
    ServerMessage,
    SessionMessage,
    StepDispatched,
    StepSynced,
)
from gsync._core.step.server import SyncServer
from gsync._core.streams import HostStreamSync, make_stream_sync

M = TypeVar("M")

# Generous bound on any single wait: a hang fails fast instead of at pytest's 60 s timeout.
WAIT_S = 5.0


class WatchedMailbox(Mailbox[M]):
    """A mailbox that can tell when its reader has handled everything posted so far.

    The reader calls ``receive`` again only once it is done with the previous
    message, so "blocked in ``receive`` with nothing left to take" means every
    message posted so far has been fully handled.
    """

    def __init__(self, owner: str, loop: LoopHandle) -> None:
        super().__init__(owner, loop)
        self.posted = 0
        self.taken = 0
        self._waiting = False
        self._idle = anyio.Event()

    def post(self, message: M) -> None:
        super().post(message)
        self.posted += 1

    async def receive(self) -> M:
        self._waiting = True
        if self.taken == self.posted:
            self._idle.set()
        try:
            message = await super().receive()
        finally:
            self._waiting = False
        self.taken += 1
        return message

    async def settled(self) -> None:
        """Wait until the reader has handled every message posted so far and waits for the next."""
        with anyio.fail_after(WAIT_S):
            while not (self._waiting and self.taken == self.posted):
                self._idle = anyio.Event()
                await self._idle.wait()


def _dummy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("the sync server never runs the loss")


def _sgd(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr)


def server_plan() -> BucketPlan:
    """Four 2-float parameters in three buckets: [p3], [p2, p1], [p0] (reverse registration order, 8 B then 16 B)."""
    named = [(f"p{i}", torch.zeros(2)) for i in range(4)]
    plan = BucketPlan.build(named, first_bucket_bytes=8, bucket_cap_bytes=16)
    assert [b.params for b in plan.buckets] == [(3,), (2, 1), (0,)]
    return plan


class FakeDevice:
    """A :class:`~gsync._core.step.context.DeviceEndpoint` whose bucket buffers the test owns.

    The server asks for a bucket's buffers (or, with ``grads_in_place``, for
    its gradients: here views into those buffers) exactly when it launches
    that bucket's reduction, so ``launched`` records the launches, in order,
    as they happen on the loop.
    """

    def __init__(self, index: int, plan: BucketPlan, loop: LoopHandle) -> None:
        self.index = index
        self.plan = plan
        self.name = f"fake:{index}"
        self.queued = False
        self.mailbox: Mailbox[DeviceMessage] = Mailbox(f"device {self.name}", loop)
        self.buffers = [torch.zeros(bucket.numel) for bucket in plan.buckets]
        self.launched: list[int] = []

    def bucket_buffer(self, bucket: int) -> torch.Tensor:
        self.launched.append(bucket)
        return self.buffers[bucket]

    def bucket_grads(self, bucket: int) -> list[torch.Tensor]:
        buffer, spec = self.bucket_buffer(bucket), self.plan.buckets[bucket]
        return [buffer[offset : offset + self.plan.shapes[p].numel()] for p, offset in zip(spec.params, spec.offsets)]

    def where(self) -> str:
        return f"fake {self.index}, backward"


@dataclass
class ServerRig:
    server: SyncServer
    mailbox: WatchedMailbox[ServerMessage]
    devices: list[FakeDevice]
    context: ActorContext
    trace: gsync.Trace

    @property
    def streams(self) -> HostStreamSync:
        streams = self.context.streams
        assert isinstance(streams, HostStreamSync)
        return streams

    def fill(self, step: int) -> None:
        """Write step ``step``'s gradients into every device's buckets (as backward would)."""
        for device in self.devices:
            for bucket, buffer in enumerate(device.buffers):
                buffer.copy_(torch.arange(buffer.numel(), dtype=buffer.dtype) + 1000 * step + 100 * device.index + 10 * bucket)

    def start_step_with_every_loss(self) -> None:
        """Step 0 dispatched with its gradients written and every device's loss in: only readiness is left."""
        self.fill(0)
        self.mailbox.post(StepDispatched(0, (0.5, 0.5), 8))
        for device in range(len(self.devices)):
            self.mailbox.post(ForwardDone(device, 0, 0.5))

    def ready(self, device: int, bucket: int, step: int = 0, unused: tuple[int, ...] = ()) -> None:
        """What a device's gradient hook does: mark the bucket ready, then post ``BucketReady``."""
        self.streams.mark_ready(device, bucket)
        self.mailbox.post(BucketReady(device, step, bucket, unused))

    async def synced(self, device: int) -> StepSynced:
        """What a device does on ``StepSynced``: receive it, then ``before_apply``."""
        with anyio.fail_after(WAIT_S):
            message = await self.devices[device].mailbox.receive()
        assert isinstance(message, StepSynced), message
        self.streams.before_apply(device)
        return message

    def launches(self) -> list[int]:
        assert self.devices[0].launched == self.devices[1].launched
        return list(self.devices[0].launched)


@asynccontextmanager
async def server_rig(
    sync_timeout: float = WAIT_S, site_hooks: tuple[Any, ...] = (), grads_in_place: bool = False
) -> AsyncIterator[ServerRig]:
    loop = LoopHandle()
    plan = server_plan()
    trace = gsync.Trace()
    mailbox: WatchedMailbox[ServerMessage] = WatchedMailbox("sync server", loop)
    session: Mailbox[SessionMessage] = Mailbox("session", loop)
    context = ActorContext(
        plan=plan,
        recipe=Recipe(loss_fn=_dummy_loss, optimizer=_sgd(0.1)),
        server=ServerInbox(mailbox, len(plan.names), [False, False]),
        session=session,
        loop=loop,
        abort=threading.Event(),
        sync_timeout=sync_timeout,
        trace=trace,
        site_hooks=site_hooks,
        streams=make_stream_sync([torch.device("cpu")] * 2, len(plan.buckets)),
        grads_in_place=grads_in_place,
    )
    devices = [FakeDevice(i, plan, loop) for i in range(2)]
    buffers = BufferSync([nn.Linear(1, 1), nn.Linear(1, 1)])
    assert buffers.empty
    server = SyncServer(
        mailbox=mailbox,
        context=context,
        devices=devices,
        buffers=buffers,
        collective=LocalCollective(2),
        agreement=LocalAgreement(),
    )
    try:
        yield ServerRig(server, mailbox, devices, context, trace)
    finally:
        server.close()
        joined = await server.comm.join(1.0)
        for box in (mailbox, session, *(device.mailbox for device in devices)):
            box.discard()
        assert joined, "the gsync-comm thread did not exit"


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def make_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, generator=generator), torch.randn(rows, 2, generator=generator)


def reference_step(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor] = mse) -> tuple[float, list[torch.Tensor]]:
    """One plain forward and backward on a copy of ``model``: the loss and every parameter's gradient."""
    model = copy.deepcopy(model)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.item(), [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


@dataclass
class ActorRig:
    actor: DeviceActor
    context: ActorContext
    initial: nn.Module
    """A copy of the model as it was before the actor touched it."""
    lr: float

    @property
    def server(self) -> Mailbox[ServerMessage]:
        return self.context.server.mailbox

    @property
    def shards(self) -> Mailbox[Shard]:
        return self.actor.shards

    @property
    def session(self) -> Mailbox[SessionMessage]:
        return self.context.session

    async def next_server_message(self) -> ServerMessage:
        with anyio.fail_after(WAIT_S):
            return await self.server.receive()

    def reduce(self, buckets: Sequence[int]) -> None:
        """What the server's communication thread does around each reduction (this test reduces nothing)."""
        for bucket in buckets:
            self.context.streams.before_reduce(bucket)
            self.context.streams.after_reduce(bucket)

    async def remaining_server_messages(self) -> list[ServerMessage]:
        """Everything still queued for the server (call once the actor is done)."""
        self.server.close()
        left: list[ServerMessage] = []
        while True:
            try:
                left.append(await self.server.receive())
            except gsync.MailboxClosed:
                return left


@asynccontextmanager
async def actor_rig(loss_fn: Callable[[nn.Module, Any], torch.Tensor] = mse, lr: float = 0.1) -> AsyncIterator[ActorRig]:
    loop = LoopHandle()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    initial = copy.deepcopy(model)
    # bias (8 B) fills the first 8 B bucket; weight (24 B) gets the second.
    plan = BucketPlan.build(list(model.named_parameters()), first_bucket_bytes=8, bucket_cap_bytes=24)
    assert [b.params for b in plan.buckets] == [(1,), (0,)]
    recipe = Recipe(loss_fn=loss_fn, optimizer=_sgd(lr))
    context = ActorContext(
        plan=plan,
        recipe=recipe,
        server=ServerInbox(Mailbox("sync server", loop), len(plan.names), [False]),
        session=Mailbox("session", loop),
        loop=loop,
        abort=threading.Event(),
        sync_timeout=WAIT_S,
        streams=make_stream_sync([torch.device("cpu")], len(plan.buckets)),
    )
    actor = DeviceActor(
        index=0,
        spec=parse_devices(["cpu:0"])[0],
        replica=model,
        optimizer=recipe.optimizer([p for p in model.parameters() if p.requires_grad]),
        context=context,
    )
    try:
        yield ActorRig(actor, context, initial, lr)
    finally:
        actor.close()
        joined = await actor.worker.join(1.0)
        for box in (context.server.mailbox, context.session, actor.mailbox, actor.shards):
            box.discard()
        assert joined, "the actor's worker thread did not exit"
