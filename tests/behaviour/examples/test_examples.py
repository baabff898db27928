"""The examples a user starts from must run as written (the notebook: test_notebook.py, in a real kernel)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import free_port
from tests.support.paths import ROOT


@pytest.mark.timeout(120)
def test_quick_start_script_trains() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    )
    epochs = [line for line in completed.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2
    first, last = (float(line.split("mean loss ")[1].split()[0]) for line in epochs)
    assert last < first


CUSTOM_LOOP = ROOT / "examples" / "custom_loop.py"
# Short enough for a test, long enough that validation loss falls between epochs; CPU only, as the suite.
SHORT = ["--epochs", "2", "--steps", "20", "--devices", "cpu:0", "cpu:1"]


def _epoch_losses(stdout: str) -> list[tuple[float, float]]:
    """(train loss, val loss) of each `epoch N: train loss X, val loss Y, lr Z` line."""
    losses = []
    for line in stdout.splitlines():
        if line.startswith("epoch "):
            train = float(line.split("train loss ")[1].split(",")[0])
            val = float(line.split("val loss ")[1].split(",")[0])
            losses.append((train, val))
    return losses


def _warnings(stderr: str) -> list[str]:
    # torch warns at import when numpy is absent, as in the pytest configuration.
    return [line for line in stderr.splitlines() if "Warning" in line and "Failed to initialize NumPy" not in line]


def _run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert completed.returncode == 0, f"exit status {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    assert _warnings(completed.stderr) == [], completed.stderr
    return completed


@pytest.mark.timeout(180)
def test_custom_loop_example_learns() -> None:
    completed = _run([sys.executable, str(CUSTOM_LOOP), *SHORT], timeout=170)
    losses = _epoch_losses(completed.stdout)
    assert len(losses) == 2, completed.stdout
    (_, first_val), (_, last_val) = losses
    assert last_val < first_val, completed.stdout
    samples = [line for line in completed.stdout.splitlines() if line.startswith("sample: def ")]
    assert len(samples) == 1, completed.stdout


@pytest.mark.timeout(120)
def test_custom_loop_example_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    """2 processes of 1 device train as 1 process of 2 devices: batches split rank-major, same global steps."""
    # One snapshot of the corpus for both runs, so an edit to the repository between them cannot tell them apart.
    corpus = tmp_path / "corpus.txt"
    sources = [ROOT / "README.md", *sorted((ROOT / "gsync").rglob("*.py"))]
    corpus.write_text("\n\n".join(path.read_text(encoding="utf-8") for path in sources), encoding="utf-8")
    short = ["--epochs", "1", "--steps", "10", "--text", str(corpus)]
    one_process = _run([sys.executable, str(CUSTOM_LOOP), *short, "--devices", "cpu:0", "cpu:1"], timeout=50)
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {name: value for name, value in os.environ.items() if name not in launcher}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    two_processes = _run([*torchrun, str(CUSTOM_LOOP), *short, "--devices", "cpu"], timeout=60, env=env)
    expected, got = _epoch_losses(one_process.stdout), _epoch_losses(two_processes.stdout)
    assert len(got) == len(expected) == 1, two_processes.stdout
    assert got[0] == pytest.approx(expected[0], abs=0.01), (one_process.stdout, two_processes.stdout)
    assert two_processes.stdout.count("training on ['cpu:0'] per process") == 1  # rank 0 only
    assert two_processes.stdout.count("sample: ") == 1


@pytest.mark.timeout(300)
def test_elastic_example_survives_a_kill_and_takes_the_rank_back() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic.py")], capture_output=True, text=True, timeout=280
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    checksums = re.findall(r"rank (\d): trained steps .*?parameter checksum ([-\d.]+)", completed.stdout)
    assert sorted(rank for rank, _ in checksums) == ["0", "1", "2"], completed.stdout
    assert len({value for _, value in checksums}) == 1, checksums  # every rank, the one started again too: one model
    assert "launcher: kill -9 rank 1" in completed.stdout
    assert completed.stdout.count("took in rank(s) 1") >= 2, completed.stdout
