"""Moved to ``tests/support/harness.py``; kept only for ``bench/elastic.py``, which imports ``free_port`` from
here. Import ``tests.support.harness`` instead; this file goes once bench/elastic.py does."""

from tests.support.harness import free_port

__all__ = ("free_port",)
