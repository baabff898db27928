"""What the step path asks of the features layered over it, as protocols.

SyncBatchNorm (:mod:`gsync._core.batchnorm`) and the sharded optimizer
(:mod:`gsync._core.sharding`) change what happens inside a step, but the step
modules name them only through these protocols: the features import the step,
never the other way round, so a step module's dependencies stay the step's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .messages import StepApplied

__all__ = ("BatchStatsSync", "DeviceShard", "ShardedUpdate")


class BatchStatsSync(Protocol):
    """Where the replicas' ``nn.SyncBatchNorm`` layers meet, batch by batch, inside each device's step job."""

    def job_started(self, device: int, step: int) -> None: ...

    def job_ended(self, device: int) -> None: ...

    def begin_batch(
        self, device: int, step: int, position: int, local_rows: Sequence[int], padded: bool, share: float
    ) -> None: ...

    def end_batch(self, device: int) -> None: ...

    def skip_batch(self, step: int, position: int, local_rows: Sequence[int], padded: bool) -> None: ...

    def close(self) -> None: ...


class DeviceShard(Protocol):
    """One device's slices of every bucket, which its optimizer steps (``shard_optimizer=True``)."""

    @property
    def params(self) -> Sequence[torch.Tensor]:
        """The replica's parameters, whole."""

    @property
    def slices(self) -> Sequence[torch.Tensor]:
        """This device's slice of each parameter, in the parameters' order."""

    @property
    def ranges(self) -> Sequence[tuple[int, int]]:
        """Each slice's ``(start, stop)`` in its flattened parameter."""

    def attach(self, unused: tuple[int, ...]) -> None: ...

    def clip(self, max_norm: float, inv_scale: torch.Tensor | None) -> torch.Tensor: ...

    def agree_found_inf(self, scaler: torch.amp.GradScaler) -> None: ...


class ShardedUpdate(Protocol):
    """The devices' shards gathered back into every replica after each step."""

    clips_or_scales: bool
    """The recipe clips or scales the loss: the server agrees the whole gradient's norm before each update."""

    def agree_norm(self, step: int) -> None: ...

    def applied(self, index: int, applied: StepApplied) -> None: ...

    async def gathered(self, step: int) -> None: ...
