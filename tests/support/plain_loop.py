"""The plain one-device PyTorch training loop every comparison is made against.

The tests' reference (``tests.support.reference.train_reference``: the result gsync must
reproduce), the benchmarks' one-process baseline (``bench/baselines.py``) and the GPU check's
plain loop (``tools/gpu_check.py``) all run this loop, so "plain PyTorch" means one thing.
Imports only torch; ``bench/`` and ``tools/`` import it as ``tests.support.plain_loop`` from the
repository root (they import nothing else of tests/ but the harness).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ("train_steps",)


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    read_loss: bool = True,
    before_step: Callable[[int], object] | None = None,
) -> list[float]:
    """One optimizer step per batch: ``zero_grad(set_to_none=True)``, ``loss_fn(model, batch)``, backward, step.

    Returns each step's loss (``loss.item()``, which waits for the device, as gsync's
    recorded losses do); with ``read_loss=False`` nothing is read and nothing waited for.
    ``before_step(index)`` is called before each step (timers, a device synchronize).
    """
    losses: list[float] = []
    for index, batch in enumerate(batches):
        if before_step is not None:
            before_step(index)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        if read_loss:
            losses.append(loss.item())
    return losses
