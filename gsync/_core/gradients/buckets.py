"""Gradient buckets: which parameter lives in which flat buffer, and where.

The plan follows PyTorch DDP's reducer: parameters that require grad, in
reverse registration order (roughly the order backward produces their
gradients), grouped by dtype, filled into buckets up to a small first-bucket
size and then up to the cap. Every replica (and every rank) uses the same
plan, so bucket ``b`` means the same bytes everywhere.

Where a transport needs a bucket's bytes contiguous (NCCL, a process
group, compression), each replica's ``.grad`` tensors are views into its
bucket buffers for the reduction and the optimizer step (DDP's
``gradient_as_bucket_view``), so reducing a bucket needs no gather or
scatter. During backward ``.grad`` is ``None`` and each fresh gradient is
copied into its slot once: by its readiness hook, or for the last bucket's
parameters (which have no hook once the plan is final) in one pass when
backward returns (see :class:`ReplicaGrads`). In one process on CPU, and for
a run of one device, the reduction takes the gradients where autograd put
them instead (see :func:`reduced_in_place`), and a bucket buffer holds only
what must be formed in it first (a step's accumulated batches, sparse
gradients) or a bucket of many small tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import ConfigError

__all__ = ("Bucket", "BucketPlan", "ReplicaGrads", "Readiness")


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype
    params: tuple[int, ...]
    """Global parameter indices, in the order they are laid out in the buffer."""
    offsets: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    names: tuple[str, ...]
    """Names of the parameters that require grad, in registration order; a parameter's index is its position here."""
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]
    """Parameter index -> index of the bucket that holds it."""

    @classmethod
    def build(
        cls,
        named_params: Sequence[tuple[str, torch.Tensor]],
        first_bucket_bytes: int,
        bucket_cap_bytes: int,
        order: Sequence[int] | None = None,
    ) -> BucketPlan:
        """Assign parameters to buckets.

        ``order`` is the parameter order to fill buckets in (for instance the
        order gradients were observed to become ready); by default reverse
        registration order.

        :raises ~gsync.ConfigError: if no parameter requires grad, or one is not initialized yet (a lazy module).
        """
        if not named_params:
            raise ConfigError(
                "the model has no parameter that requires grad: there is nothing to train "
                "(check requires_grad, or that the model was not frozen)"
            )
        for name, tensor in named_params:
            if isinstance(tensor, torch.nn.parameter.UninitializedParameter):
                raise ConfigError(
                    f"parameter {name} is not initialized yet (a lazy module such as nn.LazyLinear); run one "
                    "forward pass on a batch before handing the model to gsync, so every parameter has its shape"
                )
        names = tuple(name for name, _ in named_params)
        shapes = tuple(p.shape for _, p in named_params)
        dtypes = tuple(p.dtype for _, p in named_params)
        fill_order = list(reversed(range(len(names)))) if order is None else list(order)
        if sorted(fill_order) != list(range(len(names))):
            raise ConfigError("bucket order must name every trainable parameter exactly once")

        open_buckets: dict[torch.dtype, list[int]] = {}
        open_bytes: dict[torch.dtype, int] = {}
        limits: dict[torch.dtype, int] = {}
        closed: list[list[int]] = []
        for index in fill_order:
            dtype = dtypes[index]
            size = named_params[index][1].numel() * named_params[index][1].element_size()
            members = open_buckets.setdefault(dtype, [])
            limit = limits.setdefault(dtype, first_bucket_bytes)
            if members and open_bytes[dtype] + size > limit:
                closed.append(members)
                members = open_buckets[dtype] = []
                open_bytes[dtype] = 0
                limits[dtype] = bucket_cap_bytes
            members.append(index)
            open_bytes[dtype] = open_bytes.get(dtype, 0) + size
        closed.extend(members for members in open_buckets.values() if members)
        # Buckets are numbered by when their first member becomes ready, so the
        # server launches them in the order backward completes them.
        position = {param: pos for pos, param in enumerate(fill_order)}
        closed.sort(key=lambda members: position[members[0]])

        buckets = []
        bucket_of = [0] * len(names)
        for bucket_index, members in enumerate(closed):
            offsets, cursor = [], 0
            for param in members:
                offsets.append(cursor)
                cursor += shapes[param].numel()
                bucket_of[param] = bucket_index
            buckets.append(Bucket(bucket_index, dtypes[members[0]], tuple(members), tuple(offsets), cursor))
        return cls(names, shapes, dtypes, tuple(buckets), tuple(bucket_of))


