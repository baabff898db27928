"""The engine's settings as the parts below it receive them: one frozen object, taken as a session opens."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..comm.compressed import CompressionHook
    from ..elastic import Elastic
    from ..trace import Trace
    from .devices import DeviceSpec
    from .step.context import SiteHook

__all__ = ("EngineSettings",)


@dataclass(frozen=True)
class EngineSettings:
    """What a session needs of its :class:`gsync.Engine`, checked there; see its arguments for each meaning."""

    devices: tuple[DeviceSpec, ...]
    bucket_cap_mb: float
    first_bucket_mb: float
    sync_timeout: float
    on_nonfinite: Literal["raise", "skip"]
    check_replicas_every: int | None
    compression: CompressionHook | None
    device_threads: Literal["shared", "per_device"]
    intra_op_threads: tuple[int, int] | None
    devices_in_turn: int
    distributed: bool
    process_group: dist.ProcessGroup | None
    store: dist.Store | None
    elastic: Elastic | None
    trace: bool | Trace | str | os.PathLike[str]
    trace_file: Path | None
    site_hooks: Sequence[SiteHook]
    """The engine's own list of site hooks, not a copy: a hook armed while a session is open
    (:func:`gsync.testing.inject`) applies to it from its next site."""
    uneven: Literal["refuse", "join"] = "refuse"
    """With process-local data, what the ranks do when one's data ends first (``Engine.session(uneven=...)``):
    ``"join"``: it steps on with empty shards until every rank's has ended; ``"refuse"``: the run stops."""
    shard_optimizer: bool = False
    """Each device keeps optimizer state for its shard of every bucket only (see :mod:`gsync._core.sharding.step`)."""
