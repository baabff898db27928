"""Leaving an elastic run on purpose: SIGTERM (a preemption, a launcher tearing down) makes a rank depart.

The rank finishes the step in flight; the next step's agreement tells every
rank to change after it, and this one leaves in that change as a departure,
so the others go on at once instead of waiting out a silence. Its call then
raises :class:`~gsync.Departed` with its checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from ...checkpoint import Checkpoint
from ...errors import Departed
from .membership import ElasticMembership

__all__ = ("departed", "on_sigterm_depart")


def on_sigterm_depart(elastic: ElasticMembership, runtime: Callable[[], Any]) -> Callable[[], None]:
    """Handle SIGTERM (on the main thread only: elsewhere nothing is installed) until the returned undo is called.

    ``runtime()`` is the current generation's runtime, or ``None``: its next
    step's agreement carries the wish to change.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    received: list[int] = []

    def depart(signum: int, frame: object) -> None:
        received.append(signum)
        elastic.depart_soon()
        current = runtime()
        if current is not None:
            current.want_change()  # the next step's agreement tells every rank

    previous = signal.signal(signal.SIGTERM, depart)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)
        if received and not elastic.departed:
            # It came when no step followed to leave after (the session's last, or between sessions): it is
            # not swallowed, but delivered as it would have been without the session.
            signal.raise_signal(signal.SIGTERM)

    return undo


def departed(elastic: ElasticMembership, checkpoint: Checkpoint | None) -> Departed:
    """The error a departed rank's call raises, with the state of its last step."""
    if checkpoint is None:
        return Departed(f"rank {elastic.launch_rank} left the elastic run on SIGTERM before its first step; the others go on without it")
    error = Departed(
        f"rank {elastic.launch_rank} left the elastic run after step {checkpoint.step} on SIGTERM; the others go "
        "on without it (its checkpoint holds the state of that step)"
    )
    error.checkpoint = checkpoint
    error.last_step = checkpoint.step
    return error
