"""Waiting on a collective without getting stuck inside it.

A gsync thread blocked in ``Work.wait()`` cannot be interrupted by anything on
this rank: ``destroy_process_group`` and ``abort()`` leave a gloo wait blocked
until the peer answers or the group times out. A thread left there when the
interpreter exits is worse than a hang: when the wait finally returns during
finalization, it cannot retake the GIL, CPython ends the thread with a forced
unwind through a ``noexcept`` destructor, and the process aborts with
``terminate called without an active exception`` (pytorch/pytorch#38228).

So host-blocking waits (gloo) run in short slices, and between slices the
thread checks the run's abort flag and leaves with
:class:`~gsync._core.threads.FitAborted` once it is set. The abandoned operation is
gloo's to finish or fail in its own threads; no gsync thread is inside it.

NCCL waits are stream-ordered (``wait()`` returns at once and makes the
current stream wait), and a timed wait would block the host until the GPU is
done, so those are left as they are.

The same abort has a second way in: gloo's worker thread marks a work
completed, and only then drops its own reference to it. If the waiting thread
dropped the last Python one first, gloo's thread frees the work's tensors,
which have Python objects, so it must take the GIL; a process that exits
right after its last collective (a rank returning its result) is finalizing
by then, and aborts. So every work waited on here is kept (:data:`_SETTLING`,
the last few) and freed by a Python thread, long after gloo let go of it: as
newer works push it out, or when a group is closed (:func:`release_settled`;
a work keeps its group's threads alive).
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..threads import FitAborted

__all__ = ("DIST_TEARDOWN_S", "GROUP_TYPES", "WAIT_SLICE", "broadcast_from", "release_settled", "wait_work")

# What gsync takes as a group: a registered ProcessGroup, or a bare backend built on a store (an elastic run's
# generations are; NCCL only where torch was built with it).
GROUP_TYPES: tuple[type, ...] = (dist.ProcessGroup, dist.ProcessGroupGloo) + (
    (dist.ProcessGroupNCCL,) if hasattr(dist, "ProcessGroupNCCL") else ()
)

WAIT_SLICE = timedelta(milliseconds=50)
"""How long one slice of a host-blocking wait lasts: the most a thread lingers in a collective after an abort."""

DIST_TEARDOWN_S = 10.0
"""Upper bound on reporting a failure to other ranks and closing a process group."""

_SETTLING: deque[dist.Work] = deque(maxlen=16)
"""The last works waited on, kept so that gloo's worker thread never drops the last reference to one (see above)."""


def wait_work(work: dist.Work, abort: threading.Event | None, *, blocking: bool = True) -> None:
    """Wait for ``work``, leaving early with :class:`FitAborted` once ``abort`` is set.

    ``blocking`` says the work blocks the host (gloo); otherwise (NCCL) the
    plain stream-ordered ``wait()`` is used.

    :raises FitAborted: when ``abort`` is set before the work completes.
    :raises RuntimeError: (from torch.distributed) when the work itself failed.
    """
    _SETTLING.append(work)
    if abort is None or not blocking:
        work.wait()
        return
    while not work.is_completed():
        if abort.is_set():
            raise FitAborted
        try:
            work.wait(WAIT_SLICE)
        except RuntimeError:
            # A slice that ran out ("Operation timed out!") leaves the work
            # pending; a failed work is completed and raises again below.
            if work.is_completed():
                break
    # Completed: returns at once, or raises the work's own error.
    work.wait()


def release_settled() -> None:
    """Free the works kept since they were waited on (a group is being closed: they keep its threads alive)."""
    _SETTLING.clear()


def broadcast_from(tensor: torch.Tensor, group: dist.ProcessGroup, root: int = 0) -> dist.Work:
    """Launch a broadcast of ``tensor`` from group rank ``root`` over ``group`` (``async_op``); returns its work.

    ``dist.broadcast`` names its source by global rank, which only groups
    torch.distributed registered have. An elastic run's groups are built
    directly on their store, as torchft builds its groups (they outlive no
    default group, and a new one replaces them after a loss): those are told
    the group rank through the backend's own call.
    """
    if group in dist.distributed_c10d._world.pg_group_ranks:
        return dist.broadcast(tensor, src=dist.get_global_rank(group, root), group=group, async_op=True)
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    return group.broadcast([tensor], options)
