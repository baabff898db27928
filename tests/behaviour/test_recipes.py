"""Recipe features (schedules, clipping, accumulation, mixed precision) against the same recipe as a plain loop.

Each test writes the plain single-process PyTorch loop on the full global
batches, then runs the same recipe through ``session.step`` and ``fit``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from tests.support.gates import InfGradOnMarkedRows
from tests.support.inside import scalers_of
from tests.support.models import TiedNet, adamw, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, plain_loop, step_lr, train_reference

pytestmark = pytest.mark.asyncio

DEVICES = {1: ["cpu"], 2: ["cpu:0", "cpu:1"], 3: ["cpu:0", "cpu:1", "cpu:2"]}


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 3, total: int = 10) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


async def session_loop(engine: gsync.Engine, model: nn.Module, steps: Sequence[Sequence[Any]], **recipe: Any) -> tuple[nn.Module, list[gsync.StepResult], gsync.Checkpoint]:
    model = copy.deepcopy(model)
    results = []
    async with engine.session(model, loss_fn=classification_loss, **recipe) as session:
        for batches in steps:
            results.append(await session.step(*batches))
        checkpoint = session.checkpoint()
    return model, results, checkpoint


@pytest.mark.parametrize("num_devices", [1, 2, 3])
async def test_lr_schedule_matches_a_plain_loop_and_is_checkpointed(num_devices: int) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(6, 31)]
    expected, losses, lrs, _ = plain_loop(model, steps, scheduler=step_lr)
    engine = gsync.Engine(DEVICES[num_devices])
    trained, results, checkpoint = await session_loop(engine, model, steps, optimizer=sgd, scheduler=step_lr)
    assert_same_state(trained, expected)
    assert [r.lr for r in results] == pytest.approx(lrs)
    assert [r.loss for r in results] == pytest.approx(losses, abs=2e-5)
    assert checkpoint.scheduler_state is not None and checkpoint.scheduler_state["last_epoch"] == 6
    fitted = await engine.fit(copy.deepcopy(model), [b for [b] in steps], optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr)
    assert_same_state(fitted.model, expected)
    assert [record.lr for record in fitted.history] == pytest.approx(lrs)


def _masked_and_flagged() -> nn.Module:
    """A model as recipes make them: a gradient hook that freezes rows, and a flag an optimizer factory groups by."""
    torch.manual_seed(0)
    model = TiedNet()
    mask = torch.ones_like(model.embed.weight)
    mask[:5] = 0
    model.embed.weight.register_hook(lambda grad: grad * mask)
    model.embed.weight.no_weight_decay = True  # type: ignore[attr-defined]
    return model


def _grouped_by_flag(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    flagged = [p for p in params if getattr(p, "no_weight_decay", False)]
    rest = [p for p in params if not getattr(p, "no_weight_decay", False)]
    return torch.optim.SGD([{"params": rest, "weight_decay": 0.1}, {"params": flagged, "weight_decay": 0.0}], lr=0.1)


@pytest.mark.parametrize("num_devices", [1, 2])
async def test_a_parameters_gradient_hooks_and_attributes_reach_every_replica(num_devices: int) -> None:
    steps = make_batches(3, 16)
    reference = _masked_and_flagged()
    optimizer = _grouped_by_flag([p for p in reference.parameters() if p.requires_grad])
    for batch in steps:
        optimizer.zero_grad()
        classification_loss(reference, batch).backward()
        optimizer.step()
    model = _masked_and_flagged()
    frozen = model.embed.weight[:5].detach().clone()
    async with gsync.Engine(DEVICES[num_devices]).session(model, optimizer=_grouped_by_flag, loss_fn=classification_loss) as session:
        for batch in steps:
            await session.step(batch)
    assert torch.equal(model.embed.weight[:5], frozen)
    assert_same_state(model, reference)


async def test_a_post_accumulate_grad_hook_is_refused_up_front() -> None:
    model = TiedNet()
    model.embed.weight.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.raises(gsync.ConfigError, match="parameter embed.weight has a post-accumulate-grad hook"):
        async with gsync.Engine(DEVICES[2]).session(model, optimizer=sgd, loss_fn=classification_loss):
            pass


async def test_a_scheduler_class_is_a_factory_as_an_optimizer_class_is() -> None:
    # scheduler=LinearLR builds LinearLR(optimizer) per replica, as optimizer=SGD would build SGD(params) (were its
    # lr defaulted); the class has a step attribute, but it is not a scheduler already built.
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(6, 16)]
    expected, _, lrs, _ = plain_loop(model, steps, scheduler=torch.optim.lr_scheduler.LinearLR)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    trained, results, _ = await session_loop(
        engine, model, steps, optimizer=sgd, scheduler=torch.optim.lr_scheduler.LinearLR
    )
    assert len(set(lrs)) > 1  # the schedule moved the rate
    assert [r.lr for r in results] == pytest.approx(lrs)
    assert_same_state(trained, expected)


async def test_a_resumed_session_continues_the_schedule_exactly() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(6, 16)]
    expected, _, lrs, _ = plain_loop(model, steps, scheduler=step_lr)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    _, _, halfway = await session_loop(engine, model, steps[:3], optimizer=sgd, scheduler=step_lr)
    resumed = copy.deepcopy(model)
    async with engine.session(resumed, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr, resume=halfway) as session:
        assert session.next_step == 3
        results = [await session.step(*batches) for batches in steps[3:]]
    assert [r.step for r in results] == [3, 4, 5]
    assert [r.lr for r in results] == pytest.approx(lrs[3:])
    assert_same_state(resumed, expected)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
async def test_clipping_clips_the_reduced_gradient_like_one_device(num_devices: int) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(5, 31)]
    expected, _, _, norms = plain_loop(model, steps, clip=0.05)
    assert all(norm > 0.05 for norm in norms)  # the clip really clips
    engine = gsync.Engine(DEVICES[num_devices])
    trained, results, _ = await session_loop(engine, model, steps, optimizer=sgd, clip_grad_norm=0.05)
    assert_same_state(trained, expected)
    assert [r.grad_norm for r in results] == pytest.approx(norms, rel=1e-5)


async def test_a_fits_history_has_the_gradient_norm_and_every_groups_learning_rate() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(4, 31)]
    _, _, _, norms = plain_loop(model, steps, clip=0.05)

    def two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # The head learns 10x faster, as a factory that groups parameters gives it.
        groups: list[dict[str, Any]] = [{"params": params[:-2]}, {"params": params[-2:], "lr": 1.0}]
        return torch.optim.SGD(groups, lr=0.1)

    def halve(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)

    engine = gsync.Engine(DEVICES[2])
    fitted = await engine.fit(
        copy.deepcopy(model), [b for [b] in steps], optimizer=two_groups, loss_fn=classification_loss,
        scheduler=halve, clip_grad_norm=0.05,
    )
    # Each step's rates before the scheduler stepped, every group's; lr stays the first group's.
    assert [record.lrs for record in fitted.history] == [(0.1, 1.0), (0.1, 1.0), (0.05, 0.5), (0.05, 0.5)]  # halving is exact
    assert [record.lr for record in fitted.history] == pytest.approx([0.1, 0.1, 0.05, 0.05])
    _, results, _ = await session_loop(engine, model, steps, optimizer=two_groups, scheduler=halve, clip_grad_norm=0.05)
    assert [r.lrs for r in results] == [record.lrs for record in fitted.history]
    # The norm a StepResult has, a StepRecord has: the reduced gradient's before clipping. The first step's comes
    # before any update, so the plain loop's (one group) is the same.
    assert fitted.history[0].grad_norm == pytest.approx(norms[0], rel=1e-5)
    assert [record.grad_norm for record in fitted.history] == [r.grad_norm for r in results]
    # Built by hand with one rate, as before lrs existed: lrs holds it.
    assert gsync.StepResult(step=0, loss=1.0, lr=0.1, rows=8, seconds=0.1).lrs == (0.1,)


async def test_a_compiled_model_trains_as_a_plain_loop_does() -> None:
    # torch.compile's graph capture and AOTAutograd on every replica (each device's copy of the compiled module);
    # inductor adds only the generated kernels (it matched too, run by hand: 17 s of compiling on 2 cores).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
    batches = make_batches(3, 16)
    expected, expected_losses = train_reference(model, batches)
    inner = copy.deepcopy(model)
    compiled = torch.compile(inner, backend="aot_eager")
    result = await gsync.Engine(DEVICES[2]).fit(compiled, batches, optimizer=sgd, loss_fn=classification_loss)  # type: ignore[arg-type]  # an nn.Module, typed by torch as a callable
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert result.model is compiled
    assert_same_state(inner, expected)  # the module compiled, which the trained weights reach


@pytest.mark.parametrize("num_devices", [1, 2, 3])
async def test_accumulation_is_exact_and_moves_bytes_once_per_step(num_devices: int) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    # Uneven batches of different sizes: each batch's weight is its own.
    batches = make_batches(8, 13) + make_batches(4, 19, seed=1)
    steps = [batches[i : i + 4] for i in range(0, 12, 4)]
    expected, losses, _, _ = plain_loop(model, steps)
    engine = gsync.Engine(DEVICES[num_devices], first_bucket_mb=0.01, bucket_cap_mb=0.02)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=sgd, loss_fn=classification_loss) as session:
        results = [await session.step(*group) for group in steps]
        stats = session.stats
    assert_same_state(trained, expected)
    assert [r.loss for r in results] == pytest.approx(losses, abs=2e-5)
    assert [r.rows for r in results] == [52, 52 + 0 * 1, 76]
    # The first three backward passes of each step posted nothing and reduced nothing.
    assert stats.bucket_ready_messages == len(steps) * num_devices * stats.buckets
    # One device alone has nothing to reduce: its reduction is skipped.
    assert stats.reduced_bytes == (0 if num_devices == 1 else len(steps) * sum(stats.bucket_sizes))


async def test_fit_accumulates_and_drops_a_trailing_partial_group_with_a_warning() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(10, 16)
    expected, losses, _, _ = plain_loop(model, [batches[0:4], batches[4:8]])
    with pytest.warns(UserWarning, match="2 batch\\(es\\) that do not fill a step of accumulate=4"):
        result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(
            copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss, accumulate=4
        )
    assert_same_state(result.model, expected)
    assert result.losses == pytest.approx(losses, abs=2e-5)
    assert result.stats.reduced_bytes == 2 * sum(result.stats.bucket_sizes)


async def test_adamw_with_warmup_cosine_and_clipping_matches_on_losses() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(10, 24)]
    _, losses, lrs, _ = plain_loop(model, steps, optimizer=adamw, scheduler=warmup_cosine, clip=1.0)
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"])
    _, results, _ = await session_loop(engine, model, steps, optimizer=adamw, scheduler=warmup_cosine, clip_grad_norm=1.0)
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-4)
    assert [r.lr for r in results] == pytest.approx(lrs)


async def test_bf16_autocast_matches_a_plain_bf16_loop() -> None:
    torch.manual_seed(0)
    model = TiedNet()
    steps = [[batch] for batch in make_batches(5, 32)]
    _, losses, _, _ = plain_loop(model, steps, autocast=torch.bfloat16)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    trained, results, _ = await session_loop(engine, model, steps, optimizer=sgd, autocast=torch.bfloat16)
    # bf16 rounds each shard's matmuls on its own: equal to bf16 precision, not bit for bit.
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-3)
    assert all(p.dtype == torch.float32 for p in trained.parameters())


def loss_with_inf_grad_on_marked_rows(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    marked = bool((x[:, 0] == 1000.0).any())
    logits = InfGradOnMarkedRows.apply(model(x.clamp(max=10.0)), marked)
    return torch.nn.functional.cross_entropy(logits, y)


async def test_fp16_grad_scalers_agree_when_one_device_overflows() -> None:
    torch.manual_seed(0)
    batches = make_batches(4, 8)
    x, y = batches[1]
    x = x.clone()
    x[-1, 0] = 1000.0  # the last row lands on device 1 only
    batches[1] = (x, y)
    engine = gsync.Engine(["cpu:0", "cpu:1"], check_replicas_every=1)
    async with engine.session(TiedNet(), optimizer=sgd, loss_fn=loss_with_inf_grad_on_marked_rows, autocast=torch.float16) as session:
        results = [await session.step(batch) for batch in batches]
        scales = [scaler.get_scale() for scaler in scalers_of(session)]
        checkpoint = session.checkpoint()
    assert [r.skipped for r in results] == [False, True, False, False]
    assert scales[0] == scales[1] == 65536.0 / 2
    assert checkpoint.scaler_state is not None and checkpoint.scaler_state["scale"] == 32768.0


class Dense(nn.Module):
    """Every parameter gets a gradient on every non-empty shard, in several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.mark.parametrize("rows", [[8, 8, 1], [8, 1, 8]])
