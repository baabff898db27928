"""The handover of state to a new membership: a checkpoint file's bytes, read as the file is, never code.

Real gloo groups over loopback, their members in threads of one process; the
training is left to the multi-process tests.
"""

from __future__ import annotations

import io
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gsync
from gsync._core.elastic import handover
from gsync._core.elastic.carry import OperationLog
from gsync._core.elastic.handover import agree_state, decode_state, encode_state
from gsync._core.state.held import HeldState
from gsync._core.state.rng import capture_rng

TIMEOUT = timedelta(seconds=20)


def trained_checkpoint(step: int) -> gsync.Checkpoint:
    """A checkpoint with every field a fit's has: momentum, a scheduler, a scaler, the generators, the data position."""
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    checkpoint = gsync.Checkpoint.capture(step, model, optimizer, scheduler=scheduler)
    random.seed(step)
    return gsync.Checkpoint(
        checkpoint.step,
        checkpoint.model_state,
        checkpoint.optimizer_state,
        checkpoint.scheduler_state,
        {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 7},
        capture_rng(),
        (1, 9),
    )


def assert_same(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Equal all the way down: tensors by value and dtype, containers by type and content."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    elif isinstance(expected, gsync.Checkpoint):
        assert isinstance(actual, gsync.Checkpoint), where
        for field in ("step", "model_state", "optimizer_state", "scheduler_state", "scaler_state", "rng_state", "data_position"):
            assert_same(getattr(actual, field), getattr(expected, field), f"{where}.{field}")
    else:
        assert actual == expected and type(actual) is type(expected), f"{where}: {actual!r} != {expected!r}"


def test_the_bytes_handed_over_are_a_checkpoint_file_both_ways(tmp_path: Path) -> None:
    checkpoint = trained_checkpoint(5)
    # What a member sends, written to a file, is a checkpoint file that Checkpoint.load reads...
    sent = tmp_path / "sent.pt"
    sent.write_bytes(encode_state(checkpoint))
    assert_same(gsync.Checkpoint.load(sent), checkpoint)
    # ...and a file Checkpoint.save wrote is what a member reads from the group.
    saved = checkpoint.save(tmp_path / "saved.pt")
    assert_same(decode_state(saved.read_bytes()), checkpoint)


def _ran(marker: str) -> None:
    Path(marker).write_text("code from the network ran")


class Exploit:
    """Unpickled by a loader that runs code, it calls ``_ran(marker)``: what a hostile peer would send."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ran, (self.marker,))


def hostile_state(marker: Path) -> bytes:
    """A checkpoint payload in every other way, with the object that runs code where the model's state goes."""
    payload = {"format": "gsync-checkpoint", "version": 2, "step": 9, "model_state": Exploit(marker), "optimizer_state": {}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def test_a_state_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(gsync.CheckpointError, match="refused: it is not a gsync checkpoint that loads without running code"):
        decode_state(hostile_state(marker), "the state sent")
    assert not marker.exists()
    # The bytes are live: the loader the handover used before would have run them.
    torch.load(io.BytesIO(hostile_state(marker)), weights_only=False)
    assert marker.read_text() == "code from the network ran"


@pytest.mark.parametrize(
    ("payload", "refusal"),
    [
        ({"model_state": {}}, "no gsync format marker"),
        ({"format": "gsync-checkpoint", "version": 99, "step": 1}, "format version 99"),
        ({"format": "gsync-checkpoint", "version": 2, "step": 1}, "damaged gsync checkpoint"),
    ],
)
def test_bytes_that_are_not_a_checkpoint_this_gsync_reads_are_refused(payload: dict[str, Any], refusal: str) -> None:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with pytest.raises(gsync.CheckpointError, match=refusal):
        decode_state(buffer.getvalue())
    with pytest.raises(gsync.CheckpointError, match="refused"):
        decode_state(b"not a pickle at all")


def gloo_groups(size: int) -> tuple[dist.TCPStore, list[dist.ProcessGroup]]:
    """A store server (keep it referenced) and the members of a gloo group formed on it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

    def group(rank: int) -> dist.ProcessGroup:
        store = dist.PrefixStore("handover", dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT))
        return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)  # type: ignore[return-value]

    with ThreadPoolExecutor(size) as pool:
        return server, list(pool.map(group, range(size)))


@pytest.mark.timeout(60)
def test_a_member_behind_and_a_joiner_are_sent_every_field_of_the_most_advanced_state() -> None:
    _server, groups = gloo_groups(3)
    ahead, behind = trained_checkpoint(5), trained_checkpoint(4)
    held = [HeldState.of(behind), HeldState.of(ahead), None]
    abort = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        agreed = list(pool.map(lambda args: agree_state(args[0], args[1], abort, OperationLog()), zip(groups, held)))
    assert agreed[1] is held[1]
    for state in (agreed[0], agreed[2]):
        assert state is not None and not state.has_replicas
        assert_same(state.checkpoint(), ahead)


@pytest.mark.timeout(60)
def test_members_that_hold_the_same_step_go_on_with_their_own_state_and_nothing_is_copied() -> None:
    _server, groups = gloo_groups(2)
    captures: list[int] = []

    def held(rank: int) -> HeldState:
        def capture() -> gsync.Checkpoint:
            captures.append(rank)
            return trained_checkpoint(6)

        return HeldState(6, capture)

    mine = [held(0), held(1)]
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        agreed = list(pool.map(lambda args: agree_state(args[0], args[1], abort, OperationLog()), zip(groups, mine)))
    assert agreed[0] is mine[0] and agreed[1] is mine[1]
    assert captures == []  # no checkpoint was taken: each member's replicas go on as they are


@pytest.mark.timeout(60)
def test_a_member_sent_state_that_would_run_code_refuses_it_with_a_checkpoint_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _server, groups = gloo_groups(2)
    marker = tmp_path / "ran"
    # The member ahead is hostile (it knocked and claimed a later step): it sends code instead of its state.
    monkeypatch.setattr(handover, "encode_state", lambda checkpoint: hostile_state(marker))
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(agree_state, groups[0], HeldState.of(trained_checkpoint(7)), abort, OperationLog())
        receiver = pool.submit(agree_state, groups[1], HeldState.of(trained_checkpoint(4)), abort, OperationLog())
        sender.result(timeout=30)
        with pytest.raises(gsync.CheckpointError, match="the state sent by the new membership's rank 0 was refused"):
            receiver.result(timeout=30)
    assert not marker.exists()


def test_a_refused_state_ends_the_change_with_this_ranks_own_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from gsync._core.elastic import membership

    def refused(group: object, mine: object, abort: object, operations: object) -> None:
        raise gsync.CheckpointError("the state sent by the new membership's rank 0 was refused: ...")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(membership, "agree_state", refused)
    mine = trained_checkpoint(4)
    elastic = membership.ElasticMembership(gsync.Elastic(), None, 20.0)
    # Not a membership that failed to form (which the change retries): this rank cannot start from what it was sent.
    with pytest.raises(gsync.CheckpointError) as raised:
        elastic._agree_state(SimpleNamespace(host=None), HeldState.of(mine))  # type: ignore[arg-type]  # only its host group is read
    assert raised.value.checkpoint is mine and raised.value.last_step == 4


def log_after(step: int, results: list[tuple[str, Any]]) -> OperationLog:
    """A member's log: ``results``' operations completed, in order, after step ``step``."""
    log = OperationLog()
    for kind, result in results:
        log.completed(step, kind, result)
    return log


@pytest.mark.timeout(60)
def test_a_member_whose_last_operation_was_interrupted_is_handed_the_result_the_member_that_completed_it_holds() -> None:
    _server, groups = gloo_groups(4)
    # After step 5 member 0 completed two evaluations and member 1 one (its second was interrupted by the change).
    # Member 2 completed none after step 5 (no member can really be two behind: it is given nothing to run past
    # the others with), and member 3 is a joiner: neither is handed the result, and member 3 is sent the state.
    # What an evaluation's run returns on every rank: the metrics' names, and their sums with the rows last.
    names, totals = ["accuracy", "loss"], torch.tensor([7.5, 2.5, 10.0], dtype=torch.float64)
    logs = [
        log_after(5, [("evaluate()", {"loss": 0.5}), ("evaluate()", (names, totals))]),
        log_after(5, [("evaluate()", {"loss": 0.5})]),
        log_after(4, [("all_reduce(op='sum')", 3.0)]),
        OperationLog(),
    ]
    state = trained_checkpoint(5)
    held = [HeldState.of(state), HeldState.of(state), HeldState.of(state), None]
    abort = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        agreed = list(pool.map(lambda args: agree_state(args[0], args[1], abort, args[2]), zip(groups, held, logs)))
    assert agreed[:3] == held[:3]  # as advanced as the sender: each goes on with its own
    assert agreed[3] is not None and agreed[3].step == 5
    # Member 1's redo of its second evaluation after step 5 returns member 0's metrics, and runs nothing.
    handed, result = logs[1].take(5, "evaluate()")
    assert handed and result[0] == names and torch.equal(result[1], totals) and result[1].dtype == torch.float64
    for log in (logs[0], logs[2], logs[3]):
        assert log.take(5, "evaluate()") == (False, None)
        log.completed(5, "evaluate()", {"loss": 0.5})
        assert log.take(5, "evaluate()") == (False, None)


@pytest.mark.timeout(60)
def test_a_result_handed_in_an_agreement_that_did_not_complete_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _server, groups = gloo_groups(2)
    logs = [log_after(2, [("all_reduce(op='sum')", 4.0)]), OperationLog()]
    held = [HeldState.of(trained_checkpoint(2)), HeldState.of(trained_checkpoint(1))]

    def lost_again(*args: object) -> HeldState:
        raise RuntimeError("Connection closed by peer")  # a member lost while the state was sent

    monkeypatch.setattr(handover, "_send_state", lost_again)
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        attempts = [pool.submit(agree_state, group, mine, abort, log) for group, mine, log in zip(groups, held, logs)]
        for attempt in attempts:
            with pytest.raises(RuntimeError, match="Connection closed"):
                attempt.result(timeout=30)
    # The next agreement compares afresh: nothing from this one is taken in its place.
    assert logs[1].take(2, "all_reduce(op='sum')") == (False, None)


@pytest.mark.timeout(60)
def test_members_whose_loops_are_at_the_same_operation_exchange_nothing_but_their_positions() -> None:
    _server, groups = gloo_groups(2)
    logs = [log_after(6, [("all_reduce(op='sum')", 1.0)]), log_after(6, [("all_reduce(op='sum')", 1.0)])]
    held = [HeldState.of(trained_checkpoint(6)), HeldState.of(trained_checkpoint(6))]
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        agreed = list(pool.map(lambda args: agree_state(args[0], args[1], abort, args[2]), zip(groups, held, logs)))
    assert agreed == held
    assert [log.take(6, "all_reduce(op='sum')") for log in logs] == [(False, None), (False, None)]


@pytest.mark.timeout(60)
def test_a_result_handed_over_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    _server, groups = gloo_groups(2)
    marker = tmp_path / "ran"
    logs = [log_after(3, [("all_reduce(op='sum')", Exploit(marker))]), OperationLog()]
    held = [HeldState.of(trained_checkpoint(3)), HeldState.of(trained_checkpoint(3))]
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(agree_state, groups[0], held[0], abort, logs[0])
        receiver = pool.submit(agree_state, groups[1], held[1], abort, logs[1])
        assert sender.result(timeout=30) is held[0]
        with pytest.raises(gsync.CheckpointError, match="the result of an operation sent by the new membership's rank 0 was refused"):
            receiver.result(timeout=30)
    assert not marker.exists()
