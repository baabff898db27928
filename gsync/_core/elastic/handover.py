"""The state a new generation starts from, sent over its group: the most advanced member's, to everyone.

After a loss the survivors may differ by one step (a rank whose last
collective of step ``n`` completed applied it; one whose collective failed
did not), and a joiner has no state at all. Every member says the last step
it applied (and how many evaluations or all_reduces it completed since); the
first member with the highest sends its checkpoint
(parameters, buffers, optimizer, scheduler, scaler, random generators, step,
data position) as bytes over the group, and every member behind starts from
it. A member as advanced, and every member of a generation whose members all
hold the same step, copies nothing: it goes on with the state it holds (a
:class:`~gsync._core.state.held.HeldState`, its replicas themselves), whose
checkpoint is taken only by the member that sends it. Members at the same
step may differ by one evaluation or all_reduce: its result is sent the same
way (:mod:`~gsync._core.elastic.carry`).

The bytes are a checkpoint file's (:meth:`gsync.Checkpoint.save`), read as
the file is read (a result, its values ``torch.save``\\ d, is read the same way):
``torch.load(weights_only=True)``, which builds tensors and
plain values and refuses anything else. The store the members meet on is not
authenticated (torch.distributed's model), so a process that can reach it can
knock, be taken in and claim the highest step; what it sends can then be
wrong state, but it can never run code in the members.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint import _FORMAT, _VERSION, Checkpoint, _fields, _payload
from ...errors import CheckpointError
from ..distributed.waiting import broadcast_from, wait_work
from ..state.held import HeldState
from .carry import OperationLog

__all__ = ("agree_state", "decode_state", "encode_state")

_NO_STATE = -2  # a joiner's last step: it holds nothing


def agree_state(
    group: dist.ProcessGroup, mine: HeldState | None, abort: threading.Event, operations: OperationLog
) -> HeldState | None:
    """The state every member of ``group`` starts from (``mine`` itself when it is as advanced as any); ``None``
    when no member holds one. Collective.

    No member holds state when one was lost while the run's first session
    opened: every member then starts from the initial state, as the launch did.

    ``operations``: this member's evaluations and all_reduces since its last
    step; one that another member completed and this one did not is handed
    over into it (see :mod:`~gsync._core.elastic.carry`), once the whole
    agreement succeeded (an agreement cut short by a member lost again hands
    nothing: the next one compares afresh).

    :raises ~gsync.CheckpointError: when what the sending member sent is not
        a checkpoint that loads without running code (nothing of it is run).
    :raises RuntimeError: (from gloo) when a member is lost meanwhile.
    """
    size = group.size()
    step = _NO_STATE if mine is None else mine.step
    done = 0 if mine is None else operations.position(mine.step)
    position = torch.tensor([step, done], dtype=torch.int64)
    gathered = [torch.empty_like(position) for _ in range(size)]
    wait_work(dist.all_gather(gathered, position, group=group, async_op=True), abort)
    positions = [(int(value[0].item()), int(value[1].item())) for value in gathered]
    best = max(positions)
    if best[0] == _NO_STATE:
        return None
    source = positions.index(best)  # the most advanced step, and the most operations after it
    handed: tuple[str, Any] | None = None
    if best[1] > 0 and any(other < best for other in positions):
        handed = _hand_result(group, source, operations.last(best[0]) if group.rank() == source else None, abort)
    state = mine if all(other[0] == best[0] for other in positions) and mine is not None else _send_state(group, source, best[0], mine, abort)
    # Handed only to a member exactly one operation behind, where it stands once it holds the state (see carry).
    if handed is not None and (done if step == best[0] else 0) == best[1] - 1:
        operations.hand(best[0], best[1], *handed)
    return state


def _send_state(group: dist.ProcessGroup, source: int, best: int, mine: HeldState | None, abort: threading.Event) -> HeldState:
    """``source``'s state, sent to every member; a member as advanced as ``best`` goes on with its own."""
    if group.rank() == source and mine is not None:
        _send(group, encode_state(mine.checkpoint()), abort)
        return mine
    what = f"the state sent by the new membership's rank {source}"
    received = _receive(group, source, what, abort)
    if mine is not None and mine.step == best:
        # As advanced as the sender (a joiner or a member behind needed its state): this member's own replicas go
        # on, as they would had nobody needed it.
        return mine
    return HeldState.of(decode_state(received, what))


def _hand_result(
    group: dist.ProcessGroup, source: int, last: tuple[str, Any] | None, abort: threading.Event
) -> tuple[str, Any]:
    """The kind and result of ``source``'s last operation (``last``, on ``source``), as every member reads it."""
    what = f"the result of an operation sent by the new membership's rank {source}"
    if last is not None:
        buffer = io.BytesIO()
        torch.save({"kind": last[0], "result": last[1]}, buffer)
        _send(group, buffer.getvalue(), abort)
        return last
    received = _receive(group, source, what, abort)
    try:
        payload = torch.load(io.BytesIO(received), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - an unpickler refusing, or garbage: all sorts
        raise CheckpointError(f"{what} was refused: it does not load without running code ({error})") from error
    if not isinstance(payload, dict) or not isinstance(payload.get("kind"), str) or "result" not in payload:
        raise CheckpointError(f"{what} was refused: it is not an operation's result")
    return payload["kind"], payload["result"]


def _send(group: dist.ProcessGroup, payload: bytes, abort: threading.Event) -> None:
    """Broadcast ``payload`` from this member, its length first (what :func:`_receive` reads)."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    wait_work(broadcast_from(torch.tensor([data.numel()], dtype=torch.int64), group, group.rank()), abort)
    wait_work(broadcast_from(data, group, group.rank()), abort)


def _receive(group: dist.ProcessGroup, source: int, what: str, abort: threading.Event) -> bytearray:
    """The bytes ``source`` broadcasts (:func:`_send`), after their length."""
    length = torch.empty(1, dtype=torch.int64)
    wait_work(broadcast_from(length, group, source), abort)
    nbytes = int(length.item())
    if nbytes <= 0:
        raise CheckpointError(f"{what} was refused: it announced {nbytes} bytes")
    # Received straight into the bytes that are then read: the tensor is a view of them.
    received = bytearray(nbytes)
    wait_work(broadcast_from(torch.frombuffer(received, dtype=torch.uint8), group, source), abort)
    return received


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
