"""The hyperparameters a run's loggers receive once, at its start: the settings that change what it trains."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ("optimizer_hyperparams", "run_hyperparams")

# Scalar settings of the first parameter group that describe an optimizer (lr, momentum, betas, ...).
_SCALARS = (bool, int, float, str)


def _name(value: object) -> str:
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def run_hyperparams(
    engine: Any, model: Any, recipe: Mapping[str, Any], fit: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Flat, scalar-valued: the engine's settings, the model, the recipe and ``fit``'s loop arguments.

    ``engine`` is read by attribute (an :class:`gsync.Engine`); a setting left unset (``None``) is left out.
    """
    params: dict[str, Any] = {
        "devices": ",".join(getattr(spec, "name", str(spec)) for spec in engine.devices),
        "bucket_cap_mb": engine.bucket_cap_mb,
        "first_bucket_mb": engine.first_bucket_mb,
        "sync_timeout": engine.sync_timeout,
        "on_nonfinite": engine.on_nonfinite,
        "device_threads": engine.device_threads,
        "compression": None if engine.compression is None else repr(engine.compression),
        "shard_optimizer": engine.shard_optimizer,
        "elastic": engine.elastic is not None,
        "model": type(model).__qualname__,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    for key, value in recipe.items():
        if value is None or isinstance(value, _SCALARS):
            params[key] = value
        else:  # a factory is named by its function or class; a dtype by itself
            params[key] = _name(value) if callable(value) else str(value)
    if fit is not None:
        params.update(fit)
    return {key: value for key, value in params.items() if value is not None}


def optimizer_hyperparams(optimizer: Any) -> dict[str, Any]:
    """``optimizer`` (its class) and ``optimizer/<setting>`` for each scalar setting of its first group."""
    params: dict[str, Any] = {"optimizer": type(optimizer).__qualname__}
    groups = getattr(optimizer, "param_groups", ())
    if groups:
        for key, value in groups[0].items():
            if key != "params" and isinstance(value, _SCALARS):
                params[f"optimizer/{key}"] = value
    return params
