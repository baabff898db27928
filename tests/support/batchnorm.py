"""Models with BatchNorm layers (1-D and 2-D), their data, and the one-device full-batch reference they must equal."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class NormNet(nn.Module):
    """A BatchNorm1d after a Linear and a BatchNorm2d after a Conv2d, side by side: both kinds, in one forward."""

    def __init__(self, affine: bool = True, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 12)
        self.norm1d = nn.BatchNorm1d(12, affine=affine, momentum=momentum)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.norm2d = nn.BatchNorm2d(3, affine=affine, momentum=momentum)
        self.out = nn.Linear(12 + 3 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.relu(self.norm1d(self.inp(x)))
        image = torch.relu(self.norm2d(self.conv(x.reshape(-1, 1, 4, 4)))).flatten(1)
        return self.out(torch.cat([flat, image], 1))


def synced(model: nn.Module) -> nn.Module:
    """The user's one line: every BatchNorm of a copy of ``model`` as nn.SyncBatchNorm."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))


def norm_batches(steps: int, rows: int | Sequence[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose features are far from zero mean and unit variance, so statistics matter."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [rows] * steps if isinstance(rows, int) else list(rows)
    return [
        (torch.randn(n, 16, generator=generator) * 3 + 2, torch.randint(0, 5, (n,), generator=generator))
        for n in sizes
    ]


def norm_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def norm_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def full_batch_reference(model: nn.Module, steps: Sequence[Sequence[Any]]) -> nn.Module:
    """One device, plain BatchNorm, each step accumulating its batches' mean-loss gradients (as gsync does)."""
    model = copy.deepcopy(model)
    optimizer = norm_sgd(list(model.parameters()))
    for batches in steps:
        optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            (norm_loss(model, batch) / len(batches)).backward()
        optimizer.step()
    return model


def worst_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference over every parameter and buffer (running statistics included), and where."""
    worst, where = 0.0, ""
    for name, value in expected.items():
        gap = float((actual[name].double() - value.double()).abs().max())
        if gap > worst:
            worst, where = gap, name
    return worst, where
