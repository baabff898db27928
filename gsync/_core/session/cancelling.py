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
The call then raises ``CancelledError`` itself, at its end, with what it
would have raised as the ``__context__``: delivered there, inside the
owner's block, the owner recognises it (``asyncio.timeout`` turns it into
its ``TimeoutError``, a ``TaskGroup`` absorbs it). Re-arming it for the
caller's next ``await`` instead would deliver it after the owner may
have taken its request back (the call the last ``await`` of the block), to
a task nobody means to cancel.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

import anyio

from ..base.outcome import is_cancellation
from ...errors import _drop_internal_frames

__all__ = ("cancellation_kept",)

_DELIVERED = "gsync: a cancellation that arrived while the call was ending another way (its error is the context)"


class cancellation_kept:  # noqa: N801 - used as a function, ``with cancellation_kept(...)``
    """Around a public call: a cancellation requested during it leaves it, if the call would have ended otherwise.

    A cancellation that does leave the call (a notebook interrupt, above
    all) leaves without the frames it was raised through, gsync's (which say
    only where the session was waiting) and the call's own, and with
    ``note`` added: what the cancellation did to the session and how to go
    on. The traceback starts at the caller's line (the user's cell). A
    class, not a generator: only an ``__exit__`` can drop those frames.
    """

    __slots__ = ("_note", "_task", "_before")

    def __init__(self, note: str | None = None) -> None:
        self._note = note
        self._task = _current_asyncio_task()
        self._before = 0 if self._task is None else self._task.cancelling()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        _drop_internal_frames(error)  # a user-caused error starts at the caller's line too
        if error is not None and is_cancellation(error):
            self._annotate(error)
            return
        if self._task is not None and _swallowed(self._task, self._before):
            cancelled = asyncio.CancelledError(_DELIVERED)
            cancelled.__context__ = error
            self._annotate(cancelled)
            raise cancelled

    def _annotate(self, cancellation: BaseException) -> None:
        if isinstance(cancellation, BaseExceptionGroup):
            return
        cancellation.__traceback__ = None
        if self._note is not None and self._note not in getattr(cancellation, "__notes__", ()):
            cancellation.add_note(self._note)


def _swallowed(task: asyncio.Task[object], before: int) -> bool:
    """Whether a cancellation was requested during the call and never left it (one an owner still counts)."""
    if task.cancelling() <= before or task.done():
        return False
    # A cancelled anyio scope delivers again by itself, with the reason that tells it the cancellation is its own.
    return anyio.current_effective_deadline() != -math.inf


def _current_asyncio_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None  # trio, through anyio: it delivers a cancellation at every checkpoint by itself
