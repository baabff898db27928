"""What the peer link tells the heartbeat of where this rank is, with a fake session view.

Peers name a rank that stopped or is stuck by what its heartbeat last said, so each of the session's situations
must read as what it is: waiting in a collective, a victim of a failure, starting, outside gsync between calls,
or inside a call at its furthest-behind device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gsync._core.distributed.heartbeat import DevicePosition, Whereabouts
from gsync._core.session.peers import PeerLink
from gsync._core.session.state import SessionState
from gsync._core.threads import LoopEvent, LoopHandle


@dataclass
class Device:
    step: int
    site: str
    waiting: bool = False
    name: str = "cpu:0"


@dataclass
class View:
    """A session as the link reads it (``SessionView``)."""

    next_step: int = 3
    state: SessionState = SessionState.IDLE
    opened: bool = True
    failure: BaseException | None = None
    operations_done: int = 3
    change_agreed: bool = False
    start_step: int = 0
    call: LoopEvent | None = None
    positions: list[Device] = field(default_factory=list)

    def call_over(self) -> LoopEvent | None:
        return self.call

    def devices(self) -> Sequence[DevicePosition]:
        return self.positions


def link(view: View) -> PeerLink:
    return PeerLink(view, threading.Event())


def test_between_calls_a_rank_is_outside_gsync_at_its_last_step() -> None:
    assert link(View()).whereabouts() == Whereabouts(2, "outside gsync")


def test_a_rank_still_starting_says_so() -> None:
    assert link(View(next_step=0, opened=False, state=SessionState.OPENING)).whereabouts() == Whereabouts(
        -1, "starting the session"
    )


def test_a_rank_failing_is_a_victim_not_the_one_others_wait_for() -> None:
    where = link(View(state=SessionState.FAILING)).whereabouts()
    assert (where.phase, where.waiting) == ("ending after a failure", True)


def test_a_rank_waiting_in_a_collective_says_which_even_once_it_failed() -> None:
    peers = link(View(state=SessionState.FAILED))
    peers.waiting("checkpoint")
    assert peers.whereabouts() == Whereabouts(2, "checkpoint", waiting=True)
    peers.waiting(None)
    assert peers.whereabouts().phase == "ending after a failure"


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_inside_a_call_a_rank_is_where_its_furthest_behind_device_is() -> None:
    view = View(state=SessionState.OPERATING, call=LoopHandle().event())
    view.positions = [Device(3, "optimizer", name="cpu:0"), Device(3, "backward", name="cpu:1")]
    assert link(view).whereabouts() == Whereabouts(3, "backward", "cpu:1")
    view.positions = [Device(3, "optimizer", waiting=True), Device(3, "backward", waiting=True, name="cpu:1")]
    assert link(view).whereabouts() == Whereabouts(3, "gradient sync", waiting=True)


def test_a_step_applied_in_one_process_tells_no_heartbeat() -> None:
    link(View()).stepped()  # no process group, no heartbeat: nothing to nudge, nothing raised
