"""What a failed session hands back: the state after the last step its replicas applied, read where it is whole.

Every step is reduced on every device before any device applies it, so a
replica that finished its optimizer step holds a state the whole run agreed
on. A replica interrupted inside its optimizer step is half-updated and is
never read; nor, where an equally advanced replica is free, one that a
stalled job may still be writing to (a job in a thread cannot be
interrupted).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from ..step.actor import DeviceActor
from ..gradients.buffers import BufferSync
from ...checkpoint import Checkpoint
from ...errors import GsyncError, SyncTimeout

__all__ = ("attach_checkpoint", "last_consistent")


def last_consistent(
    actors: Sequence[DeviceActor],
    *,
    busy: Collection[str],
    first_step: int,
    model: nn.Module,
    resume: Checkpoint | None,
    buffers: BufferSync | None,
    held_start: bool = False,
) -> Checkpoint:
    """The state after the most advanced step a replica applied, from a replica not named in ``busy`` where one
    as advanced is not busy.

    Before the session's first step that is ``resume`` (the state it started
    from), or ``model``'s own state when it started fresh; ``held_start``:
    the replicas were kept from an elastic run's last generation, and hold
    the state before the first step themselves.

    :raises RuntimeError: if every replica was interrupted inside its optimizer step.
    """
    if actors and actors[0].update.shard is not None:
        return _last_consistent_sharded(actors, first_step=first_step, model=model, resume=resume, buffers=buffers)
    clean = [actor for actor in actors if not actor.optimizer_dirty]
    idle = [actor for actor in clean if actor.name not in busy]
    if idle and max(a.applied_step for a in idle) == max(a.applied_step for a in clean):
        clean = idle
    if not clean:
        raise RuntimeError("every replica was interrupted inside its optimizer step")
    best = max(clean, key=lambda actor: actor.applied_step)
    if best.applied_step < first_step and not held_start:
        if resume is not None:
            return resume
        return Checkpoint.capture(-1, model, best.optimizer, scheduler=best.scheduler, scaler=best.scaler)
    snapshot = buffers.snapshot(best.applied_step) if buffers is not None else None
    return Checkpoint.capture(
        best.applied_step, best.replica, best.optimizer, snapshot, scheduler=best.scheduler, scaler=best.scaler
    )


def _last_consistent_sharded(
    actors: Sequence[DeviceActor],
    *,
    first_step: int,
    model: nn.Module,
    resume: Checkpoint | None,
    buffers: BufferSync | None,
) -> Checkpoint:
    """:func:`last_consistent` with ``shard_optimizer``: each device holds the only copy of its shard's state, so
    the state after a step is whole only when every device applied it, and then it is whole whether or not the
    all-gather ran: each replica's own slices are the step's (the first replica gets the others', here).

    :raises RuntimeError: when the devices stopped at different steps or inside one (a failure inside one
        device's optimizer step while another finished its own): neither step is whole anywhere.
    """
    steps = {actor.applied_step for actor in actors}
    if any(actor.optimizer_dirty for actor in actors) or len(steps) != 1:
        raise RuntimeError(
            "with shard_optimizer each device holds the only copy of its shard, and the devices stopped at different "
            f"steps ({', '.join(f'{a.name}: {a.applied_step}' for a in actors)}) or inside one, so no step's state is "
            "whole: resume from the last checkpoint file"
        )
    best = actors[0]
    if best.applied_step < first_step:
        if resume is not None:
            return resume
        return Checkpoint.capture(-1, model, best.optimizer, scheduler=best.scheduler, scaler=best.scaler)
    with torch.no_grad():
        for actor in actors[1:]:
            shard = actor.update.shard
            mine = best.update.shard
            if shard is None or mine is None:
                continue
            for position, (start, stop) in enumerate(shard.ranges):
                if stop > start:
                    mine.params[position].view(-1)[start:stop].copy_(shard.slices[position].detach())
    snapshot = buffers.snapshot(best.applied_step) if buffers is not None else None
    return Checkpoint.capture(
        best.applied_step, best.replica, best.optimizer, snapshot, scheduler=best.scheduler, scaler=best.scaler
    )


def attach_checkpoint(failure: GsyncError, capture: Callable[[Collection[str]], Checkpoint]) -> None:
    """Give ``failure`` the state ``capture(busy)`` reads, ``busy`` naming the devices a timeout left running.

    A capture that fails leaves a note on ``failure`` instead: the failure
    itself is what the user must see.
    """
    busy = failure.stalled_devices if isinstance(failure, SyncTimeout) else ()
    try:
        checkpoint = capture(busy)
    except Exception as error:  # noqa: BLE001 - the original failure matters more
        failure.add_note(f"gsync could not capture a checkpoint: {error!r}")
        return
    failure.checkpoint = checkpoint
    failure.last_step = checkpoint.step if checkpoint.step >= 0 else None
