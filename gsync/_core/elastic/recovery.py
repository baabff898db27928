"""Which failures an elastic run survives: a peer that is gone, never one whose own code failed.

A peer's own error (its loss function raised, its data failed, a bad
argument) would come back on any membership, so it still ends the run on
every rank. What an elastic run goes on from is a peer that stopped
answering: a collective that failed with no failure reported by a peer, a
heartbeat gone silent, or a change another member asked for.
"""

from __future__ import annotations

from ...errors import GsyncError, PeerLost, SyncFailed

__all__ = ("MembershipBroken", "recoverable")


class MembershipBroken(SyncFailed):
    """A member of the elastic run stopped answering, or the run is changing its membership (never raised to users).

    The session core that meets it ends, and the next generation redoes the step.
    """


def recoverable(error: BaseException) -> bool:
    """Whether an elastic run goes on after ``error`` with a new membership."""
    return isinstance(error, (MembershipBroken, PeerLost)) and isinstance(error, GsyncError)
