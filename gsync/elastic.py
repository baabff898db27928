"""Elastic runs: a lost rank is left behind, its step redone over the survivors, and a returning rank taken back.

``Engine(elastic=True)`` (or ``elastic=Elastic(...)``) turns a rank that is
killed, crashes or freezes from the end of the run into a change of its
membership: the survivors agree on who is left, re-form a
``torch.distributed`` group over themselves on the same store, and redo the
interrupted step with the same global batch split over fewer ranks. A rank
started again with the same command joins at the next step boundary and is
sent the state over the group. See ``docs/elastic.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ("Elastic", "MembershipChange")


@dataclass(frozen=True)
class Elastic:
    """How an elastic run changes its membership.

    ``min_world_size``: below this many ranks the run ends, every survivor
    raising :class:`~gsync.PeerLost` with its checkpoint, as a run that is
    not elastic does. ``max_world_size``: how many ranks a run takes in at
    most (``None``: no limit beyond the launch's ``WORLD_SIZE`` ranks and
    whoever joins). ``answer_within``: seconds a membership change waits for
    every member to answer before it goes on without the silent ones. Every
    live member's gsync answers from a thread of its own within milliseconds,
    whatever its training code is doing. A rank that is killed never answers,
    but its closed connections say it is gone: when it is the only silent
    member, the change goes on at once; it waits this long for a frozen rank,
    or while more than one member is silent. Raise it on machines so loaded
    that a process's threads can go unscheduled that long.
    """

    min_world_size: int = 1
    max_world_size: int | None = None
    answer_within: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.min_world_size, bool) or not isinstance(self.min_world_size, int) or self.min_world_size < 1:
            raise ConfigError(f"min_world_size must be a positive int, got {self.min_world_size!r}")
        if self.max_world_size is not None and (
            isinstance(self.max_world_size, bool)
            or not isinstance(self.max_world_size, int)
            or self.max_world_size < self.min_world_size
        ):
            raise ConfigError(
                f"max_world_size must be None or an int >= min_world_size ({self.min_world_size}), "
                f"got {self.max_world_size!r}"
            )
        answer = self.answer_within
        if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not 0 < answer <= 60:
            raise ConfigError(f"answer_within must be a number of seconds in (0, 60], got {answer!r}")

    @classmethod
    def of(cls, setting: object) -> Elastic | None:
        """``Engine(elastic=...)`` checked: ``True`` is the defaults, ``False``/``None`` not elastic.

        :raises ~gsync.ConfigError: for anything else.
        """
        if setting is None or setting is False:
            return None
        if setting is True:
            return cls()
        if isinstance(setting, cls):
            return setting
        raise ConfigError(f"elastic must be True, False or a gsync.Elastic(...), got {setting!r}")


@dataclass(frozen=True)
class MembershipChange:
    """One change of an elastic run's membership, as :attr:`gsync.FitResult.membership` records it.

    Ranks are named by their launch rank (``RANK`` when the process started),
    which they keep across changes. ``step``: the first step the new
    membership applies. ``world_size``: its number of ranks. ``seconds``:
    from the last step applied before the change to the first applied after
    it, as this rank measured (0 until that step is applied). ``reason``:
    ``"lost"`` (ranks stopped answering), ``"left"`` (ranks departed on
    SIGTERM), ``"joined"`` (ranks came in at a step boundary).
    """

    step: int
    lost: tuple[int, ...]
    joined: tuple[int, ...]
    world_size: int
    seconds: float = 0.0
    reason: str = "lost"

    def __str__(self) -> str:
        parts = []
        if self.lost:
            verb = "left" if self.reason == "left" else "lost"
            parts.append(f"{verb} rank(s) {', '.join(map(str, self.lost))}")
        if self.joined:
            parts.append(f"took in rank(s) {', '.join(map(str, self.joined))}")
        return f"membership change at step {self.step}: {' and '.join(parts) or 'no change'}; {self.world_size} rank(s) now"
