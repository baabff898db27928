"""Module buffers (BatchNorm running statistics and the like).

As in DDP, the first device's buffers are authoritative: at every step they
are broadcast to the other replicas, so buffers are identical everywhere after
each step. Buffers are looked up by owner and name at each sync, so a module
that reassigns a buffer instead of updating it in place is still followed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .comm.base import Collective

__all__ = ("BufferSync",)


def _buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    slots: list[tuple[nn.Module, str]] = []
    seen: set[int] = set()
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                slots.append((sub, name))
    return slots


class BufferSync:
    """Broadcasts each replica's buffers from the first device, one collective per dtype."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self._slots = [_buffer_slots(replica) for replica in replicas]

    @property
    def empty(self) -> bool:
        return not self._slots[0]

    def _current(self, replica: int) -> list[torch.Tensor]:
        return [owner._buffers[name] for owner, name in self._slots[replica]]  # type: ignore[misc]

    def broadcast(self, collective: Collective) -> None:
        per_replica = [self._current(i) for i in range(len(self._slots))]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position, buffer in enumerate(per_replica[0]):
            by_dtype.setdefault(buffer.dtype, []).append(position)
        for positions in by_dtype.values():
            flats = [torch.cat([buffers[p].reshape(-1) for p in positions]) for buffers in per_replica]
            collective.broadcast(flats)
            # Every replica takes the result back: on other processes the local
            # first device is not the source either.
            for flat, buffers in zip(flats, per_replica):
                targets = [buffers[p] for p in positions]
                for target, source in zip(targets, flat.split([t.numel() for t in targets])):
                    target.copy_(source.view_as(target))
