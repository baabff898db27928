"""``Engine(shard_optimizer=True)``: the same training as unsharded and as a plain loop, with 1/N of the state.

Each case trains the same model three ways (a plain one-device loop, gsync unsharded, gsync sharded) on 2
and 3 in-process devices, with buckets small enough that most are split unevenly, and compares parameters
within 1e-5. The multi-process half (2 processes over gloo, and 2 x 2) is
``tests/multiproc/test_sharding_multiprocess.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from gsync.comm._shards import shard_bounds
from tests.support.models import TINY, TiedNet, adam, adamw, classification_loss, make_batches, momentum
from tests.support.reference import assert_same_optimizer_state, plain_loop, step_lr

pytestmark = pytest.mark.asyncio


def grouped_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Groups chosen by shape, as recipes do (no decay on biases): the factory sees whole parameters."""
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
    )


OPTIMIZERS = {"sgd_momentum": momentum, "adam": adam, "adamw": adamw, "grouped_adamw": grouped_adamw}


def steps_of(accumulate: int, steps: int = 4, rows: int = 31) -> list[list[Any]]:
    batches = make_batches(steps * accumulate, rows)
    return [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]


async def train(
    model: nn.Module,
    steps: Sequence[Sequence[Any]],
    devices: int,
    shard: bool,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    engine: dict[str, Any] | None = None,
    **recipe: Any,
) -> tuple[nn.Module, list[float], gsync.Checkpoint, list[torch.optim.Optimizer]]:
    model = copy.deepcopy(model)
    losses = []
    eng = gsync.Engine([f"cpu:{i}" for i in range(devices)], shard_optimizer=shard, **{**TINY, **(engine or {})})
    async with eng.session(model, optimizer=optimizer, loss_fn=classification_loss, **recipe) as session:
        for batches in steps:
            losses.append((await session.step(*batches)).loss)
        checkpoint = session.checkpoint()
        optimizers = list(session.optimizers)
    model.load_state_dict(checkpoint.model_state)
    return model, losses, checkpoint, optimizers


