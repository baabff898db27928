"""What a ``fit`` returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .checkpoint import Checkpoint
from .elastic import MembershipChange
from .trace import Trace

__all__ = ("Evaluation", "FitResult", "FitStats", "StepRecord", "StepResult")


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
    reduced_bytes: int = 0
    """Bytes of gradient buckets all-reduced, per device (accumulating steps reduce once per step); with
    ``Engine(compression=...)``, the compressed payload's bytes, as they cross the process group. 0 when the
    run has one device in all: there is nothing to reduce."""


@dataclass(frozen=True)
class StepRecord:
    """One step of a fit, for plotting a run: ``FitResult.history``."""

    step: int
    epoch: int
    loss: float
    lr: float
    """The learning rate the step used."""
    rows: int
    """Rows in the step's global batches."""
    seconds: float
    """Wall time of the step."""
    skipped: bool = False
    grad_norm: float | None = None
    """The reduced gradient's total norm before clipping, when ``clip_grad_norm`` is set."""
    lrs: tuple[float, ...] = ()
    """The learning rate of every parameter group, in the optimizer's order (``lr`` is the first's)."""

    def __post_init__(self) -> None:
        if not self.lrs:  # built with one learning rate only, as before lrs existed
            object.__setattr__(self, "lrs", (self.lr,))


@dataclass(frozen=True)
class Evaluation:
    """One validation inside a fit (``fit(val_data=..., eval_every=N)``): ``FitResult.evaluations`` and the
    ``on_evaluate(session, evaluation)`` callbacks get these."""

    step: int
    """The last step trained before it: the model evaluated is the one after this step."""
    metrics: dict[str, float]
    """What ``session.evaluate(val_data, metric_fn=val_metric_fn)`` returned (``{"loss": ...}`` without one)."""
    best: bool = False
    """With ``keep_best``: this evaluation is the best so far by that metric, so its checkpoint is the ``best.pt`` file."""


@dataclass
class FitResult:
    """What a ``fit`` returns: the trained model, each step's loss and record, the final checkpoint."""

    model: nn.Module
    """The module passed to ``fit``, holding the trained parameters and buffers."""
    losses: list[float]
    """The global mean loss of each optimizer step this fit ran (from ``first_step`` on)."""
    first_step: int = 0
    """The global index of the first step this fit ran (> 0 when resuming)."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose update was left out: a loss was not finite (``on_nonfinite="skip"``) or the GradScaler found infs."""
    checkpoint: Checkpoint | None = None
    """The final state, to continue training later with ``fit(..., resume=checkpoint)``."""
    stats: FitStats = field(default_factory=FitStats)
    trace: Trace | None = None
    """The timeline of the fit, when the engine was built with ``trace=True`` (or a ``Trace``, or a file path)."""
    history: list[StepRecord] = field(default_factory=list)
    """One record per step this fit ran: step, epoch, loss, lr, rows, seconds, skipped, grad_norm, lrs."""
    membership: tuple[MembershipChange, ...] = ()
    """Every change of an elastic run's membership during this fit (``Engine(elastic=...)``), first first."""
    evaluations: list[Evaluation] = field(default_factory=list)
    """One :class:`Evaluation` per validation this fit ran (``val_data=``), in step order; empty without ``val_data``."""

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Loss and learning rate over steps, step time with its exposed communication (when traced) and each
        device's time per phase; membership changes marked. Needs matplotlib (``pip install 'gsync[monitoring]'``).

        :param path: write the picture there (its suffix picks the format: ``.png``, ``.svg``, ``.pdf``).
        :returns: the ``matplotlib.figure.Figure``; in a notebook with no ``path``, it is shown inline instead
            (and ``None`` returned, so the cell does not show it twice).
        """
        from ._core.monitoring.display import show_or_return
        from ._core.monitoring.plotting import draw
        from ._core.monitoring.series import series_of_fit

        title = f"gsync fit: steps {self.first_step} to {self.first_step + len(self.history) - 1}"
        figure = draw(series_of_fit(self.history, self.trace, self.membership, title), path)
        return figure if path is not None else show_or_return(figure)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    step: int
    """The step's 0-based global index."""
    loss: float
    """The global mean loss (over every device of every process; the mean over the batches when accumulating)."""
    lr: float
    """The learning rate this step used (the first parameter group's, before the scheduler stepped; ``lrs`` has
    every group's)."""
    rows: int
    """Rows in the step's global batches, over every process. 0 in a session that joins uneven data
    (``uneven="join"``) when no rank had a batch: nothing was trained, and every rank's data has ended (``step`` is
    then the index the next step will have, ``loss`` and ``lr`` NaN)."""
    seconds: float
    """Wall time of the step, from dispatch until every local replica applied it."""
    grad_norm: float | None = None
    """The reduced gradient's total norm before clipping, when ``clip_grad_norm`` is set."""
    skipped: bool = False
    """The update was left out: a loss was not finite (``on_nonfinite="skip"``) or the GradScaler found infs."""
    world_size: int = 1
    """The number of processes that took part in the step (an elastic run's changes with its membership)."""
    lrs: tuple[float, ...] = ()
    """The learning rate of every parameter group this step used, in the optimizer's order (a factory may give
    its groups different rates: no weight decay for norms, a faster head)."""

    def __post_init__(self) -> None:
        if not self.lrs:  # built with one learning rate only, as before lrs existed
            object.__setattr__(self, "lrs", (self.lr,))