async def test_a_device_with_an_empty_shard_still_posts_every_bucket(rows: list[int]) -> None:
    """A DataLoader's short last batch leaves some devices without rows; the step must not stall."""
    torch.manual_seed(0)
    model = Dense()
    batches = [make_batches(1, n, seed=i)[0] for i, n in enumerate(rows)]
    expected, losses = train_reference(model, batches)
    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.001, bucket_cap_mb=0.002, sync_timeout=10)
    result = await engine.fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss)
    assert result.stats.buckets >= 2
    assert_same_state(result.model, expected)
    assert result.losses == pytest.approx(losses, abs=2e-5)


async def test_accumulation_whose_last_batch_leaves_a_device_empty() -> None:
    torch.manual_seed(0)
    model = Dense()
    steps = [[make_batches(1, 8, seed=1)[0], make_batches(1, 1, seed=2)[0]], [make_batches(1, 5, seed=3)[0], make_batches(1, 1, seed=4)[0]]]
    expected, losses, _, _ = plain_loop(model, steps)
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], first_bucket_mb=0.001, bucket_cap_mb=0.002, sync_timeout=10)
    trained, results, _ = await session_loop(engine, model, steps, optimizer=sgd)
    assert_same_state(trained, expected)
    assert [r.loss for r in results] == pytest.approx(losses, abs=2e-5)
