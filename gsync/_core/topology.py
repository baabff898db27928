"""Where this process's devices sit among all the devices of a run.

A batch is split across *all* devices of all processes in rank-major order,
so results do not depend on how devices are spread over processes. In one
process the topology is trivial: rank 0 of 1, owning every device.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("Topology",)


@dataclass(frozen=True)
class Topology:
    local_devices: int
    rank: int = 0
    world_size: int = 1
    device_offset: int = 0
    """Global index of this process's first device."""
    world_devices: int = 0
    """Devices across all processes; defaults to ``local_devices``."""

    def __post_init__(self) -> None:
        if self.world_devices == 0:
            object.__setattr__(self, "world_devices", self.local_devices)

    @property
    def local_slice(self) -> slice:
        return slice(self.device_offset, self.device_offset + self.local_devices)
