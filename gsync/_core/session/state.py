"""A session core's lifecycle (one per generation of an elastic run): one state, every transition made through
one method, the others refused.

::

    OPENING    ──► IDLE, CLOSING
    IDLE       ──► OPERATING, FAILING, CHANGING, CLOSING
    OPERATING  ──► IDLE, FAILING, CLOSING
    FAILING    ──► FAILED, CLOSED
    FAILED     ──► CLOSED
    CHANGING   ──► FAILING, CLOSED
    CLOSING    ──► FAILING, CLOSED
    CLOSED     (nothing leaves it)

What each state answers, asked by the operations, the peers protocol and
the service:

- ``OPENING``: the process group, the replicas and the assembly are being
  built; a call is refused (the session is not open yet).
- ``IDLE``: open, between calls; a call may start.
- ``OPERATING``: a step, evaluate or all_reduce runs; another is refused
  (one call at a time), a read of the model is refreshed after it.
- ``FAILING``: the session's task group failed, and the failure is being
  settled (threads stopped, the failure picked, reported, checkpointed); a
  call waits for it and raises it.
- ``FAILED``: settled; calls raise the failure once, then ``SessionClosed``.
- ``CHANGING``: every rank agreed to change an elastic run's membership
  after the last step: this generation ends, and the next one goes on with
  its replicas (the model passed in is not written back); no call starts on
  it. The session core also reports ``CHANGING`` (whatever its ended
  generation's state) until its next generation is open.
- ``CLOSING``: its end was asked for (``aclose``, a drop, a failure an
  operation chose, a departure): no call starts, though the session has
  not ended yet.
- ``CLOSED``: everything it started has stopped.

A transition the design does not allow is a bug in gsync, raised as
:class:`LifecycleError` where it is made, never carried on from.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ("ALLOWED", "Change", "Lifecycle", "LifecycleError", "SessionState")


class SessionState(enum.Enum):
    OPENING = "opening"
    IDLE = "idle"
    OPERATING = "operating"
    FAILING = "failing"
    FAILED = "failed"
    CHANGING = "changing membership"
    CLOSING = "closing"
    CLOSED = "closed"


class Change(enum.Enum):
    """Where an elastic run's membership change stands, as the session core sees it (``None``: no change).

    One value instead of the flags that each said part of it: a change every rank agreed on is ``DUE`` after the
    step whose agreement said so, ``PLANNED`` once the next call ends the generation for it, ``LOST`` when a
    generation ended because a member was lost instead, and ``JOINING`` while the next generation opens after
    either. The core reports :attr:`SessionState.CHANGING` from ``PLANNED`` until the next generation is open.
    """

    DUE = "due"
    PLANNED = "planned"
    LOST = "lost"
    JOINING = "joining"


_S = SessionState
ALLOWED: Mapping[SessionState, frozenset[SessionState]] = {
    # A start that fails (its collectives, a peer), is closed while it runs, or is cut short by a cancellation
    # asks for its end, and is torn down from CLOSING: serving, where a failure is settled, begins only once open.
    _S.OPENING: frozenset({_S.IDLE, _S.CLOSING}),
    # A change every rank agreed on is made between calls.
    _S.IDLE: frozenset({_S.OPERATING, _S.FAILING, _S.CHANGING, _S.CLOSING}),
    _S.OPERATING: frozenset({_S.IDLE, _S.FAILING, _S.CLOSING}),
    # Closed from FAILING only when a cancellation cuts the settling short: teardown still runs.
    _S.FAILING: frozenset({_S.FAILED, _S.CLOSED}),
    _S.FAILED: frozenset({_S.CLOSED}),
    # Devices that fail while a close winds them down are settled as any failure is.
    _S.CHANGING: frozenset({_S.FAILING, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.FAILING, _S.CLOSED}),
    _S.CLOSED: frozenset(),
}


class LifecycleError(RuntimeError):
    """A session core was asked for a transition its lifecycle does not allow: a bug in gsync."""


class Lifecycle:
    """The state of one session core; :meth:`move` is the only way it changes."""

    __slots__ = ("_path",)

    def __init__(self) -> None:
        self._path = [SessionState.OPENING]
        """Every state it has been in, in order (short: a core makes a handful of transitions besides its calls)."""

    @property
    def state(self) -> SessionState:
        return self._path[-1]

    @property
    def opened(self) -> bool:
        """The start finished (the session reached ``IDLE`` once): what it reports to peers is the fit's, not the start's."""
        return len(self._path) > 1 and self._path[1] is SessionState.IDLE

    def move(self, to: SessionState) -> None:
        """Make the transition to ``to``.

        :raises LifecycleError: when the lifecycle does not allow it from the current state.
        """
        state = self._path[-1]
        if to not in ALLOWED[state]:
            path = " -> ".join(step.value for step in self._path)
            raise LifecycleError(f"a session core cannot go from {state.value} to {to.value} (its states so far: {path})")
        if to is SessionState.IDLE and state is SessionState.OPERATING:
            # A call's way back: the path keeps where the life went, not every call it served.
            self._path.pop()
        else:
            self._path.append(to)

    def end_asked(self) -> None:
        """Its end was asked for: no call starts from now on (nothing changes once it is failing or ending)."""
        if self._path[-1] in (SessionState.OPENING, SessionState.IDLE, SessionState.OPERATING):
            self.move(SessionState.CLOSING)

    def operation_over(self) -> None:
        """An operation returned or raised: back to ``IDLE``, unless the session failed or is ending meanwhile."""
        if self._path[-1] is SessionState.OPERATING:
            self.move(SessionState.IDLE)

    def __repr__(self) -> str:
        return f"<Lifecycle {self._path[-1].value}>"