def assert_close_models(actual: nn.Module, expected: nn.Module, atol: float = 1e-5) -> None:
    want = expected.state_dict()
    for name, value in actual.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def state_elements(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


# Every optimizer over 3 devices, whose shards cut most buckets unevenly; over 2, one of them (each optimizer's
# state is sharded by the same code whatever the device count).
@pytest.mark.parametrize(("name", "devices"), [*((name, 3) for name in sorted(OPTIMIZERS)), ("adamw", 2)])
async def test_sharded_equals_unsharded_and_the_plain_loop_with_clipping_and_accumulation(name: str, devices: int) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = steps_of(accumulate=2)
    optimizer = OPTIMIZERS[name]
    expected, expected_losses, _, _ = plain_loop(model, steps, optimizer=optimizer, clip=0.5)
    unsharded, _, whole, _ = await train(model, steps, devices, False, optimizer, clip_grad_norm=0.5)
    sharded, losses, gathered, optimizers = await train(model, steps, devices, True, optimizer, clip_grad_norm=0.5)

    assert_close_models(sharded, expected)
    assert_close_models(sharded, unsharded)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=1e-5, rtol=0)
    # Each device holds the state of its shard only (a parameter cut between shards counts on both sides).
    per_device = [state_elements(opt) for opt in optimizers]
    whole_elements = sum(
        v.numel() for s in whole.optimizer_state["state"].values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    assert sum(per_device) == whole_elements > 0
    assert max(per_device) <= whole_elements // devices + 1 * len(whole.optimizer_state["state"]), per_device
    # The checkpoint holds the whole state, in the unsharded format.
    assert_same_optimizer_state(gathered.optimizer_state, whole.optimizer_state)


async def test_uneven_splits_and_shards_of_nothing() -> None:
    """3 devices over buckets of 5 (bias) and 24x12 elements: some shards cut a parameter mid-row, some are
    of nothing at all (a bucket of fewer elements than devices)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2))
    model[2].bias.data = model[2].bias.data[:2]  # 2 elements: one device of 3 owns none of its bucket
    steps = [[batch] for batch in make_batches(4, 13, d_in=7, classes=2)]
    tiny = {"first_bucket_mb": 1e-6, "bucket_cap_mb": 1e-6}  # a bucket per parameter
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    sharded, _, _, optimizers = await train(model, steps, 3, True, adamw, engine=tiny)
    assert_close_models(sharded, expected)
    assert shard_bounds(2, 3)[2] == (2, 2)  # device 2 owns nothing of the last bias's bucket
    assert len({state_elements(opt) for opt in optimizers}) > 1  # uneven


async def test_a_scheduler_and_evaluation_behave_as_unsharded() -> None:
    torch.manual_seed(2)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=5)
    expected, _, lrs, _ = plain_loop(model, steps, optimizer=adam, scheduler=step_lr)
    eng = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], shard_optimizer=True, **TINY)
    trained = copy.deepcopy(model)
    async with eng.session(trained, optimizer=adam, loss_fn=classification_loss, scheduler=step_lr) as session:
        seen = [(await session.step(*batches)).lr for batches in steps]
        metrics = await session.evaluate(make_batches(2, 17, seed=9), metric_fn=classification_loss)
    assert seen == lrs
    assert_close_models(trained, expected)
    with torch.no_grad():
        want = sum(classification_loss(expected, batch).item() * 17 for batch in make_batches(2, 17, seed=9)) / 34
    assert abs(next(iter(metrics.values())) - want) < 1e-5


class _Partly(nn.Module):
    """A frozen layer, a parameter no batch uses, and one used only by some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(12, 24)
        self.never = nn.Parameter(torch.randn(7))
        self.sometimes = nn.Linear(24, 5)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.frozen(x)))
        if x[0, 11] > 0:  # the same on every row of a batch: every device, and the plain loop, agree
            return self.head(h) + self.sometimes(h)
        return self.head(h)


@pytest.mark.parametrize("devices", [2, 3])
async def test_unused_and_frozen_parameters_behave_as_unsharded(devices: int) -> None:
    torch.manual_seed(3)
    model = _Partly()
    steps = steps_of(accumulate=1, steps=5)
    for index, (batch,) in enumerate(steps):
        batch[0][:, 11] = 1.0 if index % 2 else -1.0
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    unsharded, _, whole, _ = await train(model, steps, devices, False, adamw)
    sharded, _, gathered, _ = await train(model, steps, devices, True, adamw)
    assert_close_models(sharded, expected)
    assert_close_models(sharded, unsharded)
    assert_same_optimizer_state(gathered.optimizer_state, whole.optimizer_state)


