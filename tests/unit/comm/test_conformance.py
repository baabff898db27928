"""Every Collective implementation must pass this suite.

Later transports register a factory in ``COLLECTIVES``; the cases are the contract.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import gsync
from gsync.comm._shards import shard_bounds

COLLECTIVES: dict[str, Callable[[int], gsync.Collective]] = {
    "local": gsync.LocalCollective,
}


@pytest.fixture(params=sorted(COLLECTIVES))
def make(request: pytest.FixtureRequest) -> Callable[[int], gsync.Collective]:
    return COLLECTIVES[request.param]


def test_is_a_collective(make: Callable[[int], gsync.Collective]) -> None:
    collective = make(2)
    assert isinstance(collective, gsync.Collective)
    assert collective.world_devices == 2
    collective.close()
    collective.close()


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_weighted_all_reduce(make: Callable[[int], gsync.Collective], num_devices: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(num_devices)
    tensors = [torch.randn(1000, generator=generator).to(dtype) for _ in range(num_devices)]
    rows = torch.randint(1, 9, (num_devices,), generator=generator).tolist()
    weights = [r / sum(rows) for r in rows]
    expected = sum(w * t.double() for w, t in zip(weights, tensors))
    make(num_devices).all_reduce(tensors, weights)
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    for tensor in tensors:
        torch.testing.assert_close(tensor.double(), expected, atol=tolerance, rtol=tolerance)
        assert tensor.dtype == dtype


def test_fp16_weighted_sum_does_not_overflow(make: Callable[[int], gsync.Collective]) -> None:
    tensors = [torch.full((16,), 40000.0, dtype=torch.float16) for _ in range(3)]
    make(3).all_reduce(tensors, [1 / 3] * 3)
    for tensor in tensors:
        assert torch.isfinite(tensor).all()
        torch.testing.assert_close(tensor.float(), torch.full((16,), 40000.0), rtol=1e-3, atol=0)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_broadcast_from_first_device(make: Callable[[int], gsync.Collective], num_devices: int) -> None:
    tensors = [torch.full((5,), float(i)) for i in range(num_devices)]
    ints = [torch.arange(3) + 10 * i for i in range(num_devices)]
    collective = make(num_devices)
    collective.broadcast(tensors)
    collective.broadcast(ints)
    for tensor, integers in zip(tensors, ints):
        assert torch.equal(tensor, torch.zeros(5))
        assert torch.equal(integers, torch.arange(3))


def test_zero_weight_devices_contribute_nothing(make: Callable[[int], gsync.Collective]) -> None:
    tensors = [torch.ones(4), torch.full((4,), float("inf")), torch.full((4,), 3.0)]
    make(3).all_reduce(tensors, [0.5, 0.0, 0.5])
    for tensor in tensors:
        torch.testing.assert_close(tensor, torch.full((4,), 2.0))
    leading_zero = [torch.full((4,), float("nan")), torch.full((4,), 5.0)]
    make(2).all_reduce(leading_zero, [0.0, 1.0])
    for tensor in leading_zero:
        torch.testing.assert_close(tensor, torch.full((4,), 5.0))


@pytest.mark.parametrize("weights", [[0.25, 0.75], [0.2, 0.3, 0.5], [0.0, 0.4, 0.6], [1.0, 0.0], [0.0, 0.0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_reduction_of_tensor_lists(weights: list[float], dtype: torch.dtype) -> None:
    """``all_reduce_each`` (gradients where autograd left them): every device gets the weighted sum of each
    position, zero-weight devices left out, as the flat buffer of the same tensors gets it."""
    generator = torch.Generator().manual_seed(len(weights))
    shapes = [(37, 3), (5,), (2, 3, 4), (1,)]
    lists = [[torch.randn(shape, generator=generator).to(dtype) for shape in shapes] for _ in weights]
    for position, weight in enumerate(weights):
        if weight == 0.0:
            lists[position][1].fill_(float("inf"))  # left out, not multiplied by zero
        # A gradient autograd hands over can be a transposed tensor.
        lists[position][0] = lists[position][0].t().contiguous().t()
    expected = [
        sum((w * device[k].double() for w, device in zip(weights, lists) if w != 0.0), torch.zeros(shape).double())
        for k, shape in enumerate(shapes)
    ]
    flats = [torch.cat([tensor.reshape(-1) for tensor in device]) for device in lists]

    collective = gsync.LocalCollective(len(weights))
    collective.all_reduce_each(lists, weights)
    collective.all_reduce(flats, weights)

    tolerance = {torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    for device, flat in zip(lists, flats):
        assert not device[0].is_contiguous() and all(t.dtype == dtype for t in device)
        for tensor, want in zip(device, expected):
            torch.testing.assert_close(tensor.double(), want, atol=tolerance, rtol=tolerance)
        # The same arithmetic as one flat buffer, to within the rounding torch's kernels may differ by.
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in device]), flat, atol=tolerance, rtol=tolerance)


# --------------------------------------------------------------------------------------------------
# Sharded collectives (shard_optimizer=True): each device owns shard_bounds(numel, devices)[i]
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1000, 1003, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_reduce_scatter_gives_each_device_the_weighted_sum_of_its_shard(
    make: Callable[[int], gsync.Collective], num_devices: int, numel: int, dtype: torch.dtype
) -> None:
    """Uneven splits (1003 over 3 or 4), and shards of nothing (2 elements over 3 or 4 devices)."""
    generator = torch.Generator().manual_seed(numel + num_devices)
    tensors = [torch.randn(numel, generator=generator).to(dtype) for _ in range(num_devices)]
    rows = torch.randint(1, 9, (num_devices,), generator=generator).tolist()
    weights = [r / sum(rows) for r in rows]
    expected = sum(w * t.double() for w, t in zip(weights, tensors))
    make(num_devices).reduce_scatter(tensors, weights)
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    bounds = shard_bounds(numel, num_devices)
    assert sum(stop - start for start, stop in bounds) == numel
    for tensor, (start, stop) in zip(tensors, bounds):
        assert tensor.dtype == dtype and tensor.shape == (numel,)
        torch.testing.assert_close(tensor[start:stop].double(), expected[start:stop], atol=tolerance, rtol=tolerance)


def test_reduce_scatter_leaves_zero_weight_devices_out(make: Callable[[int], gsync.Collective]) -> None:
    tensors = [torch.ones(7), torch.full((7,), float("inf")), torch.full((7,), 3.0)]
    make(3).reduce_scatter(tensors, [0.5, 0.0, 0.5])
    for tensor, (start, stop) in zip(tensors, shard_bounds(7, 3)):
        torch.testing.assert_close(tensor[start:stop], torch.full((stop - start,), 2.0))
    leading_zero = [torch.full((5,), float("nan")), torch.full((5,), 5.0)]
    make(2).reduce_scatter(leading_zero, [0.0, 1.0])
    for tensor, (start, stop) in zip(leading_zero, shard_bounds(5, 2)):
        torch.testing.assert_close(tensor[start:stop], torch.full((stop - start,), 5.0))


def test_fp16_reduce_scatter_does_not_overflow(make: Callable[[int], gsync.Collective]) -> None:
    tensors = [torch.full((16,), 40000.0, dtype=torch.float16) for _ in range(3)]
    make(3).reduce_scatter(tensors, [1 / 3] * 3)
    for tensor, (start, stop) in zip(tensors, shard_bounds(16, 3)):
        assert torch.isfinite(tensor[start:stop]).all()
        torch.testing.assert_close(tensor[start:stop].float(), torch.full((stop - start,), 40000.0), rtol=1e-3, atol=0)


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [12, 1003, 2])
def test_all_gather_gives_every_device_every_owners_shard(
    make: Callable[[int], gsync.Collective], num_devices: int, numel: int
) -> None:
    bounds = shard_bounds(numel, num_devices)
    expected = torch.empty(numel)
    tensors = []
    for owner, (start, stop) in enumerate(bounds):
        # Each device holds its own shard and garbage elsewhere (what the others hold there is theirs).
        tensor = torch.full((numel,), float("nan"))
        tensor[start:stop] = torch.arange(start, stop, dtype=torch.float32) + 0.5 * owner
        expected[start:stop] = tensor[start:stop]
        tensors.append(tensor)
    ints = [torch.full((numel,), -1, dtype=torch.int64) for _ in range(num_devices)]
    for owner, (start, stop) in enumerate(bounds):
        ints[owner][start:stop] = torch.arange(start, stop) * 10 + owner
    collective = make(num_devices)
    collective.all_gather(tensors)
    collective.all_gather(ints)
    for tensor, integers in zip(tensors, ints):
        assert torch.equal(tensor, expected)
        assert torch.equal(integers, ints[0]) and (integers >= 0).all()


@pytest.mark.parametrize("num_devices", [2, 3])
def test_reduce_scatter_then_all_gather_is_an_all_reduce(make: Callable[[int], gsync.Collective], num_devices: int) -> None:
    generator = torch.Generator().manual_seed(num_devices)
    tensors = [torch.randn(301, 3, generator=generator) for _ in range(num_devices)]
    copies = [tensor.clone() for tensor in tensors]
    weights = [(i + 1) / sum(range(1, num_devices + 1)) for i in range(num_devices)]
    collective = make(num_devices)
    collective.reduce_scatter(tensors, weights)
    collective.all_gather(tensors)
    collective.all_reduce(copies, weights)
    for tensor, copy in zip(tensors, copies):
        torch.testing.assert_close(tensor, copy, atol=1e-6, rtol=1e-6)
