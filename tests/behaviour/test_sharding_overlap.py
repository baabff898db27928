"""``shard_optimizer=True``: the all-gather after a step overlaps the next step's forward, and every reader of
the replicas still sees them whole.

The session's all-gather is held at one bucket (the head's, gathered last: the gather goes from the last bucket,
which holds the first layer, to the first) by a gate on its collective, which opens only once something that
reads the replicas waits for that bucket. So ``step`` returns with the gather unfinished, the next forward runs
its first layer before the head's bucket is in, and a checkpoint, an evaluation and the model handed back at the
end each wait for it, deterministically. Parameters are compared with a plain one-device loop within 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import pytest
import torch
from torch import nn

import gsync
from tests.support.gates import GatherGate, bucket_of
from tests.support.models import classification_loss, make_batches
from tests.support.reference import plain_loop

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

TINY = {"first_bucket_mb": 0.001, "bucket_cap_mb": 0.002}


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def make_model() -> nn.Sequential:
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def gate_on_head(
    session: gsync.Session, mode: Literal["open", "fail", "abort", "exit"] = "open", always: bool = False
) -> tuple[GatherGate, int]:
    """A gate on the bucket of the head's weight; and the first layer's bucket, gathered before it."""
    core = session._core  # noqa: SLF001 - the session's sharded step, which the gate wraps
    sharding = core._context.sharding
    assert sharding is not None
    head, first = bucket_of(sharding, "4.weight"), bucket_of(sharding, "0.weight")
    assert sharding.gather_order.index(first) < sharding.gather_order.index(head)
    return GatherGate(sharding, head, mode, always), first


def assert_close(actual: dict[str, torch.Tensor], expected: nn.Module) -> None:
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(actual[name], value, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def steps_of(count: int) -> list[list[Any]]:
    return [[batch] for batch in make_batches(count, 16)]


async def test_the_next_forward_runs_its_first_layers_while_the_last_buckets_are_gathered() -> None:
    model = make_model()
    steps = steps_of(4)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, **TINY)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=adamw, loss_fn=classification_loss) as session:
        gate, _ = gate_on_head(session)
        events = gate.events
        for actor in session._core._actors:  # noqa: SLF001 - after gsync's own hooks: runs once they let it
            actor.replica[0].register_forward_pre_hook(lambda module, args: events.append("first layer runs"))
            actor.replica[4].register_forward_pre_hook(lambda module, args: events.append("head runs"))
        gate.arm()
        await session.step(*steps[0])  # returns with the head's bucket not gathered
        assert "gathered" not in events
        events.clear()
        await session.step(*steps[1])
        # Device 0's first layer ran on the new parameters before the head's bucket was in; its head after.
        assert events.index("first layer runs") < events.index("reader waits") < events.index("gathered")
        assert events.index("gathered") < events.index("head runs")
        for batches in steps[2:]:
            await session.step(*batches)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    assert_close(trained.state_dict(), expected)


async def test_a_checkpoint_an_evaluation_and_the_end_wait_for_the_gather() -> None:
    model = make_model()
    steps = steps_of(3)
    held_out = make_batches(2, 10, seed=5)
    engine = gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], shard_optimizer=True, **TINY)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=adamw, loss_fn=classification_loss, clip_grad_norm=0.5) as session:
        gate, _ = gate_on_head(session)
        gate.arm()
        await session.step(*steps[0])
        checkpoint = session.checkpoint()  # waits, on the loop, for the gather the gate holds until it does
        assert gate.events == ["reader waits", "gathered"]
        gate.arm()
        await session.step(*steps[1])
        gate.events.clear()
        metrics = await session.evaluate(held_out, metric_fn=classification_loss)
        assert gate.events.count("gathered") == 1 and gate.events.index("reader waits") < gate.events.index("gathered")
        gate.arm()
        await session.step(*steps[2])
        gate.events.clear()
    # Each device waits at the end of the data, before the session hands the model back.
    assert gate.events.count("gathered") == 1 and gate.events.index("reader waits") < gate.events.index("gathered")
    after_one, _, _, _ = plain_loop(model, steps[:1], optimizer=adamw, clip=0.5)
    after_two, _, _, _ = plain_loop(model, steps[:2], optimizer=adamw, clip=0.5)
    after_three, _, _, _ = plain_loop(model, steps, optimizer=adamw, clip=0.5)
    assert checkpoint.step == 0
    assert_close(checkpoint.model_state, after_one)
    with torch.no_grad():
        want = sum(classification_loss(after_two, batch).item() for batch in held_out) / len(held_out)
    assert abs(next(iter(metrics.values())) - want) < 1e-5
    assert_close(trained.state_dict(), after_three)


async def test_a_failed_gather_fails_the_next_step_with_the_last_whole_step_as_its_checkpoint() -> None:
    model = make_model()
    steps = steps_of(3)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, **TINY)
    with pytest.raises(gsync.SyncFailed) as caught:
        async with engine.session(copy.deepcopy(model), optimizer=adamw, loss_fn=classification_loss) as session:
            gate, _ = gate_on_head(session, "fail")
            await session.step(*steps[0])
            await gate.sharding.whole()  # step 0's gather is done before the gate is armed for step 1's
            gate.arm()
            await session.step(*steps[1])  # its gather fails at the head's bucket
            await session.step(*steps[2])
    assert "all-gather" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
    # Each device's own slices are the step's: the failure's checkpoint puts them together.
    checkpoint = caught.value.checkpoint
    assert checkpoint is not None and checkpoint.step == 1
    expected, _, _, _ = plain_loop(model, steps[:2], optimizer=adamw)
    assert_close(checkpoint.model_state, expected)


async def test_a_device_failing_while_another_waits_on_the_gather_ends_the_session() -> None:
    """Device 1 fails in the next forward while device 0 waits in its head's hook for a gather that a lost peer
    would never finish: the abort flag ends both the gather and the wait."""
    import gsync.testing

    model = make_model()
    steps = steps_of(3)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, device_threads="per_device", **TINY)
    fault = gsync.testing.fail(device=1, step=1, site="forward")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.WorkerFailed) as caught:
        async with engine.session(copy.deepcopy(model), optimizer=adamw, loss_fn=classification_loss) as session:
            gate, _ = gate_on_head(session, "abort")
            gate.arm()
            for batches in steps:
                await session.step(*batches)
    assert caught.value.device_index == 1
    checkpoint = caught.value.checkpoint
    assert checkpoint is not None and checkpoint.step == 0
    expected, _, _, _ = plain_loop(model, steps[:1], optimizer=adamw)
    assert_close(checkpoint.model_state, expected)


async def test_a_gather_that_makes_no_progress_times_out_in_the_forward_waiting_for_it() -> None:
    model = make_model()
    steps = steps_of(2)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, device_threads="shared", sync_timeout=2.0, **TINY)
    with pytest.raises(gsync.SyncFailed, match="made no progress for 2.0 s"):
        async with engine.session(copy.deepcopy(model), optimizer=adamw, loss_fn=classification_loss) as session:
            gate, _ = gate_on_head(session, "abort")  # held until the session aborts: only the timeout ends it
            gate.arm()
            for batches in steps:
                await session.step(*batches)


class _ReadsInHooks(nn.Module):
    """A parametrized first layer (torch's weight_norm: its weight is computed from its parameters as it is read)
    and a head whose own forward pre-hook reads its weight, as the older weight_norm's hook does."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.utils.parametrizations.weight_norm(nn.Linear(12, 24))
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 5)
        self.head.register_forward_pre_hook(_scale_from_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.first(x))))) * self.head.scale


