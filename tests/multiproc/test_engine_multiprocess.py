"""gsync.Engine across 2 real processes (gloo on loopback), as torchrun starts them."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import state_of, train_reference

STEPS = 5
ROWS = 19  # uneven over 2 and over 4 devices


def train_everywhere() -> dict[str, Any]:
    """Each rank: DDP, then gsync with 1 and 2 local devices, then process-local data and a user group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gsync

    rank = int(os.environ["RANK"])
    # Rank 1 starts from different weights: gsync must broadcast rank 0's.
    torch.manual_seed(0 if rank == 0 else 1)
    model = TiedNet()
    batches = make_batches(STEPS, ROWS)
    out: dict[str, Any] = {}

    async def fits() -> None:
        one = await gsync.Engine(["cpu"], sync_timeout=30).fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss)
        out["gsync_1x2"] = (state_of(one.model), one.losses)
        two = await gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=30).fit(copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss)
        out["gsync_2x2"] = (state_of(two.model), two.losses)
        # Process-local data: each rank feeds its own half of every batch.
        local = [tuple(t[rank::2] for t in batch) for batch in make_batches(STEPS, 20)]
        three = await gsync.Engine(["cpu"], sync_timeout=30).fit(
            copy.deepcopy(model), local, optimizer=sgd, loss_fn=classification_loss, process_local_data=True
        )
        out["local"] = (state_of(three.model), three.losses)

    asyncio.run(fits())

    # torch DDP on the same data: each rank trains on its contiguous half of each batch.
    dist.init_process_group("gloo")
    ddp_model = copy.deepcopy(model)
    for param in ddp_model.parameters():
        dist.broadcast(param.data, src=0)
    ddp = DistributedDataParallel(ddp_model, find_unused_parameters=True)
    optimizer = sgd([p for p in ddp.parameters() if p.requires_grad])
    half = [tuple(torch.tensor_split(t, 2)[rank] for t in batch) for batch in make_batches(STEPS, 20)]
    for x, y in half:
        optimizer.zero_grad(set_to_none=True)
        classification_loss(ddp, (x, y)).backward()
        optimizer.step()
    out["ddp"] = state_of(ddp.module)

    async def with_user_group() -> None:
        result = await gsync.Engine(["cpu"], process_group=dist.group.WORLD, sync_timeout=30).fit(
            copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss
        )
        out["user_group"] = state_of(result.model)
        # The user's group is left up.
        probe = torch.ones(1)
        dist.all_reduce(probe)
        out["group_still_up"] = float(probe.item())

    asyncio.run(with_user_group())
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_matches_one_device_training_and_ddp() -> None:
    results = run_ranks(train_everywhere, 2, timeout=100, check=True)
    torch.manual_seed(0)
    model = TiedNet()
    expected, expected_losses = train_reference(model, make_batches(STEPS, ROWS))
    expected_20, _ = train_reference(model, make_batches(STEPS, 20))
    reference = state_of(expected)
    reference_20 = state_of(expected_20)
    for result in results:
        out = result.value
        for key in ("gsync_1x2", "gsync_2x2"):
            state, losses = out[key]
            for name, value in state.items():
                torch.testing.assert_close(value, reference[name], atol=2e-5, rtol=0, msg=f"{key} rank {result.rank} {name}")
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=2e-5, rtol=0)
        local_state, _ = out["local"]
        for name, value in out["ddp"].items():
            # DDP and gsync with process-local data see the same halves: same parameters.
            torch.testing.assert_close(local_state[name], value, atol=2e-5, rtol=0, msg=f"ddp rank {result.rank} {name}")
            torch.testing.assert_close(value, reference_20[name], atol=2e-5, rtol=0)
        for name, value in out["user_group"].items():
            torch.testing.assert_close(value, reference[name], atol=2e-5, rtol=0)
        assert out["group_still_up"] == 2.0


def fail_on_rank_1() -> dict[str, Any]:
    import gsync
    import gsync.testing

    rank = int(os.environ["RANK"])
    engine = gsync.Engine(["cpu"], sync_timeout=20)
    faults = [gsync.testing.fail(0, 2, "backward", error=RuntimeError("boom on rank 1"))] if rank == 1 else []
    started = time.monotonic()
    try:
        with gsync.testing.inject(engine, *faults):
            asyncio.run(engine.fit(TiedNet(), make_batches(STEPS, 8), optimizer=sgd, loss_fn=classification_loss))
    except gsync.GsyncError as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "rank": getattr(error, "rank", None),
            "step": getattr(error, "step", None),
            "last_step": error.last_step,
            "elapsed": time.monotonic() - started,
        }
    return {"type": None}


@pytest.mark.timeout(90)
def test_a_failed_rank_is_named_on_every_other_rank() -> None:
    failed, peer = sorted(run_ranks(fail_on_rank_1, 2, timeout=80, check=True), key=lambda r: -r.rank)
    assert failed.value["type"] == "WorkerFailed" and failed.value["step"] == 2
    assert peer.value["type"] == "PeerFailed"
    assert peer.value["rank"] == 1 and peer.value["step"] == 2
    assert "rank 1 failed" in peer.value["message"] and "boom on rank 1" in peer.value["message"]
    assert peer.value["elapsed"] < 20  # well within sync_timeout, not a hang
    assert peer.value["last_step"] in (1, None) or peer.value["last_step"] <= 2


def _config_error_of_fit(model: torch.nn.Module, data: Any, **fit_args: Any) -> str:
    """The ConfigError this rank's fit raises, as text ("no error" if none)."""
    import gsync

    engine = gsync.Engine(["cpu"], sync_timeout=20)
    try:
        asyncio.run(engine.fit(model, data, optimizer=sgd, loss_fn=classification_loss, **fit_args))
    except gsync.ConfigError as error:
        return str(error)
    return "no error"


