"""The session core's lifecycle: every transition it allows is made, every other one is refused, from each state."""

from __future__ import annotations

import itertools

import pytest

from gsync._core.session.state import ALLOWED, Lifecycle, LifecycleError, SessionState

S = SessionState


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


ALLOWED_PAIRS = [(start, end) for start, ends in ALLOWED.items() for end in sorted(ends, key=lambda s: s.value)]
REFUSED_PAIRS = [(start, end) for start, end in itertools.product(S, S) if end not in ALLOWED[start]]


def test_every_state_has_its_transitions_stated() -> None:
    assert set(ALLOWED) == set(S)


@pytest.mark.parametrize(("start", "end"), ALLOWED_PAIRS, ids=lambda s: s.value)
def test_an_allowed_transition_is_made(start: SessionState, end: SessionState) -> None:
    life = reach(start)
    life.move(end)
    assert life.state is end


@pytest.mark.parametrize(("start", "end"), REFUSED_PAIRS, ids=lambda s: s.value)
def test_a_transition_the_lifecycle_does_not_allow_is_refused_and_changes_nothing(start: SessionState, end: SessionState) -> None:
    life = reach(start)
    with pytest.raises(LifecycleError, match=f"from {start.value} to {end.value}"):
        life.move(end)
    assert life.state is start


def test_each_state_refuses_something() -> None:
    assert {start for start, _ in REFUSED_PAIRS} == set(S)


def test_closed_is_final() -> None:
    assert ALLOWED[S.CLOSED] == frozenset()


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
