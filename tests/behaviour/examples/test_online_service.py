"""examples/online_service.py as a user runs it: a service that trains while it answers HTTP, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.support.harness import free_port
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "online_service.py"
FEATURES, CLASSES = 32, 4  # the example's model: 32 inputs, 4 classes


class Running:
    """The example's process (torchrun's, or the script's own), its output read line by line in a thread."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started: dict[int, str] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def line_matching(self, pattern: str, deadline: float) -> re.Match[str]:
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in time; output so far:\n{self.output()}") from None
            if line is None:
                raise AssertionError(f"the process ended (status {self.proc.wait()}) before {pattern!r}:\n{self.output()}")
            self.lines.append(line)
            match = re.search(pattern, line)
            if match:
                return match

    def output(self) -> str:
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return "".join(self.lines)
            if line is not None:
                self.lines.append(line)

    def note_descendants(self) -> None:
        """Remember every process under ours (torchrun's ranks start sessions of their own, so not by group)."""
        self.started = {pid: start for pid, start in _descendants(self.proc.pid).items()}
        self.started[self.proc.pid] = _start_time(self.proc.pid) or ""

    def kill_all(self) -> None:
        for pid, start in self.started.items():
            if _start_time(pid) == start:  # the same process, not a reused pid
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        # Every writer of the pipe is gone now, so the reader is at its end.
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces: fields are counted after its closing parenthesis.
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a zombie (no longer running)."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in "ZX" else fields[19]


def _descendants(root: int) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if (start := _start_time(pid)) is not None:
            found[pid] = start
        todo += children.get(pid, [])
    return found


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _metrics_after(base: str, step: int, deadline: float) -> dict:
    """/metrics, polled until its step is past ``step``."""
    while True:
        metrics = _get(base + "/metrics")
        if metrics["step"] > step:
            return metrics
        assert time.monotonic() < deadline, f"the step stayed at {metrics['step']}"
        time.sleep(0.05)  # between polls, so the poll does not take the cores training needs


def _prometheus(url: str) -> dict[str, float]:
    """Rank 0's samples of a Prometheus scrape, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("rank") == "0" and "le" not in sample.labels
    }


def _serve_train_and_stop(command: list[str], tmp_path: Path, budget: float, env: dict[str, str] | None = None) -> Running:
    """Start the service, check both endpoints while it trains, SIGTERM the process that serves, and see it all end."""
    deadline = time.monotonic() + budget
    service = Running(command, cwd=tmp_path, env=env)
    try:
        serving = service.line_matching(r"serving on (http://127\.0\.0\.1:\d+) .*pid (\d+)", deadline)
        base, server_pid = serving.group(1), int(serving.group(2))
        service.note_descendants()
        first = _metrics_after(base, 0, deadline)
        second = _metrics_after(base, first["step"], deadline)
        assert second["loss"] is not None and second["samples_per_s"] > 0, second
        if "--prometheus-port" in command:
            scraped = service.line_matching(r"prometheus metrics on (http://127\.0\.0\.1:\d+/metrics), rank 0", deadline)
            samples = _prometheus(scraped.group(1))
            assert samples["gsync_steps_total"] >= second["step"], samples
            assert samples["gsync_world_size"] == 1 and "gsync_loss" in samples, samples

        rows = [[0.1 * i] * FEATURES for i in range(3)]
        prediction = _post(base + "/predict", {"inputs": rows})
        assert prediction["step"] >= second["step"]
        assert len(prediction["classes"]) == 3 and all(0 <= c < CLASSES for c in prediction["classes"])
        probabilities = torch.tensor(prediction["probabilities"])
        assert probabilities.shape == (3, CLASSES)
        assert torch.allclose(probabilities.sum(dim=1), torch.ones(3), atol=1e-5)

        os.kill(server_pid, signal.SIGTERM)
        stopped = service.line_matching(r"stopped after (\d+) steps", deadline)
        assert int(stopped.group(1)) >= second["step"]
        status = service.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        output = service.output()
        assert status == 0, output
        assert [line for line in output.splitlines() if "Warning" in line or "Traceback" in line] == [], output
        left = [pid for pid, start in service.started.items() if _start_time(pid) == start]
        assert left == [], f"still running after the service exited: {left}"
    finally:
        service.kill_all()

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (256, FEATURES) and state["4.weight"].shape == (CLASSES, 256)
    return service


@pytest.mark.timeout(90)
def test_service_trains_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    _serve_train_and_stop(
        [sys.executable, str(EXAMPLE), "--port", "0", "--save", "model.pt", "--prometheus-port", "0"], tmp_path, budget=80
    )


@pytest.mark.timeout(120)
def test_service_under_torchrun_stops_every_rank_when_rank_0_is_told(tmp_path: Path) -> None:
    """SIGTERM to rank 0 alone: the ranks agree to stop at the same step, so both exit 0, and torchrun with them."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {name: value for name, value in os.environ.items() if name not in launcher}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    service = _serve_train_and_stop([*torchrun, str(EXAMPLE), "--port", "0", "--save", "model.pt"], tmp_path, 110, env)
    assert len(service.started) >= 3  # torchrun and its two ranks (at least), all gone
    assert service.output().count("serving on") == 1  # rank 0 only
