"""The state a new generation starts from, sent over its group: the most advanced member's, to everyone.

After a loss the survivors may differ by one step (a rank whose last
collective of step ``n`` completed applied it; one whose collective failed
did not), and a joiner has no state at all. Every member says the last step
it applied; the first member with the highest sends its checkpoint
(parameters, buffers, optimizer, scheduler, scaler, step, data position) as
bytes over the group, and every other member starts from it. A generation
whose members all hold the same step sends nothing.
"""

from __future__ import annotations

import io
import threading

import torch
import torch.distributed as dist

from ...checkpoint import Checkpoint
from ..distributed.waiting import broadcast_from, wait_work

__all__ = ("agree_state",)

_NO_STATE = -2  # a joiner's last step: it holds nothing


def agree_state(group: dist.ProcessGroup, mine: Checkpoint | None, abort: threading.Event) -> Checkpoint | None:
    """The checkpoint every member of ``group`` starts from; ``None`` when no member holds one. Collective.

    No member holds state when one was lost while the run's first session
    opened: every member then starts from the initial state, as the launch did.

    :raises RuntimeError: (from gloo) when a member is lost meanwhile.
    """
    rank, size = group.rank(), group.size()
    step = torch.tensor([_NO_STATE if mine is None else mine.step], dtype=torch.int64)
    gathered = [torch.empty_like(step) for _ in range(size)]
    wait_work(dist.all_gather(gathered, step, group=group, async_op=True), abort)
    steps = [int(value.item()) for value in gathered]
    best = max(steps)
    if best == _NO_STATE:
        return None
    if all(value == best for value in steps) and mine is not None:
        return mine
    source = steps.index(best)
    payload = b""
    if rank == source and mine is not None:
        buffer = io.BytesIO()
        torch.save(mine, buffer)
        payload = buffer.getvalue()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    wait_work(broadcast_from(length, group, source), abort)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    if rank == source:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    wait_work(broadcast_from(data, group, source), abort)
    if rank == source and mine is not None:
        return mine
    # The sender is a member of this run, and weights_only refuses anything but tensors and plain containers.
    received = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    if not isinstance(received, Checkpoint):
        raise RuntimeError(f"the state sent by the new membership's rank {source} is a {type(received).__name__}")
    return received
