"""The public surface, both ways: every name in ``__all__`` exists, nothing public is left out of it, and every
public object lives in a public module (the implementation is in ``gsync._core``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import gsync

PUBLIC = [
    "gsync",
    "gsync.checkpoint",
    "gsync.comm",
    "gsync.comm.base",
    "gsync.comm.compressed",
    "gsync.comm.local",
    "gsync.engine",
    "gsync.errors",
    "gsync.result",
    "gsync.session",
    "gsync.testing",
    "gsync.trace",
    "gsync.elastic",
    "gsync.types",
]
# Re-exported at the top as well; gsync.testing is a namespace of its own (gsync.testing.fail, ...).
NOT_AT_THE_TOP = {"gsync.testing"}
# Public modules' helpers that are gsync's own (named without an underscore for its other modules).
INTERNAL_HELPERS = {
    "gsync.checkpoint": {"restore_checkpoint_rng"},
    "gsync.comm.compressed": {"CompressedCollective", "resolve_compression"},
    "gsync.trace": {"finish_trace", "rank_file", "trace_setting"},
}


def test_every_module_is_public_by_this_list_or_private_by_its_name() -> None:
    found = {info.name for info in pkgutil.walk_packages(gsync.__path__, "gsync.")}
    private = {name for name in found if any(part.startswith("_") for part in name.split(".")[1:])}
    assert found - private == set(PUBLIC) - {"gsync"}, "a module is neither listed public here nor underscored"


@pytest.mark.parametrize("name", PUBLIC)
def test_all_names_exist_and_all_is_a_tuple(name: str) -> None:
    module = importlib.import_module(name)
    assert isinstance(module.__all__, tuple)
    for public in module.__all__:
        assert hasattr(module, public), f"{name}.{public}"


@pytest.mark.parametrize("name", PUBLIC)
def test_nothing_public_is_left_out_of_all(name: str) -> None:
    module = importlib.import_module(name)
    defined_here = {
        attribute
        for attribute, value in vars(module).items()
        if not attribute.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == name
    }
    missing = defined_here - set(module.__all__) - INTERNAL_HELPERS.get(name, set())
    assert not missing, f"{name} defines {sorted(missing)} without listing them in __all__"


@pytest.mark.parametrize("name", sorted(set(PUBLIC) - NOT_AT_THE_TOP - {"gsync"}))
def test_every_public_name_is_importable_from_the_package(name: str) -> None:
    module = importlib.import_module(name)
    for public in module.__all__:
        assert public in gsync.__all__ and getattr(gsync, public) is getattr(module, public), f"gsync.{public}"


def test_every_public_object_lives_in_a_public_module() -> None:
    for public in gsync.__all__:
        value = getattr(gsync, public)
        where = getattr(value, "__module__", None) if (inspect.isclass(value) or inspect.isfunction(value)) else None
        assert where is None or not where.startswith("gsync._core"), f"gsync.{public} is defined in {where}"


def test_every_error_is_exported_from_the_package() -> None:
    import gsync.errors

    for public in gsync.errors.__all__:
        assert getattr(gsync, public) is getattr(gsync.errors, public)
    assert issubclass(gsync.ConfigError, ValueError) and issubclass(gsync.InputTypeError, TypeError)
    assert issubclass(gsync.SyncTimeout, TimeoutError)
