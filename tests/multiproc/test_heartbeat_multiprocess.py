"""A rank that dies, hangs or gets stuck is named by the survivors, with its step and phase (2 real processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.harness import run_ranks

from gsync._core.distributed.heartbeat import LOST_AFTER_S

STEPS = 6


def _outcome(error: BaseException, started: float) -> dict[str, Any]:
    import gsync

    lost = getattr(error, "lost", ())
    return {
        "type": type(error).__name__,
        "message": str(error),
        "elapsed": time.monotonic() - started,
        "is_peer_failed": isinstance(error, gsync.PeerFailed),
        "rank": getattr(error, "rank", None),
        "step": getattr(error, "step", None),
        "site": getattr(error, "site", None),
        "silent": [rank.silent_for for rank in lost],
        "last_step": error.last_step if isinstance(error, gsync.GsyncError) else None,
        "error_type": getattr(error, "error_type", None),
    }


def _end_peer(pid_file: Path) -> None:
    """The peer is stopped or stuck on purpose: the last survivor to have named it ends it."""
    survivors = int(os.environ["WORLD_SIZE"]) - 1
    with open(pid_file.with_suffix(".named"), "a") as named:
        named.write(os.environ["RANK"] + "\n")
    if len(pid_file.with_suffix(".named").read_text().split()) == survivors:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _fit_with(loss_fn: Any, data: Any, sync_timeout: float, pid_file: Path, culprit: int = 1) -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])
    if rank == culprit:
        pid_file.with_suffix(".named").unlink(missing_ok=True)  # a run before this one's (the stress script reuses the file)
        pid_file.write_text(str(os.getpid()))
    # Every scenario's peer stops after step 0 (before step 1, or at step 2): the bounds on `elapsed` are about how
    # soon a stopped peer is named, so it is timed from the end of step 0, not from before the process group formed
    # (slow under load).
    step_0_ended = [time.monotonic()]

    class TimesStep0:
        def on_step_end(self, session: Any, result: Any) -> None:
            if result.step == 0:
                step_0_ended[0] = time.monotonic()

    engine = gsync.Engine(["cpu"], sync_timeout=sync_timeout)
    try:
        asyncio.run(engine.fit(TiedNet(), data, optimizer=sgd, loss_fn=loss_fn, callbacks=[TimesStep0()]))
    except gsync.GsyncError as error:
        outcome = _outcome(error, step_0_ended[0])
        if rank != culprit:
            _end_peer(pid_file)
        return outcome
    return {"type": None}


def stopped_at_step_2(pid_file: Path) -> dict[str, Any]:
    """Rank 1 freezes (SIGSTOP) in backward at step 2; the sync timeout is far away."""
    rank = int(os.environ["RANK"])
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = classification_loss(model, batch)
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGSTOP)
        return loss

    return _fit_with(loss_fn, make_batches(STEPS, 8), 120.0, pid_file)


@pytest.mark.timeout(90)
def test_a_frozen_rank_is_named_long_before_the_sync_timeout(tmp_path: Path) -> None:
    survivor, _ = run_ranks(stopped_at_step_2, 2, args=(tmp_path / "pid",), timeout=80, failure_grace=20)
    assert survivor.ok, survivor.describe()
    outcome = survivor.value
    assert outcome["type"] == "PeerLost", outcome
    assert outcome["rank"] == 1 and outcome["step"] == 2, outcome
    assert "rank 1 stopped responding at step 2" in outcome["message"], outcome
    assert "it was killed, crashed or is hung" in outcome["message"], outcome
    assert outcome["silent"][0] >= LOST_AFTER_S
    # Named by its silence, not by the 120 s sync timeout.
    assert outcome["elapsed"] < LOST_AFTER_S + 10, outcome
    assert outcome["last_step"] == 1


def _data_stuck_on(stuck: int, rows: int) -> Iterator[Any]:
    """The run's batches; on rank ``stuck`` the read before step 2 never returns (reading data is not timed)."""
    rank = int(os.environ["RANK"])
    never = threading.Event()
    for step, batch in enumerate(make_batches(STEPS, rows)):
        if rank == stuck and step == 2:
            never.wait()
        yield batch


def data_stuck_on_rank_1(pid_file: Path) -> dict[str, Any]:
    """Rank 1's data loader blocks before step 2, so rank 1 itself never times out."""
    return _fit_with(classification_loss, _data_stuck_on(1, 8), 3.0, pid_file)


