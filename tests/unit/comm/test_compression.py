"""``Engine(compression=...)``: bf16/fp16 reduction, the hook protocol, bytes, and the arithmetic's order.

The multi-process half (2 processes of 1 device against 2 devices of one
process, bytes on the process group) is ``tests/multiproc/test_compression_multiprocess.py``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from gsync.comm import LocalCollective, LowPrecision
from gsync._core.transports.compressed import CompressedCollective
from tests.support.models import TiedNet, classification_loss, make_batches, sgd

STEPS = 20
ROWS = 31  # uneven over 2 devices: weights 16/31 and 15/31


def mlp() -> nn.Module:
    """The reference MLP's shape (Linear/ReLU stack, cross-entropy), small enough for a test."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


async def train(compression: Any, model: nn.Module | None = None, steps: int = STEPS, **engine: Any) -> gsync.FitResult:
    # check_replicas_every=1: every step, both replicas must hold bit-identical parameters.
    return await gsync.Engine(["cpu:0", "cpu:1"], compression=compression, check_replicas_every=1, **engine).fit(
        model if model is not None else mlp(), make_batches(steps, ROWS), optimizer=sgd, loss_fn=classification_loss
    )


def distance(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """Largest absolute parameter difference, and the difference's norm relative to ``b``'s."""
    diffs = [(x - y).detach().flatten() for x, y in zip(a.parameters(), b.parameters())]
    largest = max(float(d.abs().max()) for d in diffs)
    relative = float(torch.cat(diffs).norm() / torch.cat([y.detach().flatten() for y in b.parameters()]).norm())
    return largest, relative


# -- configuration -------------------------------------------------------------------------------------------------


class Counting(gsync.CompressionHook):
    """Sends fp32 as it is, in two collectives per bucket (the first and second half), counting every call."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.reduced: list[int] = []

    def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
        self.calls["compress"] += 1
        return tensor

    def reduce(self, bucket: int, payloads: list[torch.Tensor], all_reduce: Any) -> None:
        self.calls["reduce"] += 1
        self.reduced.append(bucket)
        half = payloads[0].numel() // 2
        all_reduce([p[:half] for p in payloads])
        all_reduce([p[half:] for p in payloads])

    def decompress(self, bucket: int, device: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        self.calls["decompress"] += 1
        if payload is not out:
            out.copy_(payload)


class Bf16WithErrorFeedback(gsync.CompressionHook):
    """bf16 whose rounding error is kept per (bucket, device) and added to the next step's gradient."""

    def __init__(self) -> None:
        self.errors: dict[tuple[int, int], torch.Tensor] = {}

    def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
        error = self.errors.get((bucket, device))
        if error is not None and error.numel() == tensor.numel():  # the plan is rebuilt once: sizes may change
            tensor += error
        payload = tensor.to(torch.bfloat16)
        self.errors[(bucket, device)] = tensor - payload.float()
        return payload

    def decompress(self, bucket: int, device: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload)


class NotAHook:
    def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def decompress(self, bucket: int, device: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload)


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ("int8", "compression must be 'bf16', 'fp16', None or a gsync.CompressionHook instance, got 'int8'"),
        ("BF16", "got 'BF16'"),
        (torch.bfloat16, "got the dtype torch.bfloat16: write compression='bf16'"),
        (torch.int8, "got the dtype torch.int8: gsync compresses to bf16 or fp16"),
        (True, "got bool True"),
        (LowPrecision, "got the class LowPrecision: pass an instance, LowPrecision(...)"),
        (NotAHook(), "does not subclass gsync.CompressionHook: subclass it"),
    ],
)
def test_bad_compression_is_refused_before_any_work(compression: Any, message: str) -> None:
    with pytest.raises(gsync.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        gsync.Engine(["cpu:0", "cpu:1"], compression=compression)


def test_low_precision_takes_only_bf16_and_fp16() -> None:
    with pytest.raises(gsync.ConfigError, match="torch.bfloat16 or torch.float16, got torch.float64"):
        LowPrecision(torch.float64)
    assert gsync.Engine(["cpu"], compression="fp16").compression.dtype == torch.float16  # type: ignore[union-attr]
    assert gsync.Engine(["cpu"]).compression is None
    hook = Counting()
    assert gsync.Engine(["cpu"], compression=hook).compression is hook


@pytest.mark.asyncio
async def test_a_hook_returning_no_tensor_fails_the_step_naming_the_hook() -> None:
    class Broken(Counting):
        def compress(self, bucket: int, device: int, tensor: torch.Tensor) -> torch.Tensor:
            return None  # type: ignore[return-value]

    with pytest.raises(gsync.SyncFailed, match="all-reduce of bucket") as caught:
        await train(Broken(), steps=2)
    assert "Broken.compress returned NoneType, not a tensor" in str(caught.value.__cause__)


# -- the collective ------------------------------------------------------------------------------------------------


def test_weighted_shares_are_applied_in_fp32_before_the_cast() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=generator) * 10 for _ in range(3)]
    weights = [5 / 12, 0.0, 7 / 12]  # an empty shard in the middle: left out, whatever it holds
    tensors[1].fill_(float("inf"))
    expected = (tensors[0] * weights[0]).bfloat16() + (tensors[2] * weights[2]).bfloat16()
    CompressedCollective(LocalCollective(3), LowPrecision(torch.bfloat16)).all_reduce(tensors, weights)
    for tensor in tensors:
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected.float())  # this order, to the bit


