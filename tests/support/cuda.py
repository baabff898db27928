"""What the tests that need a GPU share: the skip mark, the devices, a long kernel, its warm-up, a thread of its own."""

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


def warm_kernels(*work: Callable[[], object]) -> None:
    """Launch every kernel a timing test will use once, and wait for them, before the test queues its long kernel.

    CUDA loads kernels lazily by default (``CUDA_MODULE_LOADING=LAZY``: CUDA's
    default since 12.2, and torch sets it on older drivers): a kernel is
    loaded on its first launch in the process, and CUDA's programming guide
    (Lazy Loading) says that loading one "might require context
    synchronization". A test that queues a long kernel and then asserts that
    nothing blocked the host would see its own first ``add_`` wait for the long
    kernel, and blame gsync: on an H200 the first ``add_`` of the process took
    0.5 s behind the sleep kernel, and the test failed 3 of 3 (issue 43). Warm
    the very tensors (dtype, size, layout) the timed window touches, since each
    kernel variant loads on its own.

    The sleep kernel itself is warmed on every device; each ``work`` is called
    once, then every device is synchronized.
    """
    for device in cuda_devices():
        with torch.cuda.device(device):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(1)
    for launch in work:
        launch()
    for device in cuda_devices():
        torch.cuda.synchronize(device)
