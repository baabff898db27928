"""The session core's lifecycle: every transition it allows is made, every other one is refused, from each state.

The transitions are stated here, each with what in the design makes it, and not read from ``ALLOWED``: a table
generated from the code would pass whatever the code says, so an entry added to or dropped from the table must
fail a test here, and whoever changes the table changes this list and its reasons with it.
"""

from __future__ import annotations

import itertools

import pytest

from gsync._core.session.state import ALLOWED, Lifecycle, LifecycleError, SessionState

S = SessionState

DESIGN: dict[tuple[SessionState, SessionState], str] = {
    (S.OPENING, S.IDLE): "the start finished (joined, replicas taken or copied, workers built)",
    (S.OPENING, S.CLOSING): "its end was asked for while it started (aclose, a drop, engine.aclose, a failed start)",
    (S.IDLE, S.OPERATING): "a call (step, evaluate, all_reduce) starts",
    (S.IDLE, S.FAILING): "a device, the sync server or a peer failed between calls",
    (S.IDLE, S.CHANGING): "every rank agreed to change an elastic run's membership: made between calls",
    (S.IDLE, S.CLOSING): "aclose, a drop, or a departure between calls",
    (S.OPERATING, S.IDLE): "the call returned or raised",
    (S.OPERATING, S.FAILING): "the session failed during a call",
    (S.OPERATING, S.CLOSING): "closed from another task, or a call cancelled midway",
    (S.FAILING, S.FAILED): "the failure was settled (threads stopped, picked, reported, checkpointed)",
    (S.FAILING, S.CLOSED): "a cancellation cut the settling short: teardown still runs",
    (S.FAILED, S.CLOSED): "the settled session was torn down",
    (S.CHANGING, S.FAILING): "a device failed while the ended generation wound down",
    (S.CHANGING, S.CLOSED): "the ended generation was torn down; its replicas go on in the next",
    (S.CLOSING, S.FAILING): "a device failed while a close wound it down: settled as any failure is",
    (S.CLOSING, S.CLOSED): "everything it started has stopped",
}
"""Each transition the lifecycle must allow, and what makes it. Nothing leaves ``CLOSED``."""

ALLOWED_PAIRS = sorted(DESIGN, key=lambda pair: (list(S).index(pair[0]), list(S).index(pair[1])))
REFUSED_PAIRS = [pair for pair in itertools.product(S, S) if pair not in DESIGN]


def reach(state: SessionState) -> Lifecycle:
    """A lifecycle brought to ``state`` by allowed transitions only (the shortest way from OPENING)."""
    paths = {
        S.OPENING: [],
        S.IDLE: [S.IDLE],
        S.OPERATING: [S.IDLE, S.OPERATING],
        S.FAILING: [S.IDLE, S.FAILING],
        S.FAILED: [S.IDLE, S.FAILING, S.FAILED],
        S.CHANGING: [S.IDLE, S.CHANGING],
        S.CLOSING: [S.IDLE, S.CLOSING],
        S.CLOSED: [S.IDLE, S.CLOSING, S.CLOSED],
    }
    life = Lifecycle()
    for step in paths[state]:
        life.move(step)
    assert life.state is state
    return life


def test_the_table_allows_exactly_the_transitions_the_design_needs() -> None:
    assert set(ALLOWED) == set(S)
    table = {(start, end) for start, ends in ALLOWED.items() for end in ends}
    assert sorted(((a.name, b.name) for a, b in table - set(DESIGN))) == [], "allowed, though the design needs none"
    assert sorted(((a.name, b.name) for a, b in set(DESIGN) - table)) == [], "needed by the design, and refused"


@pytest.mark.parametrize(("start", "end"), ALLOWED_PAIRS, ids=lambda s: s.name)
def test_an_allowed_transition_is_made(start: SessionState, end: SessionState) -> None:
    life = reach(start)
    life.move(end)
    assert life.state is end


@pytest.mark.parametrize(("start", "end"), REFUSED_PAIRS, ids=lambda s: s.name)
def test_a_transition_the_lifecycle_does_not_allow_is_refused_and_changes_nothing(start: SessionState, end: SessionState) -> None:
    life = reach(start)
    with pytest.raises(LifecycleError, match=f"from {start.value} to {end.value}"):
        life.move(end)
    assert life.state is start


def test_closed_is_final_and_every_other_state_has_a_way_on() -> None:
    assert {start for start, _ in DESIGN} == set(S) - {S.CLOSED}
    assert len(REFUSED_PAIRS) == len(S) ** 2 - len(DESIGN)  # the refused cases cover every other pair


@pytest.mark.parametrize("state", [S.OPENING, S.IDLE, S.OPERATING])
def test_asking_for_the_end_of_a_serving_session_makes_it_closing(state: SessionState) -> None:
    life = reach(state)
    life.end_asked()
    assert life.state is S.CLOSING


@pytest.mark.parametrize("state", [S.FAILING, S.FAILED, S.CHANGING, S.CLOSING, S.CLOSED])
def test_asking_for_the_end_of_a_failing_or_ending_session_changes_nothing(state: SessionState) -> None:
    life = reach(state)
    life.end_asked()
    assert life.state is state


@pytest.mark.parametrize(("state", "after"), [(S.OPERATING, S.IDLE), (S.FAILING, S.FAILING), (S.CLOSING, S.CLOSING)])
def test_an_operation_ending_goes_back_to_idle_only_if_nothing_else_happened(state: SessionState, after: SessionState) -> None:
    life = reach(state)
    life.operation_over()
    assert life.state is after


def test_opened_says_whether_the_start_finished() -> None:
    life = Lifecycle()
    assert not life.opened
    life.move(S.CLOSING)  # closed while it started
    assert not life.opened
    life = reach(S.CLOSED)
    assert life.opened