def test_fp16_divides_before_summing_so_it_does_not_overflow() -> None:
    # Each device's gradient fits fp16, their sum does not: summing first, then dividing, gives inf.
    grads = [torch.full((8,), 40000.0), torch.full((8,), 40000.0)]
    assert torch.isinf(grads[0].half() + grads[1].half()).all()
    collective = CompressedCollective(LocalCollective(2), LowPrecision(torch.float16))
    collective.all_reduce(grads, [0.5, 0.5])
    for grad in grads:
        assert torch.equal(grad, torch.full((8,), 40000.0))
    uneven = [torch.full((8,), 60000.0), torch.full((8,), 30000.0)]
    collective.all_reduce(uneven, [2 / 3, 1 / 3])
    for grad in uneven:
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, torch.full((8,), 50000.0), rtol=1e-3, atol=0)


def test_broadcast_is_passed_through_uncompressed() -> None:
    tensors = [torch.tensor([1.0 + 2**-20]), torch.zeros(1)]
    CompressedCollective(LocalCollective(2), LowPrecision(torch.bfloat16)).broadcast(tensors)
    assert tensors[1].item() == 1.0 + 2**-20



def test_reduce_scatter_is_the_compressed_all_reduce_and_all_gather_is_exact() -> None:
    """With shard_optimizer the hook still sees whole buckets (its state is per bucket); the parameters the
    all-gather carries travel uncompressed."""
    from gsync.comm._shards import shard_bounds

    generator = torch.Generator().manual_seed(3)
    terms = [torch.randn(11, generator=generator) for _ in range(3)]
    weights = [0.5, 0.25, 0.25]
    scattered = [t.clone() for t in terms]
    reduced = [t.clone() for t in terms]
    collective = CompressedCollective(LocalCollective(3), LowPrecision(torch.bfloat16))
    collective.reduce_scatter(scattered, weights)
    collective.all_reduce(reduced, weights)
    for tensor, want, (start, stop) in zip(scattered, reduced, shard_bounds(11, 3)):
        assert torch.equal(tensor[start:stop], want[start:stop])
    exact = [torch.full((3,), 1.0 + 2**-20), torch.zeros(3)]
    collective = CompressedCollective(LocalCollective(2), LowPrecision(torch.bfloat16))
    exact[1][2:] = 7.0 + 2**-20  # device 1 owns element 2 of 3
    collective.all_gather(exact)
    assert exact[1].tolist() == [1.0 + 2**-20, 1.0 + 2**-20, 7.0 + 2**-20] == exact[0].tolist()

# -- training ------------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_bf16_and_fp16_stay_close_to_fp32_with_identical_replicas_and_half_the_bytes() -> None:
    exact = await train(None)
    bf16 = await train("bf16")
    fp16 = await train("fp16")
    bf16_largest, bf16_relative = distance(bf16.model, exact.model)
    fp16_largest, fp16_relative = distance(fp16.model, exact.model)
    # Measured after 20 SGD-momentum steps: bf16 7.6e-4 / 5.1e-4, fp16 8.4e-5 / 4.6e-5. Bounds ~6x that.
    assert 0 < bf16_largest < 5e-3 and bf16_relative < 3e-3
    assert 0 < fp16_largest < 5e-4 and fp16_relative < 3e-4
    assert fp16_relative < bf16_relative  # 10 mantissa bits against 7: the dtype really is the one asked for
    for result in (bf16, fp16):
        assert result.losses == pytest.approx(exact.losses, abs=1e-3)
        assert result.stats.reduced_bytes * 2 == exact.stats.reduced_bytes == STEPS * sum(exact.stats.bucket_sizes)


