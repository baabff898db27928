"""gsync._core.distributed across 2 real processes: join, topology, checks, state broadcast, failure board.

Each spawn runs a whole scenario in both ranks and returns what each rank saw;
the tests below assert on those observations. Spawns are few because process
start-up (importing torch) costs seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch import nn

import gsync
from gsync._core.transports.process_group import ProcessGroupCollective
from gsync._core.distributed import (
    FailureBoard,
    FailureReport,
    agree_on_order,
    broadcast_module_state,
    failure_report,
    gather_topology,
    join,
    peer_failed,
    should_use_distributed,
    verify_same_parameters,
    verify_same_start,
)
from gsync._core.topology import Topology

from tests.support.harness import run_ranks


class Net(nn.Module):
    """Parameters of two dtypes, a tied weight, and float, int and bool buffers."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(4, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.second = nn.Linear(hidden, hidden)
        self.tied = nn.Linear(hidden, hidden)
        self.tied.weight = self.second.weight
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))


def _named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _error_of(fn: Callable[[], object]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:
        return type(error).__qualname__, str(error)
    return None


def _failure(rank: int, step: int) -> FailureReport:
    return FailureReport(
        rank=rank, device="cpu:0", device_index=0, step=step, site="backward", error_type="RuntimeError", message="boom"
    )


def _gsync_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gsync") and t.is_alive()]


def scenario() -> dict[str, Any]:
    """Runs in each rank; returns what this rank observed."""
    seen: dict[str, Any] = {}
    session = join(None, "cpu", timeout_s=30)
    rank = session.rank
    seen["session"] = (session.created, session.rank, session.world_size, session.backend, session.run_id)

    # Uneven device counts: rank 0 has 1 device, rank 1 has 2.
    seen["topology"] = gather_topology(session, local_devices=rank + 1)

    # Same structure, different values: the check passes, then rank 0's state wins.
    torch.manual_seed(100 + rank)
    model = Net()
    with torch.no_grad():
        model.norm.running_mean.fill_(rank + 1.0)
        model.norm.num_batches_tracked.fill_(7 + rank)
        model.mask[rank] = True
    seen["state_before"] = {k: v.clone() for k, v in model.state_dict().items()}
    seen["same_ok"] = _error_of(lambda: verify_same_parameters(session, _named(model)))
    broadcast_module_state(session, model)
    seen["state_after"] = {k: v.clone() for k, v in model.state_dict().items()}
    seen["still_tied"] = model.tied.weight is model.second.weight

    # Mismatches, each on rank 1 only: every rank must raise the same ConfigError.
    wide = Net(hidden=7 if rank == 1 else 6)
    seen["shape_mismatch"] = _error_of(lambda: verify_same_parameters(session, _named(wide)))
    fewer = _named(Net())[: -1 if rank == 1 else None]
    seen["count_mismatch"] = _error_of(lambda: verify_same_parameters(session, fewer))
    halves = Net().to(torch.float16 if rank == 1 else torch.float32)
    seen["dtype_mismatch"] = _error_of(lambda: verify_same_parameters(session, _named(halves)))
    renamed = [(("other." if rank == 1 and i == 2 else "") + name, p) for i, (name, p) in enumerate(_named(Net()))]
    seen["name_mismatch"] = _error_of(lambda: verify_same_parameters(session, renamed))
    buffered = Net()
    if rank == 1:
        buffered.register_buffer("extra", torch.zeros(2))
    seen["buffer_mismatch"] = _error_of(lambda: broadcast_module_state(session, buffered))

    # Ranks that resumed from different checkpoints (or one from none) would drift apart: refused everywhere.
    seen["same_start_ok"] = _error_of(lambda: verify_same_start(session, 5))
    seen["start_mismatch"] = _error_of(lambda: verify_same_start(session, 3 if rank == 0 else 0))

    # The bucket order of rank 0 wins; orders of different lengths are an error everywhere.
    seen["agreed_order"] = agree_on_order(session, [3, 1, 2, 0] if rank == 0 else [0, 1, 2, 3])
    seen["order_mismatch"] = _error_of(lambda: agree_on_order(session, [0, 1] if rank == 1 else [0, 1, 2]))

    # Failure board: rank 1 reports, rank 0's watcher hears it; rank 1's own watcher does not.
    board = FailureBoard(session)
    heard: list[FailureReport] = []
    arrived = threading.Event()
    board.start_watching(lambda report: (heard.append(report), arrived.set()))
    if rank == 1:
        seen["published"] = board.report(_failure(1, step=3))
    else:
        seen["arrived"] = arrived.wait(10)
    dist.barrier(group=session.group)
    seen["heard"] = list(heard)
    seen["stopped"] = board.stop()

    # A second session on the same store (the group adopted, not created):
    # it must not see the first session's report.
    second = join(session.group, "cpu", timeout_s=30)
    seen["second"] = (second.created, second.run_id)
    board2 = FailureBoard(second)
    seen["second_sees_old"] = board2.peer_report(0.0)
    heard2: list[FailureReport] = []
    arrived2 = threading.Event()
    board2.start_watching(lambda report: (heard2.append(report), arrived2.set()))
    dist.barrier(group=session.group)
    if rank == 1:
        board2.report(_failure(1, step=9))
    else:
        seen["arrived2"] = arrived2.wait(10)
        seen["peer_report"] = board2.peer_report(0.0)
    dist.barrier(group=session.group)
    seen["heard2"] = list(heard2)
    seen["stopped2"] = board2.stop()
    # Stopped without waiting on the store (it looked unresponsive as the run closed): the watcher still ends as soon
    # as the store answers, not after its hour-long wait.
    # (A run of its own: a wake key another board of the run already set would end the wait at once.)
    quiet = join(session.group, "cpu", timeout_s=30)
    unwoken = FailureBoard(quiet)
    unwoken.start_watching(lambda report: None)
    unwoken.stop(wake=False)
    for thread in threading.enumerate():
        if thread.name.startswith("gsync-failure-watch"):
            thread.join(10)
    seen["watchers_left"] = [name for name in _gsync_threads() if name.startswith("gsync-failure-watch")]
    quiet.close()
    second.close()
    # Closing an adopted group leaves it up.
    ones = torch.ones(2)
    dist.all_reduce(ones, group=session.group)
    seen["adopted_group_alive"] = ones.tolist()

    session.close()
    session.close()
    seen["initialized_after_close"] = dist.is_initialized()

    # A fresh session in the same processes (the group initialised again).
    third = join(None, "cpu", timeout_s=30)
    board3 = FailureBoard(third)
    seen["third"] = (third.created, third.run_id, board3.peer_report(0.0))
    third.close()
    seen["threads_left"] = _gsync_threads()
    return seen


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return [result.unwrap() for result in run_ranks(scenario, 2, timeout=60, check=True)]


pytestmark = pytest.mark.timeout(90)


def test_join_creates_the_default_group_and_agrees_on_a_run_id(observed: list[dict[str, Any]]) -> None:
    created = [o["session"] for o in observed]
    assert [c[:4] for c in created] == [(True, 0, 2, "gloo"), (True, 1, 2, "gloo")]
    assert created[0][4] == created[1][4]
    assert [o["initialized_after_close"] for o in observed] == [False, False]


def test_gather_topology_with_uneven_device_counts(observed: list[dict[str, Any]]) -> None:
    assert observed[0]["topology"] == Topology(local_devices=1, rank=0, world_size=2, device_offset=0, world_devices=3)
    assert observed[1]["topology"] == Topology(local_devices=2, rank=1, world_size=2, device_offset=1, world_devices=3)


def test_broadcast_module_state_copies_rank_0(observed: list[dict[str, Any]]) -> None:
    source = observed[0]["state_before"]
    assert observed[0]["same_ok"] is None and observed[1]["same_ok"] is None
    # The ranks started different (different seeds and buffers) ...
    assert not torch.equal(observed[1]["state_before"]["first.weight"], source["first.weight"])
    assert not torch.equal(observed[1]["state_before"]["mask"], source["mask"])
    # ... and end with rank 0's state, bit for bit, in every dtype.
    for o in observed:
        assert o["still_tied"]
        assert o["state_after"].keys() == source.keys()
        for name, value in source.items():
            assert o["state_after"][name].dtype == value.dtype, name
            assert torch.equal(o["state_after"][name], value), name


@pytest.mark.parametrize(
    ("key", "needles"),
    [
        ("shape_mismatch", ["'first.weight'", "rank 1", "(7, 4)", "(6, 4)"]),
        ("count_mismatch", ["rank 1 has 7 parameters, rank 0 has 8", "'tied.bias'", "missing on rank 1"]),
        ("dtype_mismatch", ["'scale'", "dtype float16 on rank 1 but float32 on rank 0"]),
        ("name_mismatch", ["parameter 2 is 'other.first.bias' on rank 1 but 'first.bias' on rank 0"]),
        ("buffer_mismatch", ["parameter or buffer 9 is 'extra' on rank 1 but 'norm.running_mean' on rank 0"]),
        ("start_mismatch", ["do not resume from the same checkpoint", "rank 0 at step 3, rank 1 at step 0"]),
    ],
)
def test_mismatch_raises_config_error_on_every_rank(observed: list[dict[str, Any]], key: str, needles: list[str]) -> None:
    errors = [o[key] for o in observed]
    assert errors[0] == errors[1], "every rank must raise the same error"
    kind, message = errors[0]
    assert kind == "ConfigError"
    for needle in needles:
        assert needle in message


def test_a_board_stopped_without_waiting_on_its_store_still_ends_its_watcher(observed: list[dict[str, Any]]) -> None:
    assert [o["watchers_left"] for o in observed] == [[], []]


def test_ranks_that_start_at_the_same_step_pass_the_check(observed: list[dict[str, Any]]) -> None:
    assert [o["same_start_ok"] for o in observed] == [None, None]


def test_ranks_agree_on_rank_0s_bucket_order(observed: list[dict[str, Any]]) -> None:
    assert [o["agreed_order"] for o in observed] == [[3, 1, 2, 0], [3, 1, 2, 0]]
    errors = [o["order_mismatch"] for o in observed]
    assert errors[0] == errors[1]
    assert errors[0] is not None and errors[0][0] == "ConfigError" and "[3, 2]" in errors[0][1]


def test_failure_report_reaches_the_other_rank_only(observed: list[dict[str, Any]]) -> None:
    assert observed[1]["published"] is True
    assert observed[0]["arrived"] is True
    assert observed[0]["heard"] == [_failure(1, step=3)]
    assert observed[1]["heard"] == []  # its own report does not wake it
    assert [o["stopped"] for o in observed] == [True, True]


def test_a_second_session_does_not_see_the_first_sessions_report(observed: list[dict[str, Any]]) -> None:
    first_run = observed[0]["session"][4]
    for o in observed:
        created, run_id = o["second"]
        assert created is False
        assert run_id != first_run
        assert o["second_sees_old"] is None
    assert observed[0]["arrived2"] is True
    assert observed[0]["heard2"] == [_failure(1, step=9)]
    assert observed[0]["peer_report"] == _failure(1, step=9)
    assert observed[1]["heard2"] == []
    assert [o["adopted_group_alive"] for o in observed] == [[2.0, 2.0], [2.0, 2.0]]
    for o in observed:
        created, _, old = o["third"]
        assert created is True and old is None
        assert o["threads_left"] == []


def killed_peer_scenario(victim: int) -> dict[str, Any]:
    """Rank ``victim`` dies (SIGKILL) before a reduction; the survivor's reduction must fail, not hang.

    Rank 0 hosts the store, so killing it also takes the failure board's
    store away: the survivor's watcher must still stop promptly.
    """
    session = join(None, "cpu", timeout_s=20)
    topology = gather_topology(session, 1)
    collective = ProcessGroupCollective(session.group, topology)
    board = FailureBoard(session)
    board.start_watching(lambda report: None)
    collective.all_reduce([torch.ones(8)], [0.5])
    dist.barrier(group=session.group)
    if session.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    error = _error_of(lambda: collective.all_reduce([torch.ones(8)], [0.5]))
    failed_after = time.monotonic() - started
    started = time.monotonic()
    stopped = board.stop()
    stop_s = time.monotonic() - started
    started = time.monotonic()
    session.close()
    return {
        "error": error,
        "failed_after_s": failed_after,
        "stopped": stopped,
        "stop_s": stop_s,
        "close_s": time.monotonic() - started,
    }


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_peer_makes_the_reduction_fail_promptly(victim: int) -> None:
    results = run_ranks(killed_peer_scenario, 2, args=(victim,), timeout=40)
    assert results[victim].returncode == -signal.SIGKILL
    outcome = results[1 - victim].unwrap()
    assert outcome["error"] is not None, "the all-reduce with a dead peer returned normally"
    assert outcome["failed_after_s"] < 10, outcome
    assert outcome["stopped"] is True and outcome["stop_s"] < 3, outcome
    assert outcome["close_s"] < 3, outcome


# -- in-process: no group needed ------------------------------------------------


def test_peer_failed_names_the_rank_and_the_original_error() -> None:
    error = peer_failed(_failure(1, step=3))
    assert str(error) == "rank 1 failed: worker on device cpu:0 failed at step 3 during backward: RuntimeError: boom"
    assert isinstance(error, gsync.FitError)
    assert (error.rank, error.device, error.step, error.site, error.error_type, error.remote_message) == (
        1, "cpu:0", 3, "backward", "RuntimeError", "boom",
    )


def test_failure_report_of_a_worker_failure_carries_its_cause() -> None:
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError as cause:
            raise gsync.WorkerFailed("cpu:1", 1, 3, "backward") from cause
    except gsync.WorkerFailed as error:
        report = failure_report(0, error)
    assert report == FailureReport(0, "cpu:1", 1, 3, "backward", "RuntimeError", "boom")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=FailureReport)
    assert decoded == report
    nonfinite = failure_report(1, gsync.NonFiniteLoss("cpu:1", 1, 4, float("nan")))
    assert (nonfinite.device, nonfinite.device_index, nonfinite.step, nonfinite.site) == ("cpu:1", 1, 4, "loss check")
    assert str(peer_failed(nonfinite)).startswith(
        "rank 1 failed: worker on device cpu:1 failed at step 4 during loss check: NonFiniteLoss: loss on device cpu:1"
    )
    timeout = failure_report(1, gsync.SyncTimeout(5, 30.0, [("cpu:0", 2)]))
    assert (timeout.step, timeout.site, timeout.error_type) == (5, "gradient sync", "SyncTimeout")
    assert str(peer_failed(timeout)).startswith("rank 1 failed: gradient sync failed at step 5: SyncTimeout: ")
    # Errors of the session's calls between steps keep their own site: peers read where the rank really was.
    stalled = failure_report(1, gsync.SyncTimeout(5, 30.0, site="evaluate"))
    assert (stalled.site, stalled.step) == ("evaluate", 5)
    assert str(peer_failed(stalled)).startswith("rank 1 failed: evaluate after step 5 failed: SyncTimeout: ")
    try:
        try:
            raise OSError("val shard missing")
        except OSError as cause:
            raise gsync.DataFailed(2, site="evaluate") from cause
    except gsync.DataFailed as error:
        data = failure_report(0, error)
    assert (data.site, data.step, data.error_type, data.message) == ("evaluate", 2, "OSError", "val shard missing")
    reduced = gsync.SyncFailed(3, None, site="all_reduce")
    assert str(reduced) == "the collective of all_reduce after step 3 failed"
    assert failure_report(0, reduced).site == "all_reduce"
    assert failure_report(0, gsync.SyncFailed(3, None)).site == "buffer broadcast"
    assert failure_report(0, gsync.SyncFailed(3, 1)).site == "all-reduce of bucket 1"


