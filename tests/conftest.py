"""The suite's pytest wiring: gsync's own plugin and the fixtures every part of the suite may name.

Helpers (models, the reference loop, rigs, the multi-process harness) live in ``tests/support/`` and are imported
from there; nothing imports this file.
"""

from __future__ import annotations

import pytest

# gsync's own plugin (the one users get through its pytest11 entry point) checks every test of this suite for
# threads and tasks left running, and gives tests gsync_engine and gsync_faults. Named here too, so the suite has
# it without the entry point as well (the same name: loaded once either way).
pytest_plugins = ("gsync_pytest",)


@pytest.fixture
def no_leaks() -> None:
    """The plugin's leak check runs for every test; tests that name this fixture say so out loud."""