@pytest.mark.asyncio
async def test_fp16_training_with_gradients_whose_sum_overflows_fp16() -> None:
    # loss = scale * mean(w . x) over rows of ones: every device's gradient is `scale` for each weight, and
    # the two devices' sum (80000) is past fp16's largest value (65504); their mean is not.
    scale = 40000.0
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    data = [(torch.ones(3, 4), torch.zeros(3))]  # 3 rows: weights 2/3 and 1/3

    def loss_fn(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return model(batch[0]).mean() * scale

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-6)

    results = {}
    for compression in (None, "fp16"):
        engine = gsync.Engine(["cpu:0", "cpu:1"], compression=compression)
        results[compression] = await engine.fit(copy.deepcopy(model), data, optimizer=optimizer, loss_fn=loss_fn)
    weight = results["fp16"].model.get_parameter("weight")
    assert torch.isfinite(weight).all()
    torch.testing.assert_close(weight, results[None].model.get_parameter("weight"), rtol=0, atol=1e-6)
    torch.testing.assert_close(weight, torch.full((1, 4), 1 - 1e-6 * scale), rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_a_user_hook_sees_every_bucket_of_every_step_and_its_reduce_may_use_several_collectives() -> None:
    hook = Counting()
    torch.manual_seed(0)
    model = TiedNet()
    small: dict[str, Any] = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.001}
    exact = await train(None, model=copy.deepcopy(model), **small)
    counted = await train(hook, model=copy.deepcopy(model), **small)
    buckets = counted.stats.buckets
    assert buckets > 1
    # Every bucket of every step, in bucket order; the first step ran on the plan before its rebuild.
    first = len(hook.reduced) - (STEPS - 1) * buckets
    assert hook.reduced == list(range(first)) + list(range(buckets)) * (STEPS - 1)
    assert hook.calls == {"compress": 2 * len(hook.reduced), "reduce": len(hook.reduced), "decompress": 2 * len(hook.reduced)}
    # fp32 payloads in two halves: the same bytes as one uncompressed all-reduce, and the same result (to rounding:
    # w0*a + w1*b here, a + w1*(b - a) in the plain in-process path).
    assert counted.stats.reduced_bytes == exact.stats.reduced_bytes
    assert distance(counted.model, exact.model)[0] < 1e-5


@pytest.mark.asyncio
async def test_error_feedback_hook_tracks_fp32_more_closely_than_plain_bf16() -> None:
    exact = await train(None)
    plain = await train("bf16")
    feedback = await train(Bf16WithErrorFeedback())
    assert feedback.stats.reduced_bytes == plain.stats.reduced_bytes
    assert distance(feedback.model, exact.model)[1] < distance(plain.model, exact.model)[1]


class _Phases(torch.nn.Module):
    """A complex parameter, as in a model of phases or a spectral filter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.cfloat) * self.weight).abs().sum(-1)


@pytest.mark.asyncio
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
async def test_a_complex_gradient_is_compressed_with_its_imaginary_part(compression: str) -> None:
    torch.manual_seed(0)
    start = _Phases()
    batches = [(torch.randn(8, 4), torch.randn(8)) for _ in range(3)]

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05)

    plain = copy.deepcopy(start)
    opt = optimizer(list(plain.parameters()))
    for batch in batches:
        opt.zero_grad()
        loss_fn(plain, batch).backward()
        opt.step()
    engine = gsync.Engine(["cpu:0", "cpu:1"], compression=compression)
    result = await engine.fit(copy.deepcopy(start), batches, optimizer=optimizer, loss_fn=loss_fn)
    trained = result.model.get_parameter("weight")
    # Within the dtype's rounding (a dropped imaginary part was 0.5 off).
    torch.testing.assert_close(trained.imag, plain.weight.imag, rtol=0, atol=2e-2)
    torch.testing.assert_close(trained.real, plain.weight.real, rtol=0, atol=2e-2)
