"""Nothing is lost when a process dies: SIGKILL mid-run, start the same command again, end where an uninterrupted run ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.harness import free_port

SCRIPT = Path(__file__).with_name("crash_and_resume.py")


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    child_env.pop("WORLD_SIZE", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=child_env)


def _final(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    saved = torch.load(path, weights_only=True)
    return saved["state"], saved["first_step"]


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.timeout(180)
def test_a_sigkilled_process_started_again_ends_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    common = [sys.executable, str(SCRIPT), "--devices", "cpu:0", "cpu:1"]
    straight = _run([*common, "--dir", str(tmp_path / "straight"), "--out", str(tmp_path / "straight.pt")])
    assert straight.returncode == 0, straight.stderr
    crashing = [*common, "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"),
                "--kill-at", "6", "--marker", str(tmp_path / "killed")]
    first = _run(crashing)
    assert first.returncode == -9, first.stderr  # SIGKILL: no cleanup ran
    assert not (tmp_path / "final.pt").exists()
    second = _run(crashing)  # the same command line
    assert second.returncode == 0, second.stderr
    state, first_step = _final(tmp_path / "final.pt")
    expected, _ = _final(tmp_path / "straight.pt")
    _assert_equal(state, expected)
    # Resumed after step 5 (saved every 2 steps), or after step 3 if the kill
    # came while step 5's file was still being written (it is then never half there).
    assert first_step in (4, 6)


@pytest.mark.timeout(240)
def test_torchrun_restarts_both_ranks_after_one_is_killed_and_they_resume_exactly(tmp_path: Path) -> None:
    straight = _run([sys.executable, str(SCRIPT), "--devices", "cpu:0", "cpu:1",
                     "--dir", str(tmp_path / "straight"), "--out", str(tmp_path / "straight.pt")])
    assert straight.returncode == 0, straight.stderr
    port = free_port()
    launched = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT), "--devices", "cpu",
         "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"),
         "--kill-at", "7", "--kill-rank", "1", "--marker", str(tmp_path / "killed")],
        timeout=200,
    )
    assert launched.returncode == 0, launched.stderr[-6000:]
    assert (tmp_path / "killed").exists()  # the first attempt really died
    state, first_step = _final(tmp_path / "final.pt")
    expected, _ = _final(tmp_path / "straight.pt")
    # Two processes of one device split every batch exactly as one process of two devices.
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], atol=2e-6, rtol=0, msg=name)
    # Step 7's file is written unless torchrun stopped rank 0 first; then step 5's.
    assert first_step in (6, 8)
