"""Rebuilding the bucket plan once, from the order gradients became ready in the first step (as DDP does)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..gradients.buckets import BucketPlan
from .context import ActorContext

__all__ = ("PlanRebuild",)

logger = logging.getLogger("gsync")


class PlanRebuild:
    """Observes the first step's gradient order and rebuilds the plan from it, once.

    ``observed`` returns the order the first device's hooks saw;
    ``agree`` (across processes) replaces it with rank 0's, so bucket ``b``
    means the same bytes on every rank. The sync server calls
    :meth:`observe` in the communication thread after the first step's
    reductions (``agree`` is a collective) and :meth:`apply` on the loop
    before it posts ``StepSynced``, which carries the plan to the devices;
    they adopt it at their next step.
    """

    def __init__(
        self,
        context: ActorContext,
        observed: Callable[[], Sequence[int]],
        agree: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self._context = context
        self._observed = observed
        self._agree = agree
        self._order: list[int] | None = None
        self.rebuilt = False
        """Whether the plan changed."""

    @property
    def pending(self) -> bool:
        return self._order is None

    def observe(self) -> None:
        plan = self._context.plan
        observed = list(self._observed())
        seen = set(observed)
        # Parameters that got no gradient go last, in reverse registration order.
        order = observed + [p for p in reversed(range(len(plan.names))) if p not in seen]
        self._order = self._agree(order) if self._agree is not None else order

    def apply(self) -> BucketPlan | None:
        """The rebuilt plan if its assignment differs (models whose backward follows reverse registration order
        keep their buffers), else ``None``."""
        context = self._context
        plan = context.plan
        rebuilt = BucketPlan.build(
            [
                (name, torch.empty(shape, dtype=dtype, device="meta"))
                for name, shape, dtype in zip(plan.names, plan.shapes, plan.dtypes)
            ],
            first_bucket_bytes=context.first_bucket_bytes,
            bucket_cap_bytes=context.bucket_cap_bytes,
            order=self._order,
        )
        if [b.params for b in rebuilt.buckets] == [b.params for b in plan.buckets]:
            return None
        context.streams.rebuild(len(rebuilt.buckets))
        self.rebuilt = True
        logger.info(
            "gsync: buckets rebuilt from the first step's gradient order: %d bucket(s) of %s MiB",
            len(rebuilt.buckets), "/".join(f"{b.nbytes / 2**20:.2f}" for b in rebuilt.buckets),
        )
        return rebuilt
