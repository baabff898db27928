"""What gsync must reproduce: plain one-device training on the whole global batch, and the checks against it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tests.support.models import classification_loss, sgd
from tests.support.plain_loop import train_steps


def train_reference(
    model: nn.Module,
    batches: Sequence[Any],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = sgd,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = classification_loss,
) -> tuple[nn.Module, list[float]]:
    """Plain one-device full-batch training: the result gsync must reproduce."""
    model = copy.deepcopy(model)
    losses = train_steps(model, optimizer([p for p in model.parameters() if p.requires_grad]), batches, loss_fn)
    return model, losses


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, by name, that later training does not change."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_state(actual: nn.Module, expected: nn.Module, atol: float = 2e-5) -> None:
    expected_state = expected.state_dict()
    for name, value in actual.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_optimizer_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two optimizer state dicts (a gathered one, a whole one) hold the same groups, and the same state to 1e-5."""
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for key, values in expected["state"].items():
        assert actual["state"][key].keys() == values.keys(), key
        for name, value in values.items():
            got = actual["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert got.shape == value.shape and got.dtype == value.dtype, (key, name)
                torch.testing.assert_close(got, value, atol=1e-5, rtol=0)
            else:
                assert got == value, (key, name)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def plain_loop(
    model: nn.Module,
    steps: Sequence[Sequence[Any]],
    *,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = sgd,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    clip: float | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[nn.Module, list[float], list[float], list[float]]:
    """The recipe as a plain loop: each step accumulates its batches' mean-loss gradients (divided by their count)."""
    model = copy.deepcopy(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    sched = scheduler(opt) if scheduler is not None else None
    losses, lrs, norms = [], [], []
    for batches in steps:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:
            with torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False):
                loss = classification_loss(model, batch)
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        lrs.append(opt.param_groups[0]["lr"])
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(total)
    return model, losses, lrs, norms
