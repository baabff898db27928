"""Which contiguous part of a bucket each device owns when the optimizer is sharded (``shard_optimizer=True``).

One function decides it for every transport and for the optimizer, so a
device's shard of bucket ``b`` is the same range of elements in the
in-process collective, over NCCL, across processes, and in the optimizer
that steps it. The split is as even as it can be: the first
``numel % devices`` shards hold one element more (uneven splits are allowed,
and every transport handles them).
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ("shard_bounds", "process_bounds")


@lru_cache(maxsize=4096)
def shard_bounds(numel: int, devices: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of global device ``i``'s shard of a bucket of ``numel`` elements, for each ``i``.

    :raises ValueError: for fewer than one device or a negative size (a caller's bug, never a user's input).
    """
    if devices < 1 or numel < 0:
        raise ValueError(f"cannot shard {numel} elements over {devices} devices")
    base, extra = divmod(numel, devices)
    bounds = []
    start = 0
    for device in range(devices):
        stop = start + base + (1 if device < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def process_bounds(numel: int, world_devices: int, offsets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The contiguous range each process owns: the union of its devices' shards (a process's devices are
    consecutive global devices, from ``offsets[rank]`` to the next rank's offset)."""
    bounds = shard_bounds(numel, world_devices)
    ends = offsets[1:] + (world_devices,)
    return tuple((bounds[first][0], bounds[last - 1][1]) for first, last in zip(offsets, ends))
