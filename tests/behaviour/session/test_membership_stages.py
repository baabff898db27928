"""Where an elastic run's membership change stands, as one value on the session core (``Change``), on a real
session: what each stage makes the session report, and which stage a loss on the way leaves.

The multi-process tests (``tests/multiproc/test_elastic.py``) run the changes end to end; these pin the
bookkeeping they rely on, which used to be three flags on two objects.
"""

from __future__ import annotations

import pytest

import gsync
from gsync._core.base.faults import MembershipBroken
from gsync._core.session.state import Change, SessionState
from tests.support import inside
from tests.support.models import RECIPE, TWO, TiedNet, make_batches


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_planned_change_stays_planned_when_a_member_is_lost_on_the_way() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 31)[0])
    stage = inside.membership_stage(session)
    assert (stage.change, stage.changing, stage.state) == (None, False, SessionState.IDLE)
    inside.end_generation_for_change(session)
    stage = inside.membership_stage(session)
    assert (stage.change, stage.changing, stage.state) == (Change.PLANNED, True, SessionState.CHANGING)
    # Agreed by every rank: the ending generation tells its peers of no departure (their loops did not go apart).
    assert stage.agreed and not stage.due
    # Peers still finishing the agreed step finish it: the change stays the planned one.
    inside.end_generation_for_loss(session)
    assert inside.membership_stage(session).change is Change.PLANNED
    await session.aclose()
    stage = inside.membership_stage(session)
    assert (stage.change, stage.changing, stage.state) == (None, False, SessionState.CLOSED)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_loss_is_a_change_the_session_reports_until_it_ends() -> None:
    session = await gsync.Engine(TWO).session(TiedNet(), **RECIPE)
    await session.step(make_batches(1, 31)[0])
    inside.settle_a_loss(session, MembershipBroken(0, None, "a member was lost"))
    inside.end_generation_for_loss(session)
    stage = inside.membership_stage(session)
    assert (stage.change, stage.changing, stage.state, stage.agreed) == (Change.LOST, True, SessionState.CHANGING, False)
    await session.aclose()
    assert inside.membership_stage(session).change is None
