"""What the tests that need a GPU share: the skip mark, the devices, a long kernel, a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a fresh thread (its own current-stream state) and return its result."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as error:  # noqa: BLE001 - re-raised below
            box.append(("error", error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


def cuda_devices() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def long_kernel() -> None:
    """Queue roughly half a second of GPU work on the current stream."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch build")
    torch.cuda._sleep(1_000_000_000)
