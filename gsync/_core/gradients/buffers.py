"""Module buffers (BatchNorm running statistics and the like).

As in DDP, the first device's buffers are authoritative: at every step they
are broadcast to the other replicas, so buffers are identical everywhere after
each step. Buffers are looked up by owner and name at each sync, so a module
that reassigns a buffer instead of updating it in place is still followed.

Buffers travel in one flat tensor per real dtype: a complex buffer as its
real view (``torch.view_as_real``), next to the real buffers of its
component dtype. Transports have no complex types (NCCL has none at all),
and a broadcast copies bits, so nothing is lost.

The flat copy each broadcast makes is kept for the last two steps: it is the
buffers' state as of that step, which a checkpoint needs once the next
forward has already moved them on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...comm.base import Collective

__all__ = ("BufferSync",)


def _buffer_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    slots: list[tuple[str, nn.Module, str]] = []
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                slots.append((f"{prefix}.{name}" if prefix else name, owner, name))
    return slots


def _wire(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` as a transport carries it: itself, or a complex buffer's real view (same memory)."""
    return torch.view_as_real(buffer) if buffer.is_complex() else buffer


def _as_buffer(piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A flat ``piece`` of the broadcast, viewed with ``like``'s shape and dtype (complex from its real view)."""
    if like.is_complex():
        return torch.view_as_complex(piece.view(*like.shape, 2))
    return piece.view_as(like)


class BufferSync:
    """Broadcasts each replica's buffers from the first device, one collective per real dtype."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self._slots = [_buffer_slots(replica) for replica in replicas]
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def empty(self) -> bool:
        return not self._slots[0]

    def _current(self, replica: int) -> list[torch.Tensor]:
        return [owner._buffers[name] for _, owner, name in self._slots[replica]]  # type: ignore[misc]

    def broadcast(self, collective: Collective, step: int) -> None:
        per_replica = [self._current(i) for i in range(len(self._slots))]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position, buffer in enumerate(per_replica[0]):
            by_dtype.setdefault(_wire(buffer).dtype, []).append(position)
        snapshot: dict[str, torch.Tensor] = {}
        names = [full for full, _, _ in self._slots[0]]
        for positions in by_dtype.values():
            flats = [torch.cat([_wire(buffers[p]).reshape(-1) for p in positions]) for buffers in per_replica]
            collective.broadcast(flats)
            sizes = [_wire(per_replica[0][p]).numel() for p in positions]
            # Every replica takes the result back: on other processes the local
            # first device is not the source either.
            for flat, buffers in zip(flats, per_replica):
                for p, source in zip(positions, flat.split(sizes)):
                    buffers[p].copy_(_as_buffer(source, buffers[p]))
            for p, piece in zip(positions, flats[0].split(sizes)):
                snapshot[names[p]] = _as_buffer(piece, per_replica[0][p])
        self._snapshots[step] = snapshot
        self._snapshots.pop(step - 2, None)

    def snapshot(self, step: int) -> dict[str, torch.Tensor] | None:
        """Buffers by state-dict name as broadcast at ``step``; ``None`` if that step was not kept."""
        return self._snapshots.get(step)

    def seed(self, step: int, snapshot: dict[str, torch.Tensor]) -> None:
        """Keep ``snapshot`` as the buffers of ``step``: the step a kept replica holds, broadcast by a session before."""
        self._snapshots[step] = snapshot

    def restore(self, step: int) -> dict[str, torch.Tensor]:
        """Every replica's buffers put back as ``step`` left them, and those values.

        A step interrupted after its forward has moved running statistics on.
        When ``step`` was not kept, no step ran since the buffers were whole:
        they are left as they are, and a copy of the first replica's returned.
        """
        snapshot = self._snapshots.get(step)
        if snapshot is None:
            return {full: owner._buffers[name].detach().clone() for full, owner, name in self._slots[0]}  # type: ignore[union-attr]
        with torch.no_grad():
            for slots in self._slots:
                for full, owner, name in slots:
                    owner._buffers[name].copy_(snapshot[full])  # type: ignore[union-attr]
        return snapshot