def mismatched_model() -> str:
    rank = int(os.environ["RANK"])
    return _config_error_of_fit(TiedNet(hidden=24 if rank == 0 else 25), make_batches(2, 8))


def only_rank_0_resumes() -> str:
    import gsync

    rank = int(os.environ["RANK"])
    model = TiedNet()
    trainable = [p for p in model.parameters() if p.requires_grad]
    resume = gsync.Checkpoint.capture(2, model, sgd(trainable)) if rank == 0 else None
    return _config_error_of_fit(model, make_batches(5, 8), resume=resume)


def refused_starts() -> dict[str, str]:
    """Each rank: the starts every rank refuses, one after the other in the same two processes (a refused start
    leaves nothing behind, and two processes started once cost less than twice)."""
    return {"mismatched_model": mismatched_model(), "only_rank_0_resumes": only_rank_0_resumes()}


@pytest.fixture(scope="module")
def refusals() -> list[dict[str, str]]:
    return [result.value for result in run_ranks(refused_starts, 2, timeout=80, check=True)]


@pytest.mark.timeout(90)
def test_parameter_mismatch_is_refused_on_every_rank_naming_parameter_and_rank(refusals: list[dict[str, str]]) -> None:
    for refused in refusals:
        assert "embed.weight" in refused["mismatched_model"] and "rank 1" in refused["mismatched_model"], refused


@pytest.mark.timeout(90)
def test_ranks_resuming_from_different_steps_are_refused_on_every_rank(refusals: list[dict[str, str]]) -> None:
    for refused in refusals:
        assert "rank 0 at step 3, rank 1 at step 0" in refused["only_rank_0_resumes"], refused


def killed_at_step_2() -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])

    # From this rank's step 2, when its peer dies: what comes before (process group, replicas, the first steps)
    # can take seconds on a loaded machine and is not what the test bounds.
    step_2_started: list[float] = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if model.calls == 2:
            step_2_started.append(time.monotonic())
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        model.calls += 1
        return classification_loss(model, batch)

    model = TiedNet()
    model.calls = 0  # type: ignore[assignment]
    try:
        asyncio.run(gsync.Engine(["cpu"], sync_timeout=5).fit(model, make_batches(STEPS, 8), optimizer=sgd, loss_fn=loss_fn))
    except gsync.GsyncError as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "elapsed": time.monotonic() - step_2_started[0] if step_2_started else None,
            "rank": getattr(error, "rank", None),
            "step": getattr(error, "step", None),
            "cause": type(error.__cause__).__name__,
        }
    return {"type": None}


@pytest.mark.timeout(90)
def test_a_killed_rank_is_named_by_the_others_within_the_timeout() -> None:
    # The survivor must raise within sync_timeout + 5 s of its peer's death (asserted below) and exit cleanly; on a
    # loaded machine its process exit after a dead peer can take a few seconds more than the harness's default 5 s
    # grace.
    results = run_ranks(killed_at_step_2, 2, timeout=80, failure_grace=20)
    survivor = results[0]
    assert results[1].returncode == -signal.SIGKILL
    assert survivor.ok, survivor.traceback or survivor.stderr
    # Named from its heartbeat, at the step it died in; the collective's own error is the cause.
    assert survivor.value["type"] == "PeerLost", survivor.value
    assert survivor.value["rank"] == 1 and survivor.value["step"] == 2, survivor.value
    assert "rank 1 stopped responding at step 2" in survivor.value["message"], survivor.value
    assert survivor.value["cause"] in ("SyncFailed", "SyncTimeout"), survivor.value
    assert survivor.value["elapsed"] is not None and survivor.value["elapsed"] < 5 + 5, survivor.value


def uneven_data_lengths() -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])
    batches = make_batches(4 if rank == 0 else 3, 8)
    started = time.monotonic()
    try:
        asyncio.run(
            gsync.Engine(["cpu"], sync_timeout=20).fit(
                TiedNet(), batches, optimizer=sgd, loss_fn=classification_loss, process_local_data=True
            )
        )
    except gsync.GsyncError as error:
        return {"type": type(error).__name__, "message": str(error), "last_step": error.last_step, "elapsed": time.monotonic() - started}
    return {"type": None}


@pytest.mark.timeout(90)
def test_ranks_whose_data_ends_at_different_steps_are_stopped_together() -> None:
    for result in run_ranks(uneven_data_lengths, 2, timeout=80, check=True):
        assert result.value["type"] == "ConfigError", result.value
        assert "no data after step 2" in result.value["message"]
        assert result.value["last_step"] == 1  # step 2 was reduced but not applied: the ranks disagreed there
        assert result.value["elapsed"] < 20


def data_fails_on_rank_1() -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])

    def batches() -> Any:
        for step, batch in enumerate(make_batches(STEPS, 8)):
            if rank == 1 and step == 2:
                raise OSError("disk gone on rank 1")
            yield batch

    try:
        asyncio.run(gsync.Engine(["cpu"], sync_timeout=20).fit(TiedNet(), batches(), optimizer=sgd, loss_fn=classification_loss))
    except gsync.GsyncError as error:
        return {"type": type(error).__name__, "message": str(error), "last_step": error.last_step}
    return {"type": None}


@pytest.mark.timeout(90)
def test_a_data_failure_on_one_rank_is_reported_as_itself() -> None:
    peer, failed = run_ranks(data_fails_on_rank_1, 2, timeout=80, check=True)
    assert failed.value["type"] == "DataFailed", failed.value
    assert failed.value["last_step"] == 1  # the step read before the failure still ran
    assert peer.value["type"] == "PeerFailed" and "disk gone on rank 1" in peer.value["message"], peer.value
