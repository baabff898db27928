"""The one place behaviour and multi-process tests look inside gsync: a live session's or engine's private parts,
and the internal functions a test swaps to watch or break a run.

A test that must see what no public API shows (a device's replica, the sync server's mailbox, the lifecycle
state) calls a function here, named for what it reads or does, instead of reaching for ``session._core...``
itself. When gsync's private parts are restructured, this file is the one to change: the tests keep their
meaning. Keep each function to one reach, and say in its docstring what it stands for in the design, so the
next shape can provide the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    import anyio

    import gsync
    import gsync.testing

__all__ = (
    "MembershipStage",
    "ServerPost",
    "actors_of",
    "claim",
    "core_of",
    "count_whole_bucket_takes",
    "device_flags",
    "end_generation_for_change",
    "end_generation_for_loss",
    "ended_event",
    "heartbeat_whereabouts",
    "is_changing",
    "is_closed",
    "is_operating",
    "is_usable",
    "membership_stage",
    "never_take_a_bucket_whole",
    "post_a_message_the_server_cannot_take",
    "pretend_torch_threads_split_per_thread",
    "replace_initial_broadcast",
    "replace_process_group_dist",
    "replicas_of",
    "scalers_of",
    "server_of",
    "settle_a_loss",
    "settle_a_loss_and_end_the_generation",
    "site_hooks_of",
    "step_the_generation",
    "take_the_scatter_path",
    "watch_mailboxes",
    "wrap_sharded_gather",
)


# -- a live session -----------------------------------------------------------------


def core_of(session: gsync.Session) -> Any:
    """The session's core: its state and its current generation's parts, for its whole life."""
    return session._core


def actors_of(session: gsync.Session) -> list[Any]:
    """This process's device actors, one per local device, in device order."""
    return list(core_of(session)._actors)


def replicas_of(session: gsync.Session) -> list[torch.nn.Module]:
    """Each local device's model replica (the live one, not a copy), in device order."""
    return [actor.replica for actor in actors_of(session)]


def scalers_of(session: gsync.Session) -> list[Any]:
    """Each local device's grad scaler (``None`` without fp16 autocast), in device order."""
    return [actor.scaler for actor in actors_of(session)]


def device_flags(session: gsync.Session) -> dict[str, tuple[bool, bool]]:
    """Each device's ``(queued, waiting)``: queued behind another on a shared thread; waiting for the sync."""
    return {actor.name: (actor.queued, actor.waiting) for actor in actors_of(session)}


def heartbeat_whereabouts(session: gsync.Session) -> Any:
    """Where this rank is, as its heartbeat thread would report it now."""
    return core_of(session)._peers.whereabouts()


def ended_event(session: gsync.Session) -> anyio.Event:
    """Set once the session has ended everything it started (its task, its threads). Held on its own, it does not
    keep the session alive, so a test may drop the session and wait on it."""
    return session._service.done


def is_operating(session: gsync.Session) -> bool:
    """A call (step, evaluate, all_reduce) runs on the session now."""
    from gsync._core.session.state import SessionState

    return core_of(session).state is SessionState.OPERATING


def is_changing(session: gsync.Session) -> bool:
    """The generation ended for a membership change, and the next one is not open."""
    from gsync._core.session.state import SessionState

    return core_of(session).state is SessionState.CHANGING


def is_closed(session: gsync.Session) -> bool:
    """Everything the session started has stopped (its lifecycle's last state, not ``Session.closed``)."""
    from gsync._core.session.state import SessionState

    return core_of(session).state is SessionState.CLOSED


def is_usable(session: gsync.Session) -> bool:
    """Open and not failed: an operation may start on the current generation."""
    return bool(core_of(session).usable)


def end_generation_for_change(session: gsync.Session) -> None:
    """What an elastic run's service does between calls once every rank agreed to change the membership."""
    core_of(session).end_for_change()


def settle_a_loss(session: gsync.Session, loss: BaseException) -> None:
    """A member's loss settled on the current generation, as its failure (the generation fails closed)."""
    core_of(session).life.fail(loss)


def end_generation_for_loss(session: gsync.Session) -> None:
    """What an elastic run's service does once a generation ended because a member was lost: the run goes on with
    the others (a change already planned stays the planned one)."""
    core_of(session).lost_generation()


def settle_a_loss_and_end_the_generation(session: gsync.Session, loss: BaseException) -> None:
    """What an elastic run's service does when a member is lost while no call runs: the loss is settled on the
    generation, which then ends for the change."""
    settle_a_loss(session, loss)
    end_generation_for_loss(session)


@dataclass(frozen=True)
class MembershipStage:
    """Where an elastic run's membership change stands, as the session core reports it."""

    change: Any
    """The stage (``gsync._core.session.state.Change``), ``None`` when no change is due or under way."""
    changing: bool
    """Between two generations: the last one ended for a change, the next one is not open."""
    state: Any
    """The lifecycle state the core reports (``SessionState``)."""
    agreed: bool
    """Every rank agreed on the change (a knock or a departure), so the ending generation tells of no departure."""
    due: bool
    """Agreed after the last step, and not made yet: the next call makes it."""


def membership_stage(session: gsync.Session) -> MembershipStage:
    core = core_of(session)
    return MembershipStage(core.change, bool(core.changing), core.state, bool(core.change_agreed), bool(core.change_due))


async def step_the_generation(session: gsync.Session, batches: list[Any]) -> Any:
    """A step on the session's current generation directly, as the service would run it (not the last of a fit)."""
    return await core_of(session).step(batches, last=False)


