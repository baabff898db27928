"""The random number generators a training step draws from, captured and restored as plain tensors.

A checkpoint carries them so a resumed run draws the same dropout masks and
augmentations as the run it continues: torch's CPU generator, the run's own
CUDA devices' generators, Python's ``random`` and NumPy's global generator. The state is held as tensors, ints and tuples only, so a
checkpoint file stays loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ("capture_rng", "restore_rng")


def capture_rng(cuda_devices: Sequence[torch.device] = ()) -> dict[str, Any]:
    """The state of every global generator, copied; CUDA's for ``cuda_devices`` only (the run's own)."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), position, has_gauss, cached_gaussian),
    }
    if cuda_devices:
        state["cuda"] = {device.index: torch.cuda.get_rng_state(device) for device in cuda_devices}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator ``state`` has (CUDA ones onto the device indices they were taken from).

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
    if cuda and torch.cuda.is_available():
        for index, device_state in cuda.items():
            if int(index) < torch.cuda.device_count():
                torch.cuda.set_rng_state(device_state, int(index))