def test_failure_reports_of_a_session_that_failed_to_start() -> None:
    # The user's own error while the session starts (its optimizer factory) has no site: the session gives it.
    started = failure_report(1, ValueError("no optimizer"), "session start")
    assert (started.site, started.step, started.error_type) == ("session start", -1, "ValueError")
    assert str(peer_failed(started)) == "rank 1 failed to start its session: ValueError: no optimizer"
    failed = gsync.SyncFailed(-1, None, site="session start")
    assert str(failed).startswith("the collectives that start the session (checking parameters")
    # A peer named lost while the session started: the rank that named it reports where it waited.
    lost = gsync.PeerLost([gsync.LostRank(2, -1, "starting the session", "", 3.5, 1.0)])
    lost.__cause__ = failed
    assert failure_report(0, lost).site == "session start"
    assert failure_report(0, ValueError("x")).site == "fit"


def test_should_use_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert should_use_distributed(None) is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert should_use_distributed(None) is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert should_use_distributed(None) is True
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(gsync.ConfigError, match="WORLD_SIZE='two'"):
        should_use_distributed(None)


def test_join_without_launcher_environment_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(gsync.ConfigError, match="MASTER_ADDR is not set: launch with torchrun"):
        join(None, "cpu", timeout_s=5)
    with pytest.raises(gsync.ConfigError, match="'tpu' has no multi-process backend"):
        join(None, "tpu", timeout_s=5)
    with pytest.raises(gsync.ConfigError, match="timeout_s"):
        join(None, "cpu", timeout_s=0)
    assert not dist.is_initialized()