def _scale_from_weight(module: nn.Module, args: Any) -> None:
    module.scale = 1.0 + module.weight.abs().mean()


async def test_the_models_own_hooks_and_parametrizations_read_gathered_parameters() -> None:
    torch.manual_seed(22)
    model = _ReadsInHooks()
    steps = steps_of(3)
    # A bucket per parameter: only the head's own hooks wait for its weight's bucket, which the gate holds.
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=adamw, loss_fn=classification_loss) as session:
        sharding = session._core._context.sharding  # noqa: SLF001
        assert sharding is not None
        gate = GatherGate(sharding, bucket_of(sharding, "head.weight"), always=True)
        for batches in steps:
            await session.step(*batches)
    assert gate.events.count("gathered") == len(steps)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    assert_close(trained.state_dict(), expected)


async def test_a_compiled_model_waits_for_the_whole_gather_before_its_forward() -> None:
    """Hooks inside a compiled model would be compiled into its graph: it waits before its forward instead."""
    model = make_model()
    steps = steps_of(3)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, **TINY)
    inner = copy.deepcopy(model)
    compiled = torch.compile(inner, backend="aot_eager")
    async with engine.session(compiled, optimizer=adamw, loss_fn=classification_loss) as session:  # type: ignore[arg-type]
        gate, _ = gate_on_head(session, always=True)
        for batches in steps:
            await session.step(*batches)
    assert gate.events.count("gathered") == len(steps)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    assert_close(inner.state_dict(), expected)


class _ScalesInAList(nn.Module):
    """Its forward reads a parameter of its own nn.ParameterList, a container that is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 24)
        self.head = nn.Linear(24, 5)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(5))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))) * self.scales[0]


async def test_a_parameter_a_module_reads_from_its_own_parameter_list_is_gathered_first() -> None:
    torch.manual_seed(23)
    model = _ScalesInAList()
    steps = steps_of(3)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=True, first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
    trained = copy.deepcopy(model)
    async with engine.session(trained, optimizer=adamw, loss_fn=classification_loss) as session:
        sharding = session._core._context.sharding  # noqa: SLF001
        assert sharding is not None
        gate = GatherGate(sharding, bucket_of(sharding, "scales.0"), always=True)
        for batches in steps:
            await session.step(*batches)
    assert gate.events.count("gathered") == len(steps)
    expected, _, _, _ = plain_loop(model, steps, optimizer=adamw)
    assert_close(trained.state_dict(), expected)
