"""Ranks played by threads of one process: each joins the same gloo group over an in-process store, so a unit test
runs a collective without starting processes (``tests/support/harness.py`` starts real ones)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ("in_rank_threads",)


def in_rank_threads(fn: Callable[[int], Any], world_size: int = 2, timeout: float = 30.0) -> list[Any]:
    """``fn(rank)`` for each rank, each in a thread of its own; each rank's result, or the exception it raised.

    :raises AssertionError: when a rank has not returned within ``timeout`` (still inside a collective).
    """
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - the caller reads it
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a rank is still inside a collective"
    return results
