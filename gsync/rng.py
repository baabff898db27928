"""The random number generators a training step draws from, captured and restored as plain tensors.

A checkpoint carries them so a resumed run draws the same dropout masks and
augmentations as the run it continues: torch's CPU generator, every CUDA
device's (when CUDA is initialized), Python's ``random`` and NumPy's global
generator. The state is held as tensors, ints and tuples only, so a
checkpoint file stays loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ("capture_rng", "restore_rng")


def capture_rng() -> dict[str, Any]:
    """The state of every global generator, copied."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), position, has_gauss, cached_gaussian),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator ``state`` has; CUDA only when the same number of devices is visible.

    :raises ValueError: when ``state`` is not one :func:`capture_rng` made.
    """
    try:
        torch.set_rng_state(state["torch"])
        python = state["python"]
        random.setstate((python[0], tuple(python[1]), python[2]))
        kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), int(position), int(has_gauss), float(cached_gaussian)))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"not a random generator state gsync captured: {error!r}") from error
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
