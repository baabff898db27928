"""What the ranks agree on through the group: topology, parameters, initial state, bucket order.

Each function is collective: every rank of the group must call it, in the
same order, or it blocks until the group's timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ..topology import Topology
from .membership import GroupMembership
from .waiting import broadcast_from

__all__ = (
    "agree_on_order",
    "broadcast_module_state",
    "gather_topology",
    "union_of_names",
    "verify_same_parameters",
    "verify_same_start",
)

# Module state is broadcast in byte buffers of at most this size, so a large
# model is not duplicated in memory all at once.
_STATE_CHUNK_BYTES = 128 * 2**20
# Offsets inside a byte buffer are aligned so every dtype can be viewed in place.
_ALIGN = 16


def _all_gather(member: GroupMembership, tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(member.world_size)]
    member.wait(dist.all_gather(gathered, tensor, group=member.group, async_op=True))
    return gathered


def _all_gather_bytes(member: GroupMembership, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order. Collective.

    torch's ``all_gather_object`` needs numpy (not a gsync dependency) and
    unpickles what peers send; this moves plain bytes in two gathers, sizes
    first, on the member's device.
    """
    device = member.device
    sizes = _all_gather(member, torch.tensor([len(payload)], dtype=torch.int64, device=device))
    lengths = [int(size.item()) for size in sizes]
    longest = max(lengths)
    if longest == 0:
        return [b""] * member.world_size
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buffer[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return [bytes(chunk[:length].tolist()) for chunk, length in zip(_all_gather(member, buffer), lengths)]


def gather_topology(member: GroupMembership, local_devices: int) -> Topology:
    """Where this rank's devices sit among all devices, rank-major. Collective.

    :raises ~gsync.ConfigError: when ``local_devices`` is not a positive int.
    """
    if isinstance(local_devices, bool) or not isinstance(local_devices, int) or local_devices < 1:
        raise ConfigError(f"local_devices must be a positive int, got {local_devices!r}")
    mine = torch.tensor([local_devices], dtype=torch.int64, device=member.device)
    counts = [int(count.item()) for count in _all_gather(member, mine)]
    return Topology(
        local_devices=local_devices,
        rank=member.rank,
        world_size=member.world_size,
        device_offset=sum(counts[: member.rank]),
        world_devices=sum(counts),
    )


_Signature = list[tuple[str, tuple[int, ...], str]]


def _signature(named: Sequence[tuple[str, torch.Tensor]]) -> _Signature:
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named]


def _decode_signature(raw: bytes) -> _Signature:
    return [(name, tuple(shape), dtype) for name, shape, dtype in msgspec.msgpack.decode(raw)]


def _describe_difference(reference: _Signature, other: _Signature, rank: int, noun: str) -> str | None:
    """How ``rank``'s signature differs from rank 0's, naming the first differing entry; None if equal."""
    for index, ((name0, shape0, dtype0), (name, shape, dtype)) in enumerate(zip(reference, other)):
        if name != name0:
            return f"{noun} {index} is {name!r} on rank {rank} but {name0!r} on rank 0"
        parts = []
        if shape != shape0:
            parts.append(f"shape {shape} on rank {rank} but {shape0} on rank 0")
        if dtype != dtype0:
            parts.append(f"dtype {dtype} on rank {rank} but {dtype0} on rank 0")
        if parts:
            return f"{noun} {name!r} has " + " and ".join(parts)
    if len(other) < len(reference):
        return (
            f"rank {rank} has {len(other)} {noun}s, rank 0 has {len(reference)}: "
            f"{reference[len(other)][0]!r} (and any after it) is missing on rank {rank}"
        )
    if len(other) > len(reference):
        return (
            f"rank {rank} has {len(other)} {noun}s, rank 0 has {len(reference)}: "
            f"{other[len(reference)][0]!r} (and any after it) exists only on rank {rank}"
        )
    return None


def _verify_same(member: GroupMembership, signature: _Signature, noun: str) -> None:
    # Gather digests first: the full lists travel only when something differs.
    # Every rank sees the same gathered values, so every rank takes the same
    # branch and raises the same error.
    payload = msgspec.msgpack.encode(signature)
    digest = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8).to(member.device)
    digests = _all_gather(member, digest)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    signatures = [_decode_signature(raw) for raw in _all_gather_bytes(member, payload)]
    differences = [
        (rank, text)
        for rank in range(1, member.world_size)
        if (text := _describe_difference(signatures[0], signatures[rank], rank, noun)) is not None
    ]
    if not differences:  # the digests differed but the lists match: nothing to report
        return
    rank, text = differences[0]
    also = f" (ranks {', '.join(str(r) for r, _ in differences)} all differ from rank 0)" if len(differences) > 1 else ""
    raise ConfigError(
        f"the model differs across ranks: {text}{also}. Every process must build the same model (same code, "
        "same constructor arguments, same requires_grad settings) before fit"
    )


