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
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from .outcome import is_cancellation

__all__ = ("cancellation_kept",)

_REDELIVERED = "gsync: a cancellation that arrived while the call ended another way, delivered at the next await"


@contextmanager
def cancellation_kept() -> Iterator[None]:
    """Around a public call: a cancellation requested during it is delivered, if the call did not raise it."""
    task = _current_asyncio_task()
    if task is None:
        yield
        return
    before = task.cancelling()
    try:
        yield
    except BaseException as error:
        if not is_cancellation(error):
            _redeliver(task, before)
        raise
    else:
        _redeliver(task, before)


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