class _Overflow(torch.autograd.Function):
    """Identity forward; at the marked step, an inf in one element of the gradient (on one shard only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marked: bool) -> torch.Tensor:
        ctx.marked = marked
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.marked:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad, None


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 40)
        self.head = nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_Overflow.apply(torch.relu(self.first(x)), bool(x[0, 1] > 10)))


async def test_fp16_autocast_skips_an_overflowing_step_on_every_shard_as_unsharded() -> None:
    torch.manual_seed(4)
    model = _Scaled()
    steps = steps_of(accumulate=1, steps=5)
    steps[2][0][0][0, 1] = 100.0  # step 2's gradient overflows in the head's weights
    recipe = {"autocast": torch.float16, "clip_grad_norm": 1.0}
    unsharded, _, whole, _ = await train(model, steps, 2, False, adamw, **recipe)
    sharded, _, gathered, _ = await train(model, steps, 2, True, adamw, **recipe)
    assert_close_models(sharded, unsharded)
    assert gathered.scaler_state == whole.scaler_state and whole.scaler_state["scale"] < 65536.0
    assert_same_optimizer_state(gathered.optimizer_state, whole.optimizer_state)


async def test_a_nonfinite_loss_skips_the_step_on_every_shard() -> None:
    torch.manual_seed(5)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=4)
    steps[1][0][0][3, :] = float("nan")
    engine = {"on_nonfinite": "skip"}
    unsharded, _, _, _ = await train(model, steps, 3, False, adamw, engine=engine)
    sharded, _, _, _ = await train(model, steps, 3, True, adamw, engine=engine)
    assert_close_models(sharded, unsharded)


async def test_replicas_are_compared_once_gathered() -> None:
    torch.manual_seed(6)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=3)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adam)
    sharded, _, _, _ = await train(model, steps, 2, True, adam, engine={"check_replicas_every": 1})
    assert_close_models(sharded, expected)


async def test_compression_reduces_whole_buckets_when_sharded() -> None:
    torch.manual_seed(7)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=4)
    engine = {"compression": "bf16"}
    unsharded, _, _, _ = await train(model, steps, 2, False, adamw, engine=engine)
    sharded, _, _, _ = await train(model, steps, 2, True, adamw, engine=engine)
    assert_close_models(sharded, unsharded)


async def test_shard_optimizer_is_refused_with_elastic_and_for_anything_but_a_bool() -> None:
    with pytest.raises(gsync.ConfigError, match="cannot be elastic"):
        gsync.Engine(["cpu:0"], shard_optimizer=True, elastic=True)
    with pytest.raises(gsync.ConfigError, match="True or False"):
        gsync.Engine(["cpu:0"], shard_optimizer="yes")  # type: ignore[arg-type]


async def test_a_parameter_that_is_not_contiguous_is_refused_before_any_work() -> None:
    model = nn.Linear(4, 3)
    model.weight.data = model.weight.data.t().contiguous().t()
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True)
    with pytest.raises(gsync.ConfigError, match="weight is not contiguous"):
        await engine.fit(model, make_batches(1, 8, d_in=3), optimizer=adam, loss_fn=classification_loss)


# --------------------------------------------------------------------------------------------------
# Checkpoints: the whole state, in the unsharded format; resumed across shardings and device counts
# --------------------------------------------------------------------------------------------------


async def run_from(
    model: nn.Module, steps: Sequence[Sequence[Any]], devices: int, shard: bool, resume: gsync.Checkpoint | None
) -> tuple[nn.Module, gsync.Checkpoint]:
    trained = copy.deepcopy(model)
    eng = gsync.Engine([f"cpu:{i}" for i in range(devices)], shard_optimizer=shard, **TINY)
    async with eng.session(trained, optimizer=adamw, loss_fn=classification_loss, clip_grad_norm=0.5, scheduler=step_lr, resume=resume) as session:
        for batches in steps:
            await session.step(*batches)
        checkpoint = session.checkpoint()
    trained.load_state_dict(checkpoint.model_state)
    return trained, checkpoint


@pytest.mark.parametrize(
    "first, then",
    [((2, True), (3, False)), ((2, True), (3, True)), ((3, False), (2, True)), ((3, True), (2, True)), ((2, True), (1, False))],
    ids=["2sharded-3unsharded", "2sharded-3sharded", "3unsharded-2sharded", "3sharded-2sharded", "2sharded-1"],
)
async def test_a_run_resumes_across_shardings_and_device_counts_exactly(
    first: tuple[int, bool], then: tuple[int, bool], tmp_path: Any
) -> None:
    torch.manual_seed(8)
    model = TiedNet()
    steps = steps_of(accumulate=2, steps=4)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw, scheduler=step_lr, clip=0.5)
    _, halfway = await run_from(model, steps[:2], *first, resume=None)
    # Through a file, as fit's checkpoint_dir= and resume= take it.
    halfway = gsync.Checkpoint.load(halfway.save(tmp_path / "halfway.pt"))
    resumed, _ = await run_from(model, steps[2:], *then, resume=halfway)
    assert_close_models(resumed, expected)


async def test_a_sharded_checkpoint_is_the_unsharded_one() -> None:
    torch.manual_seed(9)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=3)
    _, whole = await run_from(model, steps, 3, False, resume=None)
    _, gathered = await run_from(model, steps, 3, True, resume=None)
    assert gathered.step == whole.step
    assert_same_optimizer_state(gathered.optimizer_state, whole.optimizer_state)
    assert gathered.scheduler_state == whole.scheduler_state
    for name, value in whole.model_state.items():
        torch.testing.assert_close(gathered.model_state[name], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("site", ["forward", "all_reduce"])
async def test_a_failure_mid_step_leaves_the_last_whole_step_as_its_checkpoint(site: str) -> None:
    import gsync.testing

    torch.manual_seed(10)
    model = TiedNet()
    steps = steps_of(accumulate=1, steps=4)
    expected, _, _, _ = plain_loop(model, steps[:2], optimizer=adamw, scheduler=step_lr, clip=0.5)
    eng = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], shard_optimizer=True, **TINY)
    fault = gsync.testing.fail(device=1, step=2, site=site)  # type: ignore[arg-type]
    trained = copy.deepcopy(model)
    with gsync.testing.inject(eng, fault), pytest.raises(gsync.GsyncError) as caught:
        async with eng.session(trained, optimizer=adamw, loss_fn=classification_loss, clip_grad_norm=0.5, scheduler=step_lr) as session:
            for batches in steps:
                await session.step(*batches)
    checkpoint = caught.value.checkpoint
    assert checkpoint is not None and checkpoint.step == 1
    restored = copy.deepcopy(model)
    restored.load_state_dict(checkpoint.model_state)
    assert_close_models(restored, expected)
    # And it goes on from there as the uninterrupted run does.
    uninterrupted, _, _, _ = plain_loop(model, steps, optimizer=adamw, scheduler=step_lr, clip=0.5)
    resumed, _ = await run_from(model, steps[2:], 2, True, resume=checkpoint)
    assert_close_models(resumed, uninterrupted)


async def test_a_failure_inside_one_devices_optimizer_step_says_no_step_is_whole() -> None:
    """Device 1 fails as its optimizer step starts, the others have stepped their shards: neither step's state
    exists anywhere (each shard's only copy moved on, or did not), so the failure carries no checkpoint and says
    why; the last checkpoint file is where to resume from."""
    import gsync.testing

    torch.manual_seed(11)
    eng = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], shard_optimizer=True, **TINY)
    fault = gsync.testing.fail(device=1, step=2, site="optimizer")
    with gsync.testing.inject(eng, fault), pytest.raises(gsync.WorkerFailed) as caught:
        async with eng.session(TiedNet(), optimizer=adamw, loss_fn=classification_loss) as session:
            for batches in steps_of(accumulate=1, steps=4):
                await session.step(*batches)
    if caught.value.checkpoint is None:
        assert any("no step's state is whole" in note for note in caught.value.__notes__)
    else:  # the other devices had not begun theirs: the step before is whole
        assert caught.value.checkpoint.step == 1


async def test_an_optimizer_that_is_not_elementwise_is_refused_as_the_session_opens() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True)
    lbfgs = lambda params: torch.optim.LBFGS(params)  # noqa: E731
    with pytest.raises(gsync.ConfigError, match="LBFGS reevaluates"):
        async with engine.session(TiedNet(), optimizer=lbfgs, loss_fn=classification_loss):
            pass


async def test_the_trace_shows_each_buckets_all_gather_within_its_step() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, trace=True, **TINY)
    result = await engine.fit(TiedNet(), make_batches(3, 16), optimizer=adam, loss_fn=classification_loss, progress=False)
    trace = result.trace
    assert trace is not None
    for step in range(3):
        gathers = trace.select("all_gather", step)
        assert sorted(event.bucket for event in gathers) == list(range(result.stats.buckets))
        assert all(event.device == -1 and event.nbytes > 0 for event in gathers)
        last_optimizer = max(event.end_us for event in trace.select("optimizer", step))
        assert min(event.start_us for event in gathers) >= last_optimizer  # after every device stepped