class ServerPost:
    """Messages a test posts to a live session's sync server, as the devices and timers post them."""

    def __init__(self, session: gsync.Session) -> None:
        self._mailbox = core_of(session)._parts.server_mailbox

    def deadline(self, step: int) -> None:
        """A step's deadline timer firing, from the event loop."""
        from gsync._core.step.messages import StepDeadline

        self._mailbox.post(StepDeadline(step))

    def deadline_from_a_thread(self, step: int) -> None:
        """A step's deadline timer firing, from a thread other than the loop's (a device's)."""
        from gsync._core.step.messages import StepDeadline

        self._mailbox.post_threadsafe(StepDeadline(step))

    def bucket_outside_any_step(self) -> None:
        """A bucket that is ready outside any step: a protocol error the server fails on."""
        from gsync._core.step.messages import BucketReady

        self._mailbox.post(BucketReady(device=0, step=99, bucket=0, unused=()))


def server_of(session: gsync.Session) -> ServerPost:
    """What a test may post to the session's sync server (read once: the server of the generation open now)."""
    return ServerPost(session)


def post_a_message_the_server_cannot_take(session: gsync.Session) -> None:
    """Make the real sync server fail while no call runs: a bucket that is ready outside any step."""
    server_of(session).bucket_outside_any_step()


# -- an engine, a fault ----------------------------------------------------------------


def site_hooks_of(engine: gsync.Engine) -> list[Callable[[int, int, str, Any], None]]:
    """The engine's list of site hooks (what ``gsync.testing.inject`` arms): each is called as
    ``hook(device, step, site, abort)`` at every site a device reaches; a test may append its own."""
    return engine._site_hooks  # type: ignore[no-any-return]


def claim(fault: gsync.testing.Fault, device: int, step: int, site: str) -> bool:
    """Whether this reach of ``(device, step, site)`` is the one that fires ``fault`` (at most one ever is)."""
    return fault._claim(device, step, site)


# -- internal functions swapped for a test ------------------------------------------------


def count_whole_bucket_takes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Note, for every last bucket (the one no hook takes), whether it was taken whole; the list fills as runs go."""
    from gsync._core.step.capture import GradientCapture

    whole = GradientCapture._take_whole_bucket
    taken: list[bool] = []

    def counted(capture: GradientCapture) -> bool:
        taken.append(whole(capture))
        return taken[-1]

    monkeypatch.setattr(GradientCapture, "_take_whole_bucket", counted)
    return taken


def never_take_a_bucket_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the last bucket parameter by parameter always: the path taking it whole stands in for."""
    from gsync._core.step.capture import GradientCapture

    monkeypatch.setattr(GradientCapture, "_take_whole_bucket", lambda capture: False)


def pretend_torch_threads_split_per_thread(monkeypatch: pytest.MonkeyPatch, split: bool) -> None:
    """As if this torch build could (OpenMP) or could not (its native backend) give each thread its own count of
    intra-op threads: what decides whether CPU devices get a thread each."""
    import gsync._core.devices

    monkeypatch.setattr(gsync._core.devices, "THREADS_PER_THREAD", split)


def watch_mailboxes(
    monkeypatch: pytest.MonkeyPatch,
    *,
    post: Callable[[str, object], None] | None = None,
    post_threadsafe: Callable[[str, object, bool], None] | None = None,
    wake: Callable[[str], None] | None = None,
) -> None:
    """Call ``post(owner, message)``, ``post_threadsafe(owner, message, wake)`` or ``wake(owner)`` before every
    mailbox's own (``owner`` names the mailbox's reader: ``"sync server"``, ``"shards of cpu:0"``, ...)."""
    from gsync._core.step.mailbox import Mailbox

    if post is not None:
        original_post = Mailbox.post

        def noted_post(self: Mailbox[object], message: object) -> None:
            post(self.owner, message)
            original_post(self, message)

        monkeypatch.setattr(Mailbox, "post", noted_post)
    if post_threadsafe is not None:
        original_threadsafe = Mailbox.post_threadsafe

        def noted_threadsafe(self: Mailbox[object], message: object, wake: bool = True) -> None:
            post_threadsafe(self.owner, message, wake)
            original_threadsafe(self, message, wake)

        monkeypatch.setattr(Mailbox, "post_threadsafe", noted_threadsafe)
    if wake is not None:
        original_wake = Mailbox.wake

        def noted_wake(self: Mailbox[object]) -> None:
            wake(self.owner)
            original_wake(self)

        monkeypatch.setattr(Mailbox, "wake", noted_wake)


def take_the_scatter_path(collective: Any, by_all_reduce: bool) -> None:
    """Make a process-group collective reduce-scatter by its all-reduce (gloo's path) or by the backend's own
    reduce-scatter (the other backends'), whatever its backend is."""
    collective._scatter_by_all_reduce = by_all_reduce


@contextmanager
def replace_process_group_dist(replacement: Any) -> Iterator[None]:
    """``torch.distributed`` as the process-group collective calls it, replaced for the block."""
    from gsync._core.transports import process_group

    real = process_group.dist
    process_group.dist = replacement
    try:
        yield
    finally:
        process_group.dist = real


def wrap_sharded_gather(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """For the rest of this process, a sharded session's checkpoint gathers its whole state through
    ``wrap(the real gather)`` (meant for a rank process of its own)."""
    from gsync._core.session import core

    core.gather_whole_state = wrap(core.gather_whole_state)


def replace_initial_broadcast(replacement: Callable[..., Any]) -> None:
    """For the rest of this process, the collective that sends rank 0's initial parameters to every rank as a
    session opens is ``replacement`` (meant for a rank process of its own)."""
    import gsync._core.distributed.runtime as runtime

    runtime.broadcast_module_state = replacement
