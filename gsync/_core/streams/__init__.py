"""Ordering between gradient producers, the communication thread and the optimizer step.

See :mod:`gsync._core.streams.base` for the contract; :class:`HostStreamSync` is the
CPU implementation, :class:`CudaStreamSync` the CUDA one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError
from .base import StreamOrderError as StreamOrderError
from .base import StreamSync as StreamSync
from .cuda import CudaStreamSync as CudaStreamSync
from .host import HostStreamSync as HostStreamSync

__all__ = ("CudaStreamSync", "HostStreamSync", "StreamOrderError", "StreamSync", "make_stream_sync")


def make_stream_sync(devices: Sequence[torch.device | str], num_buckets: int) -> StreamSync:
    """The :class:`StreamSync` for ``devices``: :class:`CudaStreamSync` for CUDA, :class:`HostStreamSync` for CPU.

    CPU devices may repeat (gsync's virtual ``cpu:N`` devices all live on
    ``torch.device("cpu")``).

    :raises ~gsync.ConfigError: for an empty list, a mix of CPU and CUDA
        devices, another device type, or (CUDA) what :class:`CudaStreamSync` rejects.
    """
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ConfigError(f"make_stream_sync needs a non-empty list of devices, got {devices!r}")
    try:
        types = {torch.device(device).type for device in devices}
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"make_stream_sync: cannot parse devices {list(devices)!r}: {error}") from None
    if types == {"cuda"}:
        return CudaStreamSync(devices, num_buckets)
    if types == {"cpu"}:
        return HostStreamSync(len(devices), num_buckets)
    raise ConfigError(
        f"devices {[str(d) for d in devices]} mix device types {sorted(types)}; gsync trains on all-CPU or all-CUDA devices"
    )
