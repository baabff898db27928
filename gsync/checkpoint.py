"""The last consistent state of a ``fit``, kept so a failure loses nothing.

gsync does not copy state at every step. The optimizer only steps after a
step's reduction completed on every device, so at any moment each replica
whose optimizer is not mid-step holds the state after some fully reduced step:
when ``fit`` fails, the engine takes the checkpoint from the most advanced such
replica. Buffers (BatchNorm statistics) change during forward, so they come
from the snapshot the buffer broadcast of that step already made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ("Checkpoint",)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    """The last step whose update this state includes; -1 for the state before the first step."""
    model_state: dict[str, torch.Tensor]
    """``state_dict()`` of the model after ``step``; load it with ``model.load_state_dict``."""
    optimizer_state: dict[str, Any]
    """``state_dict()`` of one replica's optimizer after ``step`` (all replicas' are equal)."""
    scheduler_state: dict[str, Any] | None = None
    """``state_dict()`` of the LR scheduler after ``step``, when the run has one."""
    scaler_state: dict[str, Any] | None = None
    """``state_dict()`` of the float16 ``GradScaler`` after ``step``, when the run has one."""

    @property
    def next_step(self) -> int:
        return self.step + 1

    @classmethod
    def capture(
        cls,
        step: int,
        replica: nn.Module,
        optimizer: torch.optim.Optimizer,
        buffers: dict[str, torch.Tensor] | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Checkpoint:
        """Copy a replica's state to the CPU, with ``buffers`` (name -> tensor) replacing its own."""
        state = {name: value.detach().to("cpu", copy=True) for name, value in replica.state_dict().items()}
        for name, value in (buffers or {}).items():
            if name in state:
                state[name] = value.detach().to("cpu", copy=True)
        # Copied straight to the CPU: a failure caused by device memory
        # pressure must still be able to take its checkpoint.
        return cls(
            step,
            state,
            _to_cpu(optimizer.state_dict()),
            None if scheduler is None else _to_cpu(scheduler.state_dict()),
            None if scaler is None else _to_cpu(scaler.state_dict()),
        )


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