def verify_same_parameters(member: GroupMembership, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Check that every rank has the same parameter names, shapes and dtypes, in the same order. Collective.

    :raises ~gsync.ConfigError: on every rank alike when any rank differs from
        rank 0, naming the first differing rank, the first differing parameter
        and what differs (name, shape, dtype, or the number of parameters).
    """
    _verify_same(member, _signature(named_params), "parameter")


def verify_same_start(member: GroupMembership, first_step: int) -> None:
    """Check that every rank starts at the same step (resumed from the same checkpoint, or none). Collective.

    Rank 0's parameters are broadcast to every rank, but each rank's
    optimizer, scheduler and step count come from its own ``resume=``: ranks
    that resumed from different checkpoints (a checkpoint directory only rank
    0 can read, on a node of its own) would train on, their replicas drifting
    apart.

    :raises ~gsync.ConfigError: on every rank alike, naming the ranks' steps.
    """
    mine = torch.tensor([first_step], dtype=torch.int64).to(member.device)
    steps = [int(step) for step in _all_gather(member, mine)]
    if len(set(steps)) > 1:
        starts = ", ".join(f"rank {rank} at step {step}" for rank, step in enumerate(steps))
        raise ConfigError(
            f"the ranks do not resume from the same checkpoint: {starts}. Give every rank the same resume= "
            "(a checkpoint_dir on a filesystem every rank sees, or the same file; after a failure, rank 0's "
            "error.checkpoint), or none; a directory listed while rank 0 was still writing its newest file, or "
            "before a network filesystem showed it, also differs"
        )


def _module_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # named_parameters/named_buffers skip shared tensors after their first
    # name, so a tied weight is sent once.
    return list(module.named_parameters()) + list(module.named_buffers())


def broadcast_module_state(member: GroupMembership, module: nn.Module) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank 0's, in place. Collective.

    The state travels as raw bytes, coalesced into a few flat buffers (one
    collective per ~128 MiB, whatever the dtypes), so it is exact for every
    dtype and costs a handful of collectives instead of one per tensor.

    :raises ~gsync.ConfigError: on every rank alike when the parameters or
        buffers differ across ranks (checked first, as in
        :func:`verify_same_parameters`).
    """
    named = _module_state(module)
    _verify_same(member, _signature(named), "parameter or buffer")
    tensors = [tensor for _, tensor in named if tensor.numel() > 0]
    with torch.no_grad():
        for chunk in _chunks(tensors):
            _broadcast_bytes(member, chunk)


def _padded_bytes(tensor: torch.Tensor) -> int:
    size = tensor.numel() * tensor.element_size()
    return -(-size // _ALIGN) * _ALIGN


def _chunks(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = _padded_bytes(tensor)
        if chunk and size + nbytes > _STATE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        yield chunk


def _broadcast_bytes(member: GroupMembership, tensors: list[torch.Tensor]) -> None:
    offsets = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += _padded_bytes(tensor)
    flat = torch.empty(total, dtype=torch.uint8, device=member.device)
    source = member.rank == 0
    if source:
        for tensor, offset in zip(tensors, offsets):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
    member.wait(broadcast_from(flat, member.group))
    if not source:
        for tensor, offset in zip(tensors, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))


def agree_on_order(member: GroupMembership, order: Sequence[int]) -> list[int]:
    """Rank 0's ``order`` (e.g. the parameter order its first backward observed), on every rank. Collective.

    Each rank observes its own gradient order; a bucket plan rebuilt from a
    local order could differ between ranks, and then bucket ``b`` would not
    mean the same bytes everywhere. Rebuild from the agreed order instead.

    :raises ~gsync.ConfigError: on every rank alike when the orders differ in
        length (the ranks do not train the same parameters).
    """
    mine = torch.tensor([len(order)], dtype=torch.int64, device=member.device)
    lengths = [int(length.item()) for length in _all_gather(member, mine)]
    if len(set(lengths)) > 1:
        raise ConfigError(
            f"ranks observed gradient orders of different lengths {lengths}: every rank must train the same "
            "parameters (same model, same requires_grad settings)"
        )
    agreed = torch.tensor(list(order), dtype=torch.int64).to(member.device)
    member.wait(broadcast_from(agreed, member.group))
    return [int(position) for position in agreed.tolist()]


def union_of_names(member: GroupMembership, names: Sequence[str]) -> list[str]:
    """Every name any rank holds, sorted: the same list on every rank. Collective.

    Values reduced by name (metrics) are laid out in this order, so a rank
    that saw no data, or data that gave its metric function other keys, still
    reduces tensors of the same size and meaning as its peers.
    """
    gathered = _all_gather_bytes(member, msgspec.msgpack.encode(sorted(names)))
    return sorted({name for raw in gathered for name in msgspec.msgpack.decode(raw, type=list[str])})
