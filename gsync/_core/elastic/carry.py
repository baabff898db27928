"""Where a rank's loop is between two steps, so that a membership change cannot leave the members' loops apart.

A change can interrupt an evaluation or an all_reduce in its last
collective: a member whose collective completed holds the result and goes
on to its next call, while one whose collective was aborted (a change aborts
every member's collectives) redoes the operation over the new membership.
There its collectives would meet the other member's next call's. So each
member keeps how many operations it completed since the last step applied,
and a copy of the last one's result; when the new membership forms the
members compare (:func:`~gsync._core.elastic.handover.agree_state`), and a
member exactly one operation behind is handed the result instead of redoing
it. That is also the value every member that completed it holds: it counts
the lost member's share, which a redo over the survivors would not.

A member cannot be further behind: the member ahead completed its last
operation's collectives with every other member taking part, so each had
returned from the call before it. The log is written on the event loop when
a call returns and read and handed to by the change's thread while the
session's calls wait for the new membership, never both at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError

__all__ = ("OperationLog",)


@dataclass(frozen=True)
class _Handed:
    after: int
    number: int
    kind: str
    result: Any


class OperationLog:
    """One process's operations (evaluations, all_reduces) since its last applied step, across an elastic run."""

    def __init__(self) -> None:
        self._after = -1
        self._done = 0
        self._last: tuple[str, Any] | None = None
        self._handed: _Handed | None = None

    def position(self, step: int) -> int:
        """How many operations this process completed after step ``step``."""
        return self._done if self._after == step else 0

    def completed(self, after: int, kind: str, result: Any) -> None:
        """An operation of ``kind`` returned ``result`` after step ``after``; a copy of it is kept (the caller may
        change what it was given), where it is: a GPU tensor is copied on its device, with no wait for it here."""
        if after != self._after:
            self._after, self._done = after, 0
        self._done += 1
        self._last = (kind, _copied(result))

    def last(self, step: int) -> tuple[str, Any]:
        """The kind and result of the last operation completed after step ``step``."""
        if self._last is None or self.position(step) == 0:
            raise RuntimeError(f"no operation was completed after step {step}: there is no result to hand over")
        return self._last

    def hand(self, after: int, number: int, kind: str, result: Any) -> None:
        """Another member completed operation ``number`` (from 1) after step ``after``: this process takes its
        ``result`` where it would redo that operation."""
        if self.position(after) < number:
            self._handed = _Handed(after, number, kind, result)

    def take(self, after: int, kind: str) -> tuple[bool, Any]:
        """``(True, result)`` when this process's next operation, ``kind`` after step ``after``, was handed one.

        :raises ~gsync.ConfigError: when the member that completed it called another operation there: the
            ranks' loops differ.
        """
        handed = self._handed
        if handed is None:
            return False, None
        number = self.position(after) + 1
        if (after, number) != (handed.after, handed.number):
            if (after, number) > (handed.after, handed.number):
                self._handed = None  # this loop went past it
            return False, None
        self._handed = None
        if kind != handed.kind:
            raise ConfigError(
                f"this rank called {kind} after step {after} where the other members called {handed.kind}; "
                "every rank must run the same loop"
            )
        return True, handed.result  # read from the bytes sent: nothing else holds it


def _copied(result: Any) -> Any:
    """``result`` (what an operation's ``run`` returned: an evaluation's metric names and sums, an all_reduce's
    number or tensor) as a copy nothing else holds."""
    if isinstance(result, torch.Tensor):
        return result.detach().clone()
    if isinstance(result, dict):
        return {key: _copied(value) for key, value in result.items()}
    if isinstance(result, (tuple, list)):
        return type(result)(_copied(value) for value in result)
    return result