IN_PLACE_MIN_TENSOR_BYTES = 64 << 10
"""The average tensor size from which a bucket of several tensors is reduced where autograd put them, where
the reduction can (see :func:`reduced_in_place`)."""


def reduced_in_place(bucket: Bucket) -> bool:
    """Whether a reduction that can take gradients where autograd put them takes this bucket's so.

    Taking them in place saves copying each gradient into the bucket buffer,
    but the reduction then runs one kernel per tensor and device where one
    per device would do: on CPU a kernel launch costs about as much as
    copying 10 KB. For a bucket of many small tensors the copy is cheaper;
    for one tensor, or large ones (a real model's), the copy is the cost.
    """
    return len(bucket.params) == 1 or bucket.nbytes >= IN_PLACE_MIN_TENSOR_BYTES * len(bucket.params)


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _references_to_memory(tensor: torch.Tensor) -> int:
    # The Python storage object must outlive the count: it holds one of the references counted.
    storage = tensor.untyped_storage()
    return int(_storage_use_count(storage._cdata))  # type: ignore[misc]


# What a tensor that alone holds its memory shows (its own reference, and the Python storage object asked for
# it); measured rather than assumed, since it is torch's internal bookkeeping.
_SOLE_OWNER_COUNT = _references_to_memory(torch.empty(1)) if _storage_use_count is not None else -1


def owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether no other tensor shares ``tensor``'s memory (``False`` when torch cannot tell).

    Autograd hands a parameter the gradient it computed without a copy when
    nothing else holds that tensor, but it does not check for views: the
    gradient of ``p`` in ``x + p.unsqueeze(0)`` is a view of the gradient
    still flowing to ``x``. Writing into such a gradient while backward
    runs would change what the rest of backward reads.
    """
    return _storage_use_count is not None and _references_to_memory(tensor) == _SOLE_OWNER_COUNT


class ReplicaGrads:
    """One replica's bucket buffers, and its parameters' ``.grad`` as views into them.

    During backward the parameters' ``.grad`` is ``None``: autograd then
    hands each gradient over as a fresh tensor without copying it, and it is
    copied into the bucket once (:meth:`take`, or one foreach copy for the
    last bucket when backward returns). Zeroing the
    buckets first and letting autograd add into them would cost two more
    passes over every gradient per step. After backward every ``.grad`` that
    went through the bucket is a view again, for the reduction and the
    optimizer.
    """

    def __init__(
        self, plan: BucketPlan, params: Sequence[torch.Tensor], device: torch.device, lazy: bool = False
    ) -> None:
        self._plan = plan
        self._device = device
        self.params = list(params)
        self._flats: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self._views: list[torch.Tensor | None] = [None] * len(plan.names)
        if not lazy:
            self.attach()

    def flat(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s buffer, allocated (zeroed) the first time it is needed.

        A replica whose gradients are reduced where autograd put them (alone
        in its run, or in one process on CPU) allocates a bucket only for what
        goes through it (accumulated steps, sparse gradients, buckets of small
        tensors), so it does not hold a second copy of every gradient.
        """
        flat = self._flats[bucket]
        if flat is None:
            spec = self._plan.buckets[bucket]
            flat = self._flats[bucket] = torch.zeros(spec.numel, dtype=spec.dtype, device=self._device)
            for param, offset in zip(spec.params, spec.offsets):
                shape = self._plan.shapes[param]
                self._views[param] = flat[offset : offset + shape.numel()].view(shape)
        return flat

    def view(self, position: int) -> torch.Tensor:
        """Parameter ``position``'s slot in its bucket."""
        view = self._views[position]
        if view is None:
            self.flat(self._plan.bucket_of[position])
            view = self._views[position]
        return view  # type: ignore[return-value]

    def bucket_views(self, bucket: int) -> list[torch.Tensor]:
        """The slots of bucket ``bucket``'s parameters, in bucket order."""
        self.flat(bucket)
        return [self._views[position] for position in self._plan.buckets[bucket].params]  # type: ignore[misc]

    @property
    def flats(self) -> list[torch.Tensor]:
        return [self.flat(bucket) for bucket in range(len(self._flats))]

    @property
    def views(self) -> list[torch.Tensor]:
        return [self.view(position) for position in range(len(self._views))]

    def attach(self) -> None:
        for position, param in enumerate(self.params):
            param.grad = self.view(position)

    def release(self) -> None:
        """Before backward: let autograd deliver fresh gradients (see the class docstring)."""
        for param in self.params:
            param.grad = None

    def take(self, position: int, scale: float = 1.0, add: bool = False) -> None:
        """Move the gradient autograd just delivered into the bucket, and make ``.grad`` the view again.

        ``scale`` weights it (a batch's share when a step accumulates
        several); ``add`` adds it to what an earlier batch of the step left.
        """
        param = self.params[position]
        view = self.view(position)
        grad = param.grad
        # A sparse gradient (nn.Embedding(sparse=True)) lands densely in its slot.
        if grad.is_sparse:  # type: ignore[union-attr]
            grad = grad.to_dense()  # type: ignore[union-attr]
        if add:
            view.add_(grad, alpha=scale)  # type: ignore[arg-type]
        elif scale == 1.0:
            view.copy_(grad)  # type: ignore[arg-type]
        else:
            torch.mul(grad, scale, out=view)  # type: ignore[arg-type]
        param.grad = view

    def fill_missing(self, positions: Sequence[int]) -> None:
        """Zeros for parameters that got no gradient this step (their slots still hold the last step's)."""
        for position in positions:
            view = self.view(position)
            view.zero_()
            self.params[position].grad = view


