"""Checks on what a run leaves behind on the event loop."""

from __future__ import annotations

import asyncio


def assert_no_tasks_left() -> None:
    current = asyncio.current_task()
    assert {t for t in asyncio.all_tasks() if t is not current} == set()
