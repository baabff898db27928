"""A device's share of an evaluation: the metric function on its shard, in eval mode, without gradients."""

from __future__ import annotations

import numbers
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..data.batches import move_batch
from ...errors import InputTypeError
from ...types import MetricFn

__all__ = ("MetricFn", "evaluate_shard")


def evaluate_shard(
    replica: nn.Module,
    device: torch.device,
    name: str,
    data: Any,
    rows: int,
    metric_fn: MetricFn,
    autocast: AbstractContextManager[Any],
) -> dict[str, float]:
    """``metric_fn`` on the shard ``data`` of device ``name``; each value times ``rows``. Every module's
    training flag is restored after it, whatever the function did to it."""
    modes = [(module, module.training) for module in replica.modules()]
    replica.eval()
    try:
        with torch.no_grad(), autocast:
            value = metric_fn(replica, move_batch(data, device))
    finally:
        for module, training in modes:
            module.training = training
    return {key: _scalar(metric) * rows for key, metric in _metrics(value, metric_fn, name).items()}


def _scalar(metric: Any) -> float:
    # .item() reads a one-element tensor or array whatever its shape (float() takes 0-d arrays only).
    item = getattr(metric, "item", None)
    return float(item() if callable(item) else metric)


def _metrics(value: Any, metric_fn: MetricFn, device: str) -> dict[str, Any]:
    """A metric function's result as a dict of scalars: a dict as is, a scalar under the function's name."""
    if isinstance(value, dict):
        metrics = value
    else:
        name = getattr(metric_fn, "__name__", "metric")
        metrics = {"metric" if name == "<lambda>" else name: value}
    for name, metric in metrics.items():
        if not isinstance(name, str):
            # Across processes the names are exchanged as strings; one process must not accept what many refuse.
            raise InputTypeError(
                f"the metric function returned the key {name!r} ({type(name).__name__}) on {device}; "
                "metric names must be str"
            )
        if isinstance(metric, torch.Tensor) and metric.numel() == 1:
            continue
        if isinstance(metric, numbers.Real):  # int, float, bool (a fraction of rows), NumPy's scalars
            continue
        # A one-element NumPy array (np.mean(..., keepdims=True)) is as much a scalar as a one-element tensor.
        if getattr(metric, "size", None) == 1 and callable(getattr(metric, "item", None)):
            if isinstance(metric.item(), numbers.Real):
                continue
        raise InputTypeError(
            f"the metric function returned {type(metric).__name__} for {name!r} on {device}; "
            "it must return a scalar (a number, a NumPy scalar or a one-element tensor) or a dict of scalars"
        )
    return metrics