@pytest.mark.timeout(90)
def test_a_rank_stuck_in_its_data_is_named_alive_and_where(tmp_path: Path) -> None:
    survivor, _ = run_ranks(data_stuck_on_rank_1, 2, args=(tmp_path / "pid",), timeout=80, failure_grace=20)
    assert survivor.ok, survivor.describe()
    outcome = survivor.value
    assert outcome["type"] == "PeerLost", outcome
    assert outcome["rank"] == 1 and outcome["site"] == "outside gsync", outcome
    assert outcome["silent"] == [None], outcome  # it still beats: alive, stuck
    # fit reads one batch ahead, so the read stuck before step 2 stops rank 1 before step 1.
    assert "rank 1 is alive but stuck at its own code after step 0 (the training loop or its data)" in outcome["message"]
    assert outcome["elapsed"] < 3.0 + 10, outcome


def data_stuck_on_rank_2_of_3(pid_file: Path) -> dict[str, Any]:
    """Three ranks; rank 2's data loader blocks. Ranks 0 and 1 time out within moments of each other."""
    return _fit_with(classification_loss, _data_stuck_on(2, 9), 3.0, pid_file, culprit=2)


@pytest.mark.timeout(120)
def test_with_three_ranks_the_survivors_name_the_stuck_one_not_each_other(tmp_path: Path) -> None:
    results = run_ranks(data_stuck_on_rank_2_of_3, 3, args=(tmp_path / "pid",), timeout=100, failure_grace=30)
    for survivor in results[:2]:
        assert survivor.ok, survivor.describe()
        outcome = survivor.value
        # Named by its own heartbeat view (PeerLost), or through the other survivor's verdict (PeerFailed of
        # type PeerLost): either way rank 2, and only rank 2, is the one stuck.
        assert outcome["type"] in ("PeerLost", "PeerFailed"), outcome
        if outcome["type"] == "PeerLost":
            assert outcome["rank"] == 2, outcome
        else:
            assert outcome["error_type"] == "PeerLost", outcome
        assert "rank 2 is alive but stuck at its own code" in outcome["message"], outcome
        assert "rank 0 is alive" not in outcome["message"] and "rank 1 is alive" not in outcome["message"], outcome


def loss_stuck_on_rank_1(pid_file: Path) -> dict[str, Any]:
    """Rank 1's loss function never returns at step 2."""
    rank = int(os.environ["RANK"])
    calls = [0]
    never = threading.Event()

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            never.wait()
        return classification_loss(model, batch)

    return _fit_with(loss_fn, make_batches(STEPS, 8), 3.0, pid_file)


@pytest.mark.timeout(90)
def test_a_rank_stuck_in_its_loss_function_is_named_with_step_and_phase(tmp_path: Path) -> None:
    survivor, _ = run_ranks(loss_stuck_on_rank_1, 2, args=(tmp_path / "pid",), timeout=80, failure_grace=20)
    assert survivor.ok, survivor.describe()
    outcome = survivor.value
    # Rank 1's own sync timeout may report first (PeerFailed carrying its SyncTimeout), or rank 0 names it from
    # its heartbeat (PeerLost): either way the stuck rank, its step and its phase are named.
    assert outcome["is_peer_failed"], outcome
    assert outcome["rank"] == 1 and outcome["step"] == 2, outcome
    assert "forward" in outcome["message"], outcome
    assert outcome["elapsed"] < 3.0 + 10, outcome


def store_host_killed_at_step_2() -> dict[str, Any]:
    """Rank 0, whose process hosts the store, is SIGKILLed in forward at step 2."""
    rank = int(os.environ["RANK"])
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == 0 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return classification_loss(model, batch)

    return _fit_with(loss_fn, make_batches(STEPS, 8), 5.0, Path(os.devnull))


@pytest.mark.timeout(90)
def test_a_killed_store_host_is_named_by_the_others(tmp_path: Path) -> None:
    killed, survivor = run_ranks(store_host_killed_at_step_2, 2, timeout=80, failure_grace=20)
    assert killed.returncode == -signal.SIGKILL
    assert survivor.ok, survivor.describe()
    outcome = survivor.value
    assert outcome["type"] == "PeerLost", outcome
    assert outcome["rank"] == 0 and outcome["step"] == 2, outcome
    assert outcome["elapsed"] < 5.0 + 10, outcome
