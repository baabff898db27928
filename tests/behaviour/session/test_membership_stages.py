"""Where an elastic run's membership change stands, as one value on the session core (``Change``), on a real
session: what each stage makes the session report, and which stage a loss on the way leaves.

The multi-process tests (``tests/multiproc/test_elastic.py``) run the changes end to end; these pin the
bookkeeping they rely on, which used to be three flags on two objects.
"""

from __future__ import annotations

from typing import Any

import pytest

import gsync
from gsync._core.base.faults import MembershipBroken
from gsync._core.session.state import Change, SessionState
from tests.support import inside
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd

RECIPE: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_planned_change_stays_planned_when_a_member_is_lost_on_the_way() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 31)[0])
    core = inside.core_of(session)
    assert (core.change, core.changing, core.state) == (None, False, SessionState.IDLE)
    core.end_for_change()
    assert (core.change, core.changing, core.state) == (Change.PLANNED, True, SessionState.CHANGING)
    # Agreed by every rank: the ending generation tells its peers of no departure (their loops did not go apart).
    assert core.change_agreed and not core.change_due
    # Peers still finishing the agreed step finish it: the change stays the planned one.
    core.lost_generation()
    assert core.change is Change.PLANNED
    await session.aclose()
    assert (core.change, core.changing, core.state) == (None, False, SessionState.CLOSED)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_loss_is_a_change_the_session_reports_until_it_ends() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 31)[0])
    core = inside.core_of(session)
    core.life.fail(MembershipBroken(0, None, "a member was lost"))
    core.lost_generation()
    assert (core.change, core.changing, core.state, core.change_agreed) == (Change.LOST, True, SessionState.CHANGING, False)
    await session.aclose()
    assert core.change is None
