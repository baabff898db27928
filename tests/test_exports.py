"""The public surface: every name in ``__all__`` exists, and nothing public is left out of it."""

from __future__ import annotations

import importlib

import pytest


MODULES = ["gsync", "gsync.comm", "gsync.streams", "gsync.distributed", "gsync.testing", "gsync.errors", "gsync.messages"]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist_and_all_is_a_tuple(name: str) -> None:
    module = importlib.import_module(name)
    assert isinstance(module.__all__, tuple)
    for public in module.__all__:
        assert hasattr(module, public), f"{name}.{public}"


def test_every_error_is_exported_from_the_package() -> None:
    import gsync.errors

    for public in gsync.errors.__all__:
        assert getattr(gsync, public) is getattr(gsync.errors, public)
    assert issubclass(gsync.ConfigError, ValueError) and issubclass(gsync.InputTypeError, TypeError)
    assert issubclass(gsync.SyncTimeout, TimeoutError)
