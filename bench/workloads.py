"""The benchmark workloads: models, random in-process data, loss and optimizer.

Reference workload (issue 2): MLP 784-2048-2048-2048-10 (10.0M parameters),
global batch 256, SGD(lr=0.01, momentum=0.9), cross-entropy on random data.

Control-plane workload: 100 ``Linear(8, 8)`` in sequence (200 small parameter
tensors) on a tiny batch, so per-step bookkeeping dominates the arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REF_LAYERS = (784, 2048, 2048, 2048, 10)
REF_BATCH = 256
TINY_LAYERS = 100
TINY_WIDTH = 8
TINY_BATCH = 16


def make_mlp(layers: tuple[int, ...] = REF_LAYERS, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(layers[:-1], layers[1:])):
        modules.append(nn.Linear(d_in, d_out))
        if i < len(layers) - 2:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def make_batches(steps: int, batch: int = REF_BATCH, features: int = REF_LAYERS[0], classes: int = REF_LAYERS[-1],
                 distinct: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches, cycling through ``distinct`` random ones (no data loading cost)."""
    generator = torch.Generator().manual_seed(seed)
    pool = [
        (torch.randn(batch, features, generator=generator), torch.randint(0, classes, (batch,), generator=generator))
        for _ in range(min(distinct, max(steps, 1)))
    ]
    return [pool[i % len(pool)] for i in range(steps)]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def make_tiny(layers: int = TINY_LAYERS, width: int = TINY_WIDTH, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def make_tiny_batches(steps: int, rows: int = TINY_BATCH, width: int = TINY_WIDTH, distinct: int = 4,
                      seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    pool = [
        (torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator))
        for _ in range(min(distinct, max(steps, 1)))
    ]
    return [pool[i % len(pool)] for i in range(steps)]


def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def shard(batch: Any, parts: int, index: int) -> Any:
    """The ``index``-th of ``parts`` contiguous shards along dim 0, as gsync and DDP ranks split."""
    x, y = batch
    return torch.tensor_split(x, parts)[index], torch.tensor_split(y, parts)[index]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
