"""``fit``'s loop arguments, checked before any work: what :meth:`gsync.Session.fit` and :meth:`gsync.Engine.fit` share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError, InputTypeError
from ..data.feeder import batches_per_epoch, check_batch_source
from ..state.checkpointing import CheckpointSettings

__all__ = ("CALLBACK_HOOKS", "FitLoopSettings", "check_callbacks")

CALLBACK_HOOKS = ("on_step_end", "on_epoch_end", "on_fit_end", "on_membership_change")


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
        return cls(epochs, accumulate, checked_callbacks, progress, checkpoints, uneven)  # type: ignore[arg-type]


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


def _check_not_one_batch(data: object) -> None:
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
            f"data is a {type(data).__name__} of {len(data)} tensors of {rows.pop()} rows each ({described}): "
            "one batch, not an iterable of batches (each of its tensors would be a batch of its own); "
            "pass [batch] for one step, or a DataLoader over the tensors for batches of them, "
            "e.g. DataLoader(TensorDataset(X, Y), batch_size=64)"
        )
