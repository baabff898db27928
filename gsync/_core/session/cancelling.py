"""A cancellation from outside is never lost inside a gsync call, whatever the call raises instead.

asyncio delivers ``Task.cancel()`` once: one ``CancelledError`` at the
task's next await. A gsync call that meets it while it is already failing
(settling a device's error, giving a stuck thread its grace) raises the
failure that came first, and that swallows the one delivery; ``wait_for``,
``asyncio.timeout`` and a plain ``task.cancel()`` then never hear of it,
and the task runs on. (anyio's cancel scopes, and trio, deliver again at
every checkpoint, so only asyncio's own cancellation can be lost: a task
inside a cancelled anyio scope is left to the scope.)

asyncio's rule for who owns a cancellation is the task's ``cancelling()``
count: every request adds one, and only its owner (``asyncio.timeout``, a
``TaskGroup``, an anyio scope) takes it back with ``uncancel()``. So a call
compares the count at its end with the count at its start: more requests
and no ``CancelledError`` leaving the call means one was swallowed inside.
It is re-armed, ``uncancel()`` then ``cancel()``, leaving the count as the
owner expects and the cancellation delivered at the caller's next await,
after the call has raised or returned what it had.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

import anyio

from .outcome import is_cancellation

__all__ = ("cancellation_kept",)

_REDELIVERED = "gsync: a cancellation that arrived while the call ended another way, delivered at the next await"


class cancellation_kept:  # noqa: N801 - used as a function, ``with cancellation_kept(...)``
    """Around a public call: a cancellation requested during it is delivered, if the call did not raise it.

    A cancellation that does leave the call (a notebook interrupt, above
    all) leaves without gsync's own frames, which say only where the session
    was waiting, and with ``note`` added: what the cancellation did to the
    session and how to go on. The user's cell and this call remain in the
    traceback. A class, not a generator: only an ``__exit__`` can drop the
    frames it was raised through.
    """

    __slots__ = ("_note", "_task", "_before")

    def __init__(self, note: str | None = None) -> None:
        self._note = note
        self._task = _current_asyncio_task()
        self._before = 0 if self._task is None else self._task.cancelling()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        if error is not None and is_cancellation(error):
            if not isinstance(error, BaseExceptionGroup):
                error.__traceback__ = None
                if self._note is not None and self._note not in getattr(error, "__notes__", ()):
                    error.add_note(self._note)
            return
        if self._task is not None:
            _redeliver(self._task, self._before)


def _redeliver(task: asyncio.Task[object], before: int) -> None:
    if task.cancelling() <= before or task.done():
        return
    if anyio.current_effective_deadline() == -math.inf:
        # A cancelled anyio scope delivers again by itself, with the reason that tells it the cancellation is its own.
        return
    # The request is its owner's: the count stays as it is, only the delivery is made again.
    task.uncancel()
    task.cancel(_REDELIVERED)


def _current_asyncio_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None  # trio, through anyio: it delivers a cancellation at every checkpoint by itself
