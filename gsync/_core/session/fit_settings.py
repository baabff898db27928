"""``fit``'s loop arguments, checked before any work: what :meth:`gsync.Session.fit` and :meth:`gsync.Engine.fit` share."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError, InputTypeError
from ..data.feeder import batches_per_epoch, check_batch_source
from ..state.checkpointing import CheckpointSettings

__all__ = ("CALLBACK_HOOKS", "FitLoopSettings", "ValidationSettings", "check_callbacks")

CALLBACK_HOOKS = ("on_step_end", "on_evaluate", "on_epoch_end", "on_fit_end", "on_membership_change")


@dataclass(frozen=True)
class ValidationSettings:
    """``fit``'s validation arguments, checked: what to evaluate on, how often, and which metric picks the best file."""

    data: Iterable[Any] | AsyncIterable[Any]
    every: int | None
    """Steps between evaluations; ``None``: once, at the end of the fit."""
    metric_fn: Callable[..., Any] | None
    best_metric: str | None
    best_mode: str

    def due(self, step: int) -> bool:
        # By the global step, as checkpoint files are: a resumed fit evaluates where the run it continues would have.
        return self.every is not None and (step + 1) % self.every == 0

    @classmethod
    def of(
        cls, data: object, every: object, metric_fn: object, keep_best: object, best_mode: object, checkpoint_dir: object
    ) -> ValidationSettings | None:
        """:raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError`, naming what to change."""
        if best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode must be 'min' (a loss) or 'max' (an accuracy), got {best_mode!r}")
        if keep_best is not None and not isinstance(keep_best, str):
            raise InputTypeError(
                f"keep_best must be the name of a metric val_data's evaluation returns (e.g. 'loss'), got {type(keep_best).__name__}"
            )
        if data is None:
            given = [name for name, value in (("eval_every", every), ("val_metric_fn", metric_fn), ("keep_best", keep_best)) if value is not None]
            if best_mode != "min":
                given.append("best_mode")
            if given:
                raise ConfigError(f"{', '.join(given)} need(s) val_data: the batches to evaluate on, e.g. val_data=val_loader")
            return None
        try:
            check_batch_source(data)
        except InputTypeError as error:
            raise InputTypeError(f"val_data: {error}") from None
        _check_not_one_batch(data, "val_data")
        if isinstance(data, (Iterator, AsyncIterator)):
            raise ConfigError(
                f"val_data is a one-shot iterator ({type(data).__name__}): it is evaluated at every eval_every steps "
                "and at the end, so pass a re-iterable (a list or a DataLoader)"
            )
        if batches_per_epoch(data) == 0:
            raise ConfigError("val_data has no batch (its len() is 0): there is nothing to evaluate on")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError(f"eval_every must be a positive number of steps or None (at the end only), got {every!r}")
        if metric_fn is not None and not callable(metric_fn):
            raise InputTypeError(
                "val_metric_fn must be callable as val_metric_fn(model, shard) -> scalar or dict of scalars, "
                f"got {type(metric_fn).__name__}"
            )
        if keep_best is not None:
            if checkpoint_dir is None:
                raise ConfigError(f"keep_best={keep_best!r} needs checkpoint_dir: the directory best.pt is written into")
            if metric_fn is None and keep_best != "loss":
                raise ConfigError(
                    f"keep_best={keep_best!r}, but without val_metric_fn the evaluation returns 'loss' only: "
                    "pass keep_best='loss', or a val_metric_fn that returns this metric"
                )
        elif best_mode != "min":
            raise ConfigError(f"best_mode={best_mode!r} without keep_best does nothing: name the metric, e.g. keep_best='accuracy'")
        return cls(data, every, metric_fn, keep_best, best_mode)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FitLoopSettings:
    """``fit``'s loop arguments, checked: what :meth:`gsync.Session.fit` and :meth:`gsync.Engine.fit` share."""

    epochs: int
    accumulate: int
    callbacks: list[Any]
    progress: bool | None
    checkpoints: CheckpointSettings | None
    uneven: str | None = None
    """``"join"``: ranks whose process-local data ended step on with empty shards; ``None``: the session's own."""
    validation: ValidationSettings | None = None
    """``val_data=`` and what goes with it; ``None``: no validation."""

    @classmethod
    def checked(
        cls,
        data: object,
        epochs: object,
        accumulate: object,
        callbacks: object,
        progress: object,
        checkpoint_dir: object,
        checkpoint_every: object,
        keep: object,
        uneven: object = None,
        val_data: object = None,
        eval_every: object = None,
        val_metric_fn: object = None,
        keep_best: object = None,
        best_mode: object = "min",
    ) -> FitLoopSettings:
        """:raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError`, naming what to change, before any work."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs must be a positive int, got {epochs!r}")
        check_batch_source(data)
        _check_not_one_batch(data)
        if isinstance(data, (Iterator, AsyncIterator)) and epochs > 1:
            raise ConfigError(
                f"data is a one-shot iterator but epochs={epochs}: pass a re-iterable (a list or a DataLoader) "
                "so each epoch can start over"
            )
        checkpoints = CheckpointSettings.of(checkpoint_dir, checkpoint_every, keep)  # type: ignore[arg-type]
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate must be a positive int (batches per optimizer step), got {accumulate!r}")
        if uneven not in (None, "refuse", "join"):
            raise ConfigError(f"uneven must be 'refuse' or 'join', got {uneven!r}")
        per_epoch = batches_per_epoch(data)
        # Joined, a rank may have no data at all: it steps with empty shards while the others train.
        if per_epoch == 0 and uneven != "join":
            raise ConfigError(
                "data has no batch (its len() is 0); a DataLoader with drop_last=True and a batch_size larger than "
                "its dataset has none: lower batch_size or set drop_last=False"
            )
        if per_epoch is not None and per_epoch < accumulate and uneven != "join":
            raise ConfigError(
                f"data has {per_epoch} batch(es) per epoch, fewer than the accumulate={accumulate} a step takes: "
                "no step would run (an epoch's left-over batches are left out, not carried into the next); "
                "lower accumulate"
            )
        checked_callbacks = check_callbacks(callbacks)
        if progress is not None and not isinstance(progress, bool):
            raise InputTypeError(f"progress must be True, False or None (automatic), got {type(progress).__name__}")
        validation = ValidationSettings.of(val_data, eval_every, val_metric_fn, keep_best, best_mode, checkpoint_dir)
        return cls(epochs, accumulate, checked_callbacks, progress, checkpoints, uneven, validation)  # type: ignore[arg-type]


def check_callbacks(callbacks: object) -> list[Any]:
    """:raises ~gsync.InputTypeError: unless every callback has at least one of the hooks."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, Iterable) or isinstance(callbacks, (str, bytes)):
        raise InputTypeError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}")
    checked = list(callbacks)
    for callback in checked:
        if not any(callable(getattr(callback, hook, None)) for hook in CALLBACK_HOOKS):
            raise InputTypeError(
                f"callback {callback!r} has none of {', '.join(CALLBACK_HOOKS)}; give it at least one "
                "(each is called as hook(session, ...), sync or async)"
            )
    return checked


def _check_not_one_batch(data: object, name: str = "data") -> None:
    """:raises ~gsync.InputTypeError: for ``(X, Y)`` given as ``data``: one batch, whose "batches" are its tensors.

    Tensors of one row count but different shapes are the parts of one batch (features and labels); a list of
    tensor batches has one shape throughout (but for a shorter last batch, whose rows differ), so it is let be.
    """
    if not isinstance(data, (tuple, list)) or len(data) < 2:
        return
    if not all(isinstance(part, torch.Tensor) and part.dim() > 0 for part in data):
        return
    rows = {part.shape[0] for part in data}
    shapes = {tuple(part.shape) for part in data}
    if len(rows) == 1 and len(shapes) > 1:
        described = ", ".join(f"a tensor of shape {tuple(part.shape)}" for part in data)
        raise InputTypeError(
            f"{name} is a {type(data).__name__} of {len(data)} tensors of {rows.pop()} rows each ({described}): "
            "one batch, not an iterable of batches (each of its tensors would be a batch of its own); "
            "pass [batch] for one step, or a DataLoader over the tensors for batches of them, "
            "e.g. DataLoader(TensorDataset(X, Y), batch_size=64)"
        )
