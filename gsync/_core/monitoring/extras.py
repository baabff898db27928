"""Importing an optional dependency, or saying which extra of gsync brings it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ("require",)

EXTRA = "monitoring"


def require(module: str, what: str) -> ModuleType:
    """``module`` imported; :raises ModuleNotFoundError: naming the extra, when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0].replace("_", "-")
        raise ModuleNotFoundError(
            f"{what} needs the {package!r} package, which is not installed: pip install 'gsync[{EXTRA}]'",
            name=error.name,
        ) from error
