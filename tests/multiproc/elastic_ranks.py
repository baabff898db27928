"""Real processes of an elastic run, with the store hosted by the test process (as torchrun's agent hosts it).

:class:`ElasticRanks` starts ``elastic_job.py`` once per rank, can start a
rank again with the same environment (as a scheduler restarting it would),
signal one, and collect what each process saved. Every process it started
is killed and reaped when the block ends, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.support.paths import ROOT

__all__ = ("ElasticRanks",)

_JOB = Path(__file__).with_name("elastic_job.py")


class ElasticRanks:
    def __init__(self, world_size: int, config: dict[str, Any]) -> None:
        self.world_size = world_size
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="gsync-elastic-")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, Path] = {}

    def __enter__(self) -> ElasticRanks:
        for rank in range(self.world_size):
            self.start(rank)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()
        self._tmp.cleanup()

    def env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.store.port),
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        )
        return env

    def start(self, rank: int, config: dict[str, Any] | None = None) -> str:
        """Start (or start again) ``rank``; returns the name its result is kept under (``"1"``, then ``"1b"``...)."""
        name = str(rank)
        while name in self._processes:
            name += "b"
        log = Path(self._tmp.name) / f"{name}.log"
        self._logs[name] = log
        with open(log, "wb") as output:
            self._processes[name] = subprocess.Popen(
                [sys.executable, str(_JOB), json.dumps(config or self.config), str(Path(self._tmp.name) / f"{name}.pt")],
                env=self.env(rank),
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        return name

    def signal(self, name: str, signum: int) -> None:
        self._processes[name].send_signal(signum)

    def wait(self, name: str, timeout: float) -> int:
        return self._processes[name].wait(timeout)

    def wait_stopped(self, name: str) -> None:
        """Until the process has stopped itself (SIGSTOP): the kernel says so, no polling."""
        os.waitid(os.P_PID, self._processes[name].pid, os.WSTOPPED | os.WNOWAIT)

    def results(self, timeout: float, only: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Every process's (or ``only`` those named) saved outcome once they have ended (those killed have none)."""
        outcomes: dict[str, dict[str, Any]] = {}
        for name, process in self._processes.items():
            if only is not None and name not in only:
                continue
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                for other in self._processes.values():
                    if other.poll() is None:
                        other.send_signal(signal.SIGCONT)
                        other.kill()
                raise AssertionError(f"rank {name} did not finish in {timeout} s:\n{self.log(name)}") from None
            path = Path(self._tmp.name) / f"{name}.pt"
            if path.exists():
                outcomes[name] = torch.load(path, weights_only=False)
        return outcomes

    def log(self, name: str) -> str:
        return self._logs[name].read_text(errors="replace")[-6000:]

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)}" for name in self._logs)
