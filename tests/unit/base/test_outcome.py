"""The one exception a session's task group turns into, however its tasks ended."""

from __future__ import annotations

import anyio
import pytest

import gsync
from gsync._core.base.outcome import first_failure, raised_by_block
from gsync._core.threads import FitAborted

# anyio names the cancellation class of the library running the loop: each test runs on one.
pytestmark = pytest.mark.asyncio


async def test_a_group_of_nothing_but_aborts_and_cancellations_gives_one_of_them_not_a_group() -> None:
    """A nested group of aborted devices used to come back as the group itself, and be logged as a close error."""
    cancelled = anyio.get_cancelled_exc_class()
    group = BaseExceptionGroup("serve", [BaseExceptionGroup("work", [FitAborted(), FitAborted()]), cancelled()])
    picked = first_failure(group)
    assert not isinstance(picked, BaseExceptionGroup)
    assert isinstance(picked, FitAborted)


async def test_the_earliest_gsync_failure_is_picked_and_carries_the_others() -> None:
    early = gsync.WorkerFailed("cpu:0", 0, 2, "forward")  # failures are ordered by when they were made
    late = gsync.WorkerFailed("cpu:1", 1, 3, "backward")
    picked = first_failure(BaseExceptionGroup("work", [late, early, FitAborted()]))
    assert picked is early
    assert picked.others == (late,)


async def test_a_block_that_raised_its_own_error_gets_it_back_unchanged() -> None:
    error = KeyError("the user's")
    assert raised_by_block(BaseExceptionGroup("block", [anyio.get_cancelled_exc_class()(), error]), None) is error


@pytest.mark.parametrize("failure_first", [True, False])
async def test_a_block_cancelled_because_the_session_failed_raises_that_failure(failure_first: bool) -> None:
    failure = gsync.SyncFailed(3, 0, "reduction")
    parts = [failure, anyio.get_cancelled_exc_class()()]
    if not failure_first:
        parts.reverse()
    assert raised_by_block(BaseExceptionGroup("block", parts), failure) is failure
