"""The models, batches, loss and optimizers most tests train with, and the devices and bucket sizes they run on."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

TWO = ["cpu:0", "cpu:1"]
"""Two CPU devices in one process: the smallest engine that syncs anything."""

TINY = {"first_bucket_mb": 0.001, "bucket_cap_mb": 0.002}
"""Engine settings for several buckets of a small model, most cut unevenly between devices (parameters split)."""


class TiedNet(nn.Module):
    """A tied weight (two modules share one Parameter), a frozen module, a module
    that is never used, and one used only for some rows (so on some shards only)."""

    def __init__(self, d_in: int = 12, hidden: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.first = nn.Linear(hidden, hidden)
        self.second = nn.Linear(hidden, hidden)
        self.second.weight = self.first.weight
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.never_used = nn.Linear(hidden, hidden)
        self.rare = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.first(h)) + self.frozen(h)
        h = torch.tanh(self.second(h))
        mask = x[:, 0] > 1.2
        if bool(mask.any()):
            h = h.clone()
            h[mask] = h[mask] + self.rare(h[mask])
        return self.head(h)


class Normed(nn.Module):
    """Parameters and BatchNorm buffers: buffers must be broadcast, and checkpoints must get both right."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class Deep(nn.Module):
    """A stack of Linear layers: enough parameters for several buckets at small bucket sizes."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def make_batches(steps: int, rows: int, d_in: int = 12, classes: int = 5, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, d_in, generator=generator), torch.randint(0, classes, (rows,), generator=generator))
        for _ in range(steps)
    ]


def classification_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


RECIPE = {"optimizer": sgd, "loss_fn": classification_loss}
"""The recipe most sessions are opened with: ``engine.session(model, **RECIPE)``."""


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
