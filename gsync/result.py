"""What a ``fit`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .checkpoint import Checkpoint
from .trace import Trace

__all__ = ("FitResult", "FitStats")


@dataclass
class FitStats:
    """Counters of one ``fit``, for tests and benchmarks."""

    steps: int = 0
    buckets: int = 0
    bucket_ready_messages: int = 0
    bucket_sizes: tuple[int, ...] = ()
    bucket_params: tuple[tuple[str, ...], ...] = ()
    """Parameter names per bucket, in layout order, of the plan the fit ended with."""
    rebuilt_buckets: bool = False
    """Whether the plan was rebuilt from the gradient order observed in the first step."""


@dataclass
class FitResult:
    model: nn.Module
    """The module passed to ``fit``, holding the trained parameters and buffers."""
    losses: list[float]
    """The global mean loss of each optimizer step this fit ran (from ``first_step`` on)."""
    first_step: int = 0
    """The global index of the first step this fit ran (> 0 when resuming)."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps left out because a loss was not finite (``on_nonfinite="skip"``)."""
    checkpoint: Checkpoint | None = None
    """The final state, to continue training later with ``fit(..., resume=checkpoint)``."""
    stats: FitStats = field(default_factory=FitStats)
    trace: Trace | None = None
    """The timeline of the fit, when the engine was built with ``trace=True``."""
