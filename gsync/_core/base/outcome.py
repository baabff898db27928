"""Turning however a fit's task group ended into the one exception ``fit`` raises."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import anyio

from ..threads import FitAborted
from ...errors import ConfigError, FitError, GsyncError, InputTypeError

__all__ = ("first_failure", "flatten", "is_cancellation", "raised_by_block")


def flatten(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found.extend(flatten(error))
        else:
            found.append(error)
    return found


def first_failure(group: BaseExceptionGroup[Any], late: Sequence[GsyncError] = ()) -> BaseException:
    """Pick the one exception ``fit`` raises out of everything the task group collected.

    Bad input comes first (it is the root cause of anything that followed);
    then gsync's failures by time, the earliest carrying the others; then
    anything else (a bug, or a cancellation). ``late`` are failures recorded
    by devices whose tasks were cancelled before they could raise them.
    """
    # FitAborted is how peers stop once one device failed: never the root cause.
    errors = [e for e in flatten(group) if not isinstance(e, (anyio.get_cancelled_exc_class(), FitAborted))]
    errors += [e for e in late if all(e is not seen for seen in errors)]
    if not errors:
        # Nothing but cancellations and aborts: one of them, never a group (logged or raised, a group names nothing).
        flat = flatten(group)
        return flat[0] if flat else group
    for error in errors:
        if isinstance(error, (ConfigError, InputTypeError)):
            return error
    failures = sorted((e for e in errors if isinstance(e, FitError)), key=lambda e: e.at)
    if failures:
        first, others = failures[0], tuple(failures[1:])
        first.others = others
        for other in others:
            first.add_note(f"also failed: {other}")
        return first
    gsync_errors = [e for e in errors if isinstance(e, GsyncError)]
    return (gsync_errors or errors)[0]


def is_cancellation(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation, or a group of nothing but cancellations (asked outside any async library,
    as the end of a session is told when it is dropped: asyncio's)."""
    if isinstance(error, BaseExceptionGroup):
        return all(is_cancellation(e) for e in error.exceptions)
    if isinstance(error, asyncio.CancelledError):
        return True
    try:
        return isinstance(error, anyio.get_cancelled_exc_class())
    except RuntimeError:  # no async library running (anyio's NoEventLoopError; sniffio's, before anyio 4.10)
        return False


def raised_by_block(errors: BaseExceptionGroup[Any], failure: BaseException | None) -> BaseException:
    """What a session's ``async with`` raises when its task group collected ``errors``.

    The session's own ``failure`` if it had one (the user's code was
    cancelled because of it); else the user's exception, unchanged; else a
    cancellation.
    """
    flat = flatten(errors)
    if failure is not None and any(e is failure for e in flat):
        return failure
    for error in flat:
        if not is_cancellation(error):
            return error
    if failure is not None:
        return failure
    return flat[0] if flat else errors
