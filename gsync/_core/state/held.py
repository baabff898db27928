"""The state a rank holds between two generations of an elastic run: its replicas, kept, or a checkpoint.

A membership change does not throw a survivor's training state away: the
replicas (modules, optimizers, schedulers, scalers) that held the last
applied step go on in the next generation's session as they are, with
nothing copied or loaded. A checkpoint of them is taken only when something
needs one: a member behind or a joiner is sent it, or the run ends and the
error carries it. Taken once, and before the next generation moves the
replicas on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ...checkpoint import Checkpoint
from .replicas import Replica

if TYPE_CHECKING:
    from ..gradients.buffers import BufferSync
    from ..step.actor import DeviceActor

__all__ = ("HeldState", "hold_replicas")


class HeldState:
    """The state after step :attr:`step`: live replicas a next generation may take, and its checkpoint on demand."""

    def __init__(
        self,
        step: int,
        capture: Callable[[], Checkpoint],
        replicas: list[Replica] | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.step = step
        """The last step applied to this state (-1: none, the initial state)."""
        self.buffers = buffers
        """The replicas' module buffers as of :attr:`step` (what a checkpoint of the next session's first,
        interrupted step holds: its forward moves them on)."""
        self._capture = capture
        self._checkpoint: Checkpoint | None = None
        self._replicas = replicas
        self._taken = False

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> HeldState:
        """A checkpoint held as it is (one handed over, read from a file, or a failure's)."""
        held = cls(checkpoint.step, lambda: checkpoint)
        held._checkpoint = checkpoint
        return held

    @property
    def next_step(self) -> int:
        return self.step + 1

    @property
    def has_replicas(self) -> bool:
        """The replicas themselves are held, not yet taken by a session."""
        return self._replicas is not None and not self._taken

    def checkpoint(self) -> Checkpoint:
        """The state as a checkpoint (copied from the replicas the first time, before a session takes them).

        :raises RuntimeError: when the replicas were taken first (a bug: they
            have moved on since, so the copy would not be of :attr:`step`).
        """
        if self._checkpoint is None:
            if self._taken:
                raise RuntimeError(f"the replicas held at step {self.step} were taken before their checkpoint")
            self._checkpoint = self._capture()
        return self._checkpoint

    def take_replicas(self) -> list[Replica]:
        """The replicas, once, for the next generation's session; their gradients are dropped first (a redone
        step's backward must not add to the interrupted one's)."""
        replicas = self._replicas
        if replicas is None or self._taken:
            raise RuntimeError("no replicas are held, or they were taken already")
        self._taken = True
        for replica in replicas:
            for param in replica.module.parameters():
                param.grad = None
        return replicas

    def put_back(self) -> HeldState:
        """The replicas given back untouched: the session that took them failed to open, before any forward
        (its ranks had agreed on the state, so nothing was broadcast into them either)."""
        self._taken = False
        return self


def hold_replicas(
    actors: Sequence[DeviceActor],
    buffers: BufferSync | None,
    failure: BaseException | None,
    first_step: int,
    finish: Callable[[Checkpoint], Checkpoint],
    *,
    whole: bool,
) -> HeldState | None:
    """What an ended session leaves an elastic run's next generation: its replicas themselves when every local
    one holds the same step whole, their buffers put back as that step left them (an interrupted forward moves
    running statistics on); otherwise ``failure``'s checkpoint; ``None`` when there is neither.

    ``whole``: every thread stopped at teardown (none left behind inside a replica). ``finish`` completes a
    checkpoint taken of the state.
    """
    taken = getattr(failure, "checkpoint", None)
    step = _whole_step(actors, buffers, failure, first_step) if whole else None
    if step is None or buffers is None:
        return None if taken is None else HeldState.of(finish(taken))
    snapshot = None if buffers.empty else buffers.restore(step)
    first = actors[0]
    replicas = [Replica(a.replica, a.optimizer, a.scheduler, a.scaler) for a in actors]

    def capture() -> Checkpoint:
        if isinstance(taken, Checkpoint) and taken.step == step:
            return finish(taken)  # the failure's own, already copied
        return finish(Checkpoint.capture(step, first.replica, first.optimizer, snapshot, scheduler=first.scheduler, scaler=first.scaler))

    return HeldState(step, capture, replicas, snapshot)


def _whole_step(actors: Sequence[DeviceActor], buffers: BufferSync | None, failure: BaseException | None, first_step: int) -> int | None:
    """The step every local replica holds whole, if they all hold one (a sharded replica holds only its shard)."""
    if not actors or buffers is None or actors[0].update.shard is not None:
        return None
    steps = {actor.applied_step for actor in actors}
    if len(steps) != 1 or any(actor.optimizer_dirty for actor in actors):
        return None
    step = steps.pop()
    if step < first_step - 1:
        return None
    moved = failure is not None  # a step was interrupted: its forward may have moved the buffers
    if moved and not buffers.empty and buffers.snapshot(step) is None:
        return None
    return step
