"""Global batches: validation and splitting into per-device shards.

A batch is a tensor or a (nested) tuple, list or mapping of tensors (a dict,
or a ``Mapping`` such as transformers' ``BatchEncoding``), all with the same
size along dim 0. It is split into contiguous shards along dim 0 that keep the
batch's types, one per device in device order, with ``torch.tensor_split``
semantics: shard sizes differ by at most one, and when a batch has fewer rows
than there are devices the last devices get empty shards (they contribute
nothing to that step and are weighted zero).
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import ConfigError, InputTypeError

__all__ = ("batch_rows", "split_batch", "shard_rows", "move_batch")

Batch = Any


def _leaves(batch: Batch, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, (tuple, list)):
        return [leaf for i, item in enumerate(batch) for leaf in _leaves(item, f"{path}[{i}]")]
    if isinstance(batch, Mapping):
        return [leaf for key, item in batch.items() for leaf in _leaves(item, f"{path}[{key!r}]")]
    what = "the batch" if path == "batch" else f"batch element {path}"
    raise InputTypeError(
        f"{what} is a {type(batch).__name__}; a batch must be a tensor or a tuple, list or mapping of tensors"
    )


def batch_rows(batch: Batch, where: str) -> int:
    """The batch size along dim 0, after checking every tensor agrees; ``where`` names the batch in errors.

    :raises ~gsync.InputTypeError: for a leaf that is not a tensor.
    :raises ~gsync.ConfigError: for a batch with no tensor, a 0-d tensor, or
        tensors of different sizes along dim 0.
    """
    leaves = _leaves(batch, "batch")
    if not leaves:
        raise ConfigError(f"{where} holds no tensor")
    sizes: dict[int, str] = {}
    for path, tensor in leaves:
        if tensor.dim() == 0:
            raise ConfigError(f"{path} in {where} is a 0-d tensor; batches are split along dim 0, so give it a batch dim")
        sizes.setdefault(tensor.shape[0], path)
    if len(sizes) > 1:
        shown = ", ".join(f"{path} has {rows}" for rows, path in sizes.items())
        raise ConfigError(f"tensors in {where} disagree on their size along dim 0 ({shown}); give them equal row counts")
    rows = next(iter(sizes))
    if rows == 0:
        raise ConfigError(f"{where} has 0 rows")
    return rows


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items) if isinstance(like, (tuple, list)) else items


def _rebuild_mapping(like: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as a mapping of ``like``'s type where it can be built so (as torch's ``default_collate`` does)."""
    # Copied and refilled only where a copy owns its items: a dict's, a UserDict's (.data). Another mapping's
    # copy may share its store with the batch, and each shard would write over the others and the batch itself.
    if isinstance(like, (dict, UserDict)):
        try:
            clone = copy.copy(like)
            clone.update(items)
            return clone
        except Exception:  # noqa: BLE001 - a mapping that cannot be copied this way is rebuilt below
            pass
    try:
        return type(like)(items)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - its constructor takes something else: a plain dict then
        return items


def _map(batch: Batch, fn: Any) -> Batch:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_map(item, fn) for item in batch])
    return _rebuild_mapping(batch, {key: _map(item, fn) for key, item in batch.items()})


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split a validated batch into ``parts`` contiguous shards along dim 0 (views, no copy)."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, (tuple, list)):
        per_item = [split_batch(item, parts) for item in batch]
        return [_rebuild(batch, [shards[i] for shards in per_item]) for i in range(parts)]
    per_key = {key: split_batch(item, parts) for key, item in batch.items()}
    return [_rebuild_mapping(batch, {key: shards[i] for key, shards in per_key.items()}) for i in range(parts)]


def shard_rows(rows: int, parts: int) -> list[int]:
    """Row counts of ``tensor_split`` into ``parts``: the first ``rows % parts`` shards get one more row."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def move_batch(batch: Batch, device: torch.device) -> Batch:
    return _map(batch, lambda tensor: tensor.to(device, non_blocking=True))
