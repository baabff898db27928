"""Running measurements in fresh processes, with timeouts and no process left behind.

Every worker starts in its own session (process group), so on timeout, error or
Ctrl-C the whole group (including anything it spawned) is killed. Rank processes
(DDP, gsync across processes) are started by the tests' multi-process harness
(``tests/support/harness.py``: torchrun's environment, a free port, no child left
behind), so the benchmarks and the tests start ranks one way.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import worker
from tests.support.harness import RanksTimedOut
from tests.support.harness import run_ranks as harness_run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIVE: set[int] = set()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _LIVE.discard(pid)


@atexit.register
def _kill_all() -> None:
    for pid in list(_LIVE):
        _kill_group(pid)


class TaskFailed(RuntimeError):
    pass


def run_group(tasks: list[tuple[str, dict[str, Any]]], timeout: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start every ``(task, kwargs)`` at once, each in a fresh process; wait for all.

    If one fails, or ``timeout`` seconds pass, every process group of the batch is
    killed and :class:`TaskFailed` is raised with the tail of the failing log.
    """
    workdir = tempfile.mkdtemp(prefix="gsync-bench-")
    procs: list[tuple[subprocess.Popen[bytes], str, str]] = []
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = ROOT + os.pathsep + child_env.get("PYTHONPATH", "")
    try:
        for i, (task, kwargs) in enumerate(tasks):
            result_path = os.path.join(workdir, f"{i}.json")
            log_path = os.path.join(workdir, f"{i}.log")
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.worker", task, json.dumps(kwargs), result_path],
                    cwd=ROOT,
                    env=child_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            _LIVE.add(proc.pid)
            procs.append((proc, result_path, log_path))
        deadline = time.monotonic() + timeout
        failed: tuple[str, str] | None = None
        while True:
            codes = [proc.poll() for proc, _, _ in procs]
            bad = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if bad:
                failed = (tasks[bad[0]][0], procs[bad[0]][2])
                break
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                pending = [i for i, code in enumerate(codes) if code is None][0]
                failed = (f"{tasks[pending][0]} (timed out after {timeout:.0f} s)", procs[pending][2])
                break
            time.sleep(0.05)
        if failed is not None:
            task, log_path = failed
            with open(log_path, errors="replace") as handle:
                tail = handle.read()[-3000:] or "(no output)"
            raise TaskFailed(f"{task} failed:\n{tail}")
        results = []
        for _, result_path, _ in procs:
            with open(result_path) as handle:
                results.append(json.load(handle))
        return results
    finally:
        for proc, _, _ in procs:
            _kill_group(proc.pid)  # the group may hold children that outlived the leader
            if proc.poll() is None:
                proc.wait()
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)


def run_task(task: str, kwargs: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    return run_group([(task, kwargs)], timeout, env)[0]


def run_ranks(task: str, world_size: int, kwargs: dict[str, Any], timeout: float,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``world_size`` rank processes of ``task`` (called with ``rank``, ``world_size``, ``port`` and ``kwargs``),
    started by the tests' harness on a free local port (one retry if the port was taken between finding and
    binding it). Each rank's process gets ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise."""
    child_env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    for attempt in range(2):
        try:
            results = harness_run_ranks(worker.run_rank, world_size, args=(task, kwargs), timeout=timeout, env=child_env)
        except RanksTimedOut as error:
            raise TaskFailed(f"{task}: {error}"[-3000:]) from None
        failed = [r for r in results if not r.ok]
        if not failed:
            return [r.value for r in results]
        details = "\n".join(r.describe() for r in failed)
        if attempt == 1 or "address already in use" not in details.lower():
            raise TaskFailed(f"{task} failed:\n{details[-3000:]}")
    raise AssertionError("unreachable")
