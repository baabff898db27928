"""Which failures an elastic run survives: a peer that is gone, never one whose own code failed.

A peer's own error (its loss function raised, its data failed, a bad
argument) would come back on any membership, so it still ends the run on
every rank. What an elastic run goes on from is a peer that stopped
answering: a collective that failed with no failure reported by a peer, a
heartbeat gone silent, or a change another member asked for.
"""

from __future__ import annotations

import logging
import threading

import torch.distributed as dist

from ...errors import GsyncError, PeerLost, SyncFailed

__all__ = ("PEER_GONE_KEY", "MembershipBroken", "abort_communicator", "connection_lost", "recoverable")

logger = logging.getLogger("gsync")
_ABORTED: set[int] = set()
_ABORTING = threading.Lock()

PEER_GONE_KEY = "peer_gone"
"""Set under a generation's store (``g<g>/s``) by a member that met :func:`connection_lost` in that generation."""
# What gloo's TCP transport says when the other end of a pair's connection went away (pair.cc: end of file,
# ECONNRESET, EPIPE): the kernel closes a process's sockets when it ends, however it ends.
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class MembershipBroken(SyncFailed):
    """A member of the elastic run stopped answering, or the run is changing its membership (never raised to users).

    The session core that meets it ends, and the next generation redoes the step.
    """


def recoverable(error: BaseException) -> bool:
    """Whether an elastic run goes on after ``error`` with a new membership."""
    return isinstance(error, (MembershipBroken, PeerLost)) and isinstance(error, GsyncError)


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is gloo reporting that a peer's connection closed: its process ended.

    A live member does not close its connections to a generation's group
    while the generation lasts: groups are retired, not destroyed, until the
    run ends, and gloo closes a pair itself only when an operation runs into
    the group's timeout, which gsync's own (``sync_timeout``, a peer's
    3 s of silence) end long before. So this is proof that some member of the
    generation is gone, though not of which one: gloo names the peer by a
    socket address, not a rank. The store's own connection errors are not.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        store_error = isinstance(current, (dist.DistStoreError, dist.DistNetworkError))
        # A gsync error's str() ends with its cause's message, which the chain reaches next, as what it is.
        own_message = str(current.args[0]) if isinstance(current, GsyncError) and current.args else str(current)
        if isinstance(current, RuntimeError) and not store_error and any(text in own_message for text in _CONNECTION_LOST):
            return True
        current = current.__cause__ or current.__context__
    return False


def abort_communicator(group: object) -> None:
    """Abort an NCCL group's communicator, once, so that its pending work ends instead of waiting on a dead peer.

    NCCL waits on a peer that is gone without ever failing, so the members
    abort the old generation's communicator as soon as they know a change is
    coming (a heartbeat gone silent, a change asked for), before anything
    waits on the GPU. ``abort()`` is what torch's own
    ``_abort_process_group`` calls on each backend. A gloo group is left as
    it is: its ``abort()`` does not end a pending receive (torch 2.13,
    measured), and a process whose gloo group was aborted with work pending
    crashed at exit ("terminate called without an active exception").

    This has not run on a GPU (see the elastic runs page of the docs).
    """
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not isinstance(group, nccl):
        return
    with _ABORTING:
        if id(group) in _ABORTED:
            return
        _ABORTED.add(id(group))
    try:
        group.abort()
    except Exception as error:  # noqa: BLE001 - the change goes on; the old group is retired either way
        logger.warning("gsync: aborting the old NCCL communicator failed: %s", error)
