"""Elastic gsync under real ``torchrun`` agents: the recipe docs/elastic.md gives ("Under torchrun"), run on this machine.

Three agents on localhost, one worker each (``--nnodes 1:3 --nproc-per-node 1
--rdzv-backend c10d --max-restarts 0``), with the store hosted outside every
agent and rank: here by the test process, which is both torchrun's c10d
rendezvous endpoint (``--rdzv-conf is_host=false``: no agent hosts it) and the
store gsync's run lives on (``Engine(store=TCPStore(..., is_master=False))``).
The workers run ``torchrun_elastic_job.py``, which holds every worker after
step 4 until the test says go (store keys, no sleeping), so the loss falls at
a known step.

``--max-restarts 0`` is what lets gsync's survivors go on: torchrun never
restarts a worker, so no agent re-rendezvouses and none tears its survivors
down. A lost rank comes back as a plain process with the lost one's
``RANK``/``WORLD_SIZE`` and the store's address, not as a new torchrun agent
(which would find the rendezvous closed, or restart every worker).

Every run is compared with one plain PyTorch loop over the same global batches.
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

import pytest
import torch
import torch.distributed as dist

from tests.multiproc.elastic_job import assert_equal_to, uninterrupted
from tests.support.paths import ROOT

_JOB = Path(__file__).with_name("torchrun_elastic_job.py")
HOLD = 4  # every worker waits after this step until the test has done what it came to do

# Started by the test (a plain process, as a scheduler would start one): dies with the test process if that is killed.
_BOOT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class TorchrunJob:
    """``agents`` torchrun agents on one store the test hosts; every process it started is killed when the block ends."""

    def __init__(self, agents: int, config: dict[str, Any]) -> None:
        self.agents_wanted = agents
        self._tmp = tempfile.TemporaryDirectory(prefix="gsync-torchrun-")
        self.out = Path(self._tmp.name)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        address = f"127.0.0.1:{self.store.port}"
        self.config = {**config, "store": address, "coord": address, "hold": [HOLD], "die_with_parent": True, "dump_after": 50}
        self.agents: list[subprocess.Popen[bytes]] = []
        self.plain: list[subprocess.Popen[bytes]] = []
        self.env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        self.env.pop("TORCHELASTIC_RESTART_COUNT", None)
        self.env.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    def __enter__(self) -> TorchrunJob:
        for _ in range(self.agents_wanted):
            self.start_agent()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for agent in self.agents:
                _kill_group(agent.pid)  # the agent (its own session)
            for pid in self.worker_pids():
                # Each torchrun worker is a session of its own (killing its agent leaves it running): killed by its
                # pid if that is still this job's worker (its command line names this job's folder).
                if str(self.out) in _cmdline(pid):
                    _kill_group(pid)
            for process in self.agents + self.plain:
                if process.poll() is None:
                    process.kill()
                process.wait(30)
        finally:
            self._tmp.cleanup()

    def _spawn(self, args: list[str], log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.out / log, "wb") as output:
            return subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(os.getpid()), *args], env=env, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_agent(self) -> subprocess.Popen[bytes]:
        args = [
            "-m", "torch.distributed.run", "--nnodes", f"1:{self.agents_wanted}", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.store.port}", "--rdzv-id", "gsync-test",
            "--rdzv-conf", "is_host=false", "--max-restarts", "0", "--monitor-interval", "0.1",
            str(_JOB), json.dumps(self.config), str(self.out),
        ]  # fmt: skip
        agent = self._spawn(args, f"agent{len(self.agents)}.log", self.env)
        self.agents.append(agent)
        return agent

    def start_plain(self, env: dict[str, str | None], config: dict[str, Any]) -> subprocess.Popen[bytes]:
        """The lost rank started again as a plain process with its torchrun environment (as a scheduler would)."""
        plain_env = {**self.env, **{name: value for name, value in env.items() if value is not None}}
        process = self._spawn([str(_JOB), json.dumps({**self.config, **config}), str(self.out)], f"plain{len(self.plain)}.log", plain_env)
        self.plain.append(process)
        return process

    def held(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """Once every rank in ``ranks`` waits after step HOLD: each one's pid, its agent's pid and its torchrun env."""
        keys = [f"ready/{HOLD}/{rank}" for rank in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=60))
        except Exception:
            raise AssertionError(f"the workers did not all reach step {HOLD}:\n{self.logs()}") from None
        return {rank: json.loads(self.store.get(f"ready/{HOLD}/{rank}")) for rank in ranks}

    def go(self) -> None:
        self.store.set(f"go/{HOLD}", "1")

    def results(self, pids: list[int], timeout: float = 60) -> dict[int, dict[str, Any]]:
        """What each worker in ``pids`` saved, once each has said it is done (its last act)."""
        try:
            self.store.wait([f"done/{pid}" for pid in pids], timedelta(seconds=timeout))
        except Exception:
            raise AssertionError(f"workers {pids} did not all finish in {timeout} s:\n{self.logs()}") from None
        return {pid: torch.load(self.out / f"result-{pid}.pt", weights_only=False) for pid in pids}

    def worker_pids(self) -> list[int]:
        pids = []
        for start in self.out.glob("start-*.json"):
            try:
                pids.append(json.loads(start.read_text())["pid"])
            except (OSError, ValueError):
                continue
        return pids

    def logs(self) -> str:
        """Each agent's and plain process's output (its workers' included), and the error each failed worker saved."""
        parts = [f"--- {log.name} ---\n{log.read_text(errors='replace')[-8000:]}" for log in sorted(self.out.glob("*.log"))]
        parts.append("store: " + ", ".join(f"{key}={self.store.get(key).decode()!r}" for key in _RUN_KEYS if self.store.check([key])))
        parts.append("agents: " + ", ".join(f"{agent.pid}: {agent.poll()}" for agent in self.agents))
        parts.append("plain: " + ", ".join(f"{process.pid}: {process.poll()}" for process in self.plain))
        parts.append("workers: " + ", ".join(f"{pid}: {_state(pid)}" for pid in self.worker_pids()))
        for result in sorted(self.out.glob("result-*.pt")):
            outcome = torch.load(result, weights_only=False)
            name = f"--- {result.name} (rank {outcome['env']['RANK']}) ---"
            if not outcome["ok"]:
                parts.append(f"{name}\n{outcome['traceback']}")
            else:
                parts.append(f"{name} ok: membership {outcome['membership']}, world sizes {outcome['world_sizes']}")
        return "\n".join(parts)


# The elastic run's keys (gsync/_core/elastic/quorum.py) that say how far its membership got, for a failure's report.
# Under torchrun the run lives under its run id (--rdzv-id), which every agent's workers share.
_SCOPE = "gsync/elastic/gsync-test"
_RUN = f"{_SCOPE}/run0"
_RUN_KEYS = (
    f"{_SCOPE}/active", f"{_RUN}/current", f"{_RUN}/knocks", f"{_RUN}/knock1", f"{_RUN}/knock2",
    *(f"{_RUN}/g{g}/{what}" for g in range(4) for what in ("decided", "next", "reform")),
)


def _state(pid: int) -> str:
    """A process's state as the kernel reports it (running, sleeping, zombie...), or "gone"."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.mark.timeout(90)
def test_a_killed_worker_is_not_restarted_and_the_others_end_exact() -> None:
    steps = 10
    with TorchrunJob(3, {"steps": steps}) as job:
        workers = job.held([0, 1, 2])
        for rank, worker in workers.items():
            # torchrun's environment for elastic gsync: its agent store, and no restart so far.
            assert worker["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True", worker
            assert worker["env"]["TORCHELASTIC_RESTART_COUNT"] == "0", worker
            assert worker["env"]["RANK"] == str(rank)
        victim = workers[1]
        os.kill(victim["pid"], signal.SIGKILL)
        job.go()
        (victim_agent,) = [agent for agent in job.agents if agent.pid == victim["agent"]]
        # --max-restarts 0: the agent does not start the worker again; it fails (and closes the rendezvous).
        assert victim_agent.wait(60) == 1, job.logs()
        outcomes = job.results([workers[0]["pid"], workers[2]["pid"]])
        assert set(job.worker_pids()) == {worker["pid"] for worker in workers.values()}, "torchrun started a worker again"
    expected = uninterrupted(steps)
    for outcome in outcomes.values():
        assert_equal_to(expected, outcome)
        (change,) = outcome["membership"]
        step, lost, joined, world_size, seconds, reason = change
        assert (lost, joined, world_size, reason) == ((1,), (), 2, "lost"), change
        assert step in (HOLD + 1, HOLD + 2), change
        assert 0 < seconds < 30, change
        assert outcome["world_sizes"][:HOLD] == [3] * HOLD and outcome["world_sizes"][-1] == 2


@pytest.mark.timeout(120)
def test_a_lost_node_is_replaced_by_a_plain_process_and_all_end_exact() -> None:
    # Rank 0's node: the agent that hosts torchrun's own worker store (MASTER_PORT) goes with it; gsync's does not.
    # The survivors wait after step 7 until the process has knocked; it wakes their watchers a few store round trips
    # after that, so they get 12 more steps to take it in before the run ends.
    steps = 20
    with TorchrunJob(3, {"steps": steps, "wait_for_join": HOLD + 3}) as job:
        workers = job.held([0, 1, 2])
        victim = workers[0]
        os.killpg(victim["agent"], signal.SIGKILL)
        os.killpg(victim["pid"], signal.SIGKILL)
        job.go()
        again = job.start_plain(victim["env"], {"hold": []})
        survivors = [workers[1]["pid"], workers[2]["pid"]]
        outcomes = job.results([*survivors, again.pid])
        assert again.wait(60) == 0, job.logs()
        # No agent re-rendezvoused: the survivors are the workers torchrun started, and no other was started.
        assert set(job.worker_pids()) == {*(worker["pid"] for worker in workers.values()), again.pid}
    expected = uninterrupted(steps)
    for outcome in outcomes.values():
        assert_equal_to(expected, outcome)
    for pid in survivors:
        changes = outcomes[pid]["membership"]
        assert [(c[1], c[2], c[3]) for c in changes] == [((0,), (), 2), ((), (0,), 3)], changes
        assert outcomes[pid]["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
    joiner = outcomes[again.pid]
    assert joiner["env"]["RANK"] == "0"
    assert joiner["first_step"] == joiner["membership"][0][0] > HOLD + 3
    assert joiner["world_sizes"] == [3] * len(joiner["world_sizes"])
