from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import gsync
from gsync._core.gradients.buckets import BucketPlan, Readiness, ReplicaGrads, owns_its_memory, reduced_in_place
from gsync._core.step.inbox import LastArrivals


def named(*sizes: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"p{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]


def test_reverse_order_small_first_bucket_then_cap() -> None:
    # 4-byte floats: 100 elements = 400 bytes.
    plan = BucketPlan.build(named(100, 100, 100, 100, 100), first_bucket_bytes=400, bucket_cap_bytes=800)
    assert [b.params for b in plan.buckets] == [(4,), (3, 2), (1, 0)]
    assert [b.offsets for b in plan.buckets] == [(0,), (0, 100), (0, 100)]
    assert plan.bucket_of == (2, 2, 1, 1, 0)


def test_oversized_parameter_gets_its_own_bucket() -> None:
    plan = BucketPlan.build(named(10, 1000, 10), first_bucket_bytes=40, bucket_cap_bytes=400)
    assert [b.params for b in plan.buckets] == [(2,), (1,), (0,)]


def test_dtypes_never_share_a_bucket() -> None:
    params = named(10, 10) + [("h0", torch.zeros(10, dtype=torch.float16)), ("h1", torch.zeros(10, dtype=torch.float16))]
    plan = BucketPlan.build(params, first_bucket_bytes=1 << 20, bucket_cap_bytes=1 << 20)
    # float16 parameters were registered last, so backward reaches them first.
    assert [(b.dtype, b.params) for b in plan.buckets] == [(torch.float16, (3, 2)), (torch.float32, (1, 0))]


def test_explicit_order_must_be_a_permutation() -> None:
    with pytest.raises(gsync.ConfigError):
        BucketPlan.build(named(1, 1), 4, 4, order=[0, 0])
    plan = BucketPlan.build(named(1, 1, 1), 4, 4, order=[1, 0, 2])
    assert [b.params for b in plan.buckets] == [(1,), (0,), (2,)]


def test_no_trainable_parameter_is_refused() -> None:
    with pytest.raises(gsync.ConfigError, match="no parameter that requires grad"):
        BucketPlan.build([], 4, 4)


def test_grads_are_copied_into_the_flat_buffer_and_become_views() -> None:
    layer = nn.Linear(3, 2)
    params = list(layer.parameters())
    plan = BucketPlan.build(list(layer.named_parameters()), 1 << 20, 1 << 20)
    grads = ReplicaGrads(plan, params, torch.device("cpu"))
    flat = grads.flats[0]
    assert flat.numel() == 8 and all(p.grad is v for p, v in zip(params, grads.views))

    grads.release()  # before backward: autograd hands over fresh gradients
    assert all(p.grad is None for p in params)
    (layer(torch.ones(4, 3)).sum()).backward()
    grads.take(1)  # the bias, registered last, is laid out first
    assert layer.bias.grad is grads.views[1]
    torch.testing.assert_close(flat[:2], torch.full((2,), 4.0))

    grads.fill_missing([0])  # the weight "got no gradient": zeros, not last step's values
    assert layer.weight.grad is grads.views[0]
    assert torch.count_nonzero(flat[2:]) == 0


def test_readiness_reports_completed_buckets_and_double_fires() -> None:
    plan = BucketPlan.build(named(100, 100, 100), first_bucket_bytes=400, bucket_cap_bytes=800)
    ready = Readiness(plan)
    assert ready.mark(2) == 0
    assert ready.mark(1) is None
    assert ready.unfinished() == [(1, (0,))]
    assert ready.mark(0) == 1
    with pytest.raises(gsync.ConfigError, match="parameter p0 received its gradient twice"):
        ready.mark(0)
    ready.reset()
    assert ready.unfinished() == [(0, (2,)), (1, (1, 0))]


def test_a_lazy_replica_allocates_a_bucket_only_when_something_goes_through_it() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6))]
    plan = BucketPlan.build([(f"p{i}", p) for i, p in enumerate(params)], first_bucket_bytes=48, bucket_cap_bytes=48)
    assert len(plan.buckets) >= 2
    grads = ReplicaGrads(plan, params, torch.device("cpu"), lazy=True)
    assert all(flat is None for flat in grads._flats) and all(p.grad is None for p in params)
    grads.fill_missing([2])
    touched = plan.bucket_of[2]
    assert [flat is not None for flat in grads._flats] == [b == touched for b in range(len(plan.buckets))]
    assert params[2].grad is not None and params[2].grad.data_ptr() == grads.view(2).data_ptr()


def test_last_arrivals_names_the_last_device_to_post_each_bucket_every_step() -> None:
    arrivals = LastArrivals(3, 2)
    for _ in range(4):  # steps
        assert [arrivals.completes(0) for _ in range(3)] == [False, False, True]
        assert [arrivals.completes(1) for _ in range(3)] == [False, False, True]
    alone = LastArrivals(1, 0)
    assert all(alone.completes(bucket) for bucket in range(5))


def test_owns_its_memory_tells_a_gradient_that_shares_memory_with_one_backward_still_holds() -> None:
    tensor = torch.randn(4)
    assert owns_its_memory(tensor)
    view = tensor[:2]
    assert not owns_its_memory(tensor) and not owns_its_memory(view)
    del view
    assert owns_its_memory(tensor)

    # Autograd hands each parameter its gradient without a copy: for ``shift``, a view of the gradient that is
    # also on its way to ``x``; for ``bias``, a tensor of its own.
    shift, bias = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))
    seen: dict[str, bool] = {}

    def look(name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            seen[name] = owns_its_memory(param.grad)  # type: ignore[arg-type]

        return hook

    shift.register_post_accumulate_grad_hook(look("shift"))
    bias.register_post_accumulate_grad_hook(look("bias"))
    x = torch.randn(1, 5, requires_grad=True)
    (torch.tanh(x * 2 + shift.unsqueeze(0)).sum() + (torch.randn(3, 5) * bias).sum()).backward()
    assert seen == {"shift": False, "bias": True}
    assert owns_its_memory(shift.grad)  # once backward has let go of the rest


def test_buckets_of_one_tensor_or_large_tensors_are_reduced_in_place_many_small_ones_through_their_buffer() -> None:
    small = BucketPlan.build(named(64, 64, 64), first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    large = BucketPlan.build(named(1 << 16, 8, 1 << 16), first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    single = BucketPlan.build(named(4), first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    assert [reduced_in_place(plan.buckets[0]) for plan in (small, large, single)] == [False, True, True]
