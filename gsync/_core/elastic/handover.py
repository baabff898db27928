"""The state a new generation starts from, sent over its group: the most advanced member's, to everyone.

After a loss the survivors may differ by one step (a rank whose last
collective of step ``n`` completed applied it; one whose collective failed
did not), and a joiner has no state at all. Every member says the last step
it applied; the first member with the highest sends its checkpoint
(parameters, buffers, optimizer, scheduler, scaler, random generators, step,
data position) as bytes over the group, and every other member starts from
it. A generation whose members all hold the same step sends nothing, and
copies nothing: each member goes on with the state it holds (a
:class:`~gsync._core.state.held.HeldState`, its replicas themselves), whose
checkpoint is taken only by the member that sends it.

The bytes are a checkpoint file's (:meth:`gsync.Checkpoint.save`), read as
the file is read: ``torch.load(weights_only=True)``, which builds tensors and
plain values and refuses anything else. The store the members meet on is not
authenticated (torch.distributed's model), so a process that can reach it can
knock, be taken in and claim the highest step; what it sends can then be
wrong state, but it can never run code in the members.
"""

from __future__ import annotations

import io
import threading

import torch
import torch.distributed as dist

from ...checkpoint import _FORMAT, _VERSION, Checkpoint, _fields, _payload
from ...errors import CheckpointError
from ..distributed.waiting import broadcast_from, wait_work
from ..state.held import HeldState

__all__ = ("agree_state", "decode_state", "encode_state")

_NO_STATE = -2  # a joiner's last step: it holds nothing


def agree_state(group: dist.ProcessGroup, mine: HeldState | None, abort: threading.Event) -> HeldState | None:
    """The state every member of ``group`` starts from (``mine`` itself when it is as advanced as any); ``None``
    when no member holds one. Collective.

    No member holds state when one was lost while the run's first session
    opened: every member then starts from the initial state, as the launch did.

    :raises ~gsync.CheckpointError: when what the sending member sent is not
        a checkpoint that loads without running code (nothing of it is run).
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
    source = steps.index(best)  # it holds state: its step is not _NO_STATE
    length = torch.empty(1, dtype=torch.int64)
    if rank == source and mine is not None:
        data = torch.frombuffer(bytearray(encode_state(mine.checkpoint())), dtype=torch.uint8)
        length.fill_(data.numel())
        wait_work(broadcast_from(length, group, source), abort)
        wait_work(broadcast_from(data, group, source), abort)
        return mine
    wait_work(broadcast_from(length, group, source), abort)
    what = f"the state sent by the new membership's rank {source}"
    nbytes = int(length.item())
    if nbytes <= 0:
        raise CheckpointError(f"{what} was refused: it announced {nbytes} bytes")
    # Received straight into the bytes that are then read: the tensor is a view of them.
    received = bytearray(nbytes)
    wait_work(broadcast_from(torch.frombuffer(received, dtype=torch.uint8), group, source), abort)
    return HeldState.of(decode_state(received, what))


def encode_state(checkpoint: Checkpoint) -> bytes:
    """``checkpoint`` as the bytes :meth:`~gsync.Checkpoint.save` writes to a file (its payload, ``torch.save``\\ d)."""
    buffer = io.BytesIO()
    torch.save(_payload(checkpoint), buffer)
    return buffer.getvalue()


def decode_state(data: bytes | bytearray, what: str = "the state handed over") -> Checkpoint:
    """The checkpoint in ``data``, read as :meth:`~gsync.Checkpoint.load` reads a file: nothing in it is run.

    :raises ~gsync.CheckpointError: naming ``what``, for bytes that are not a
        checkpoint of a format this gsync reads, or that would need code run
        to be read (a pickled object of any class but a tensor or plain value).
    """
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - an unpickler refusing, or garbage: all sorts
        raise CheckpointError(
            f"{what} was refused: it is not a gsync checkpoint that loads without running code ({error})"
        ) from error
    return _from_payload(payload, what)


# The payload and its fields are Checkpoint.save's and Checkpoint.load's own (checkpoint._payload, _fields), so the
# bytes a member sends are a checkpoint file's; only the checks' words differ (a refusal names the sending rank).


def _from_payload(payload: object, what: str) -> Checkpoint:
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{what} was refused: it is not a gsync checkpoint (no gsync format marker)")
    version = payload.get("version")
    if not isinstance(version, int) or version > _VERSION:
        raise CheckpointError(f"{what} was refused: checkpoint format version {version!r}, newer than this gsync reads ({_VERSION})")
    try:
        return Checkpoint(**_fields(payload))
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise CheckpointError(f"{what} was refused: a damaged gsync checkpoint, missing or bad {error}") from error