class Readiness:
    """Counts, per bucket, the parameters whose gradient is final in the current step.

    Used from the thread where backward runs; not thread-safe on its own.
    """

    def __init__(self, plan: BucketPlan) -> None:
        self._sizes = [len(b.params) for b in plan.buckets]
        self._bucket_of = plan.bucket_of
        self._members = [b.params for b in plan.buckets]
        self._names = plan.names
        self.reset()

    def reset(self) -> None:
        self.remaining = list(self._sizes)
        self.fired = bytearray(len(self._bucket_of))
        self.order: list[int] = []

    def mark(self, param: int) -> int | None:
        """Record that ``param``'s gradient is final; return its bucket if that completed it.

        :raises ~gsync.ConfigError: if ``param`` already fired this step.
        """
        if self.fired[param]:
            raise ConfigError(
                f"parameter {self._names[param]} received its gradient twice in one step; gsync reduces each gradient once "
                "per step, so backward must reach each parameter once (reentrant activation checkpointing "
                "does not: use torch.utils.checkpoint(..., use_reentrant=False))"
            )
        self.fired[param] = 1
        self.order.append(param)
        bucket = self._bucket_of[param]
        self.remaining[bucket] -= 1
        return bucket if self.remaining[bucket] == 0 else None

    def mark_all(self, params: Sequence[int]) -> int | None:
        """:meth:`mark` for each of ``params`` (all of one bucket), in one pass."""
        fired = self.fired
        for param in params:
            if fired[param]:
                self.mark(param)  # raises
            fired[param] = 1
        self.order.extend(params)
        bucket = self._bucket_of[params[0]]
        self.remaining[bucket] -= len(params)
        return bucket if self.remaining[bucket] == 0 else None

    def unfinished(self) -> list[tuple[int, tuple[int, ...]]]:
        """Buckets not yet complete, each with the parameters that never fired."""
        return [
            (bucket, tuple(p for p in self._members[bucket] if not self.fired[p]))
            for bucket, remaining in enumerate(self.remaining)
            if remaining
        ]
