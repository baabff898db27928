"""Where the repository is, for tests that run its examples, notebook and scripts (wherever the test file sits)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: ``gsync/``, ``examples/``, ``tests/``."""
