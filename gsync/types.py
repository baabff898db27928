"""The types of the callables you hand gsync: what each is called with, and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ("LossFn", "MetricFn", "OptimizerFactory", "SchedulerFactory")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, shard) -> scalar tensor``: the mean loss of one device's shard of a global batch."""
OptimizerFactory = (
    Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    | Callable[[nn.Module], torch.optim.Optimizer]
    | Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
)
"""``optimizer(params) -> Optimizer``, called once per replica with the parameters it trains; or, by the name of
its first parameter, ``optimizer(model)`` (``model`` or ``module``) with the replica itself, or
``optimizer(named_parameters)`` (or ``named_params``) with the trainable ``(name, parameter)`` pairs."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""``scheduler(optimizer) -> LRScheduler``, called once per replica with that replica's optimizer."""
MetricFn = Callable[[nn.Module, Any], Any]
"""``metric_fn(model, shard) -> scalar or dict of scalars``, for :meth:`gsync.Session.evaluate`."""
