"""Run a module-level function in N real processes, as torchrun would start them.

Each rank is a fresh ``python -c`` child with ``MASTER_ADDR=127.0.0.1``, a
free ``MASTER_PORT``, and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``LOCAL_WORLD_SIZE`` set. The child puts the parent's ``sys.path`` first (so
a test module's imports, ``tests.support`` included, resolve as under pytest),
imports the function's module from its file, calls ``fn(*args)`` and pickles
the return value (or the exception's type, message and traceback) to a file
the parent reads.

Children never outlive :func:`run_ranks`: on the hard timeout, on an error in
the parent (including pytest-timeout's interrupt), and shortly after one rank
fails while the others are still blocked in a collective, every child still
running is killed by its pid (SIGKILL) and reaped. On Linux a child also dies
with the parent process if that is killed outright (``PR_SET_PDEATHSIG``).

This module imports nothing heavy, so its own self-test functions start fast.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ("RankResult", "RanksTimedOut", "free_port", "run_file_ranks", "run_ranks")

# How long the other ranks may keep running after one rank failed: enough to
# raise their own (often more telling) error, not enough to sit out a gloo timeout.
FAILURE_GRACE_S = 5.0

_BOOT = r"""
import faulthandler, importlib.util, json, os, pickle, signal, sys, traceback
path, name, func, args_path, result_path, dump_after, parent, parent_path = sys.argv[1:9]
# The parent's import path first, as multiprocessing's spawn passes it: the module
# and what it imports (and the args' pickled classes) resolve as in the parent.
parent_path = json.loads(parent_path)
sys.path[:] = parent_path + [entry for entry in sys.path if entry not in parent_path]
if sys.platform == "linux":
    # Die with the parent, even if it is killed before it can kill us.
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)
# Every thread's stack lands in stderr shortly before the hard timeout, or
# when the harness is about to kill this rank, so a hang says where it hung.
faulthandler.dump_traceback_later(float(dump_after), exit=False)
faulthandler.register(signal.SIGUSR1, all_threads=True)
# The module's own folder too, after the parent's path (a script beside it imports its neighbours).
if os.path.dirname(path) not in sys.path:
    sys.path.append(os.path.dirname(path))
def write(payload):
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, result_path)
try:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    with open(args_path, "rb") as f:
        args = pickle.load(f)
    value = getattr(module, func)(*args)
    faulthandler.cancel_dump_traceback_later()
    try:
        write({"ok": True, "value": value})
    except Exception as error:
        raise TypeError(f"the return value of {func} cannot be pickled: {error}") from error
except BaseException as error:
    write({"ok": False, "type": type(error).__module__ + "." + type(error).__qualname__,
           "message": str(error), "traceback": traceback.format_exc()})
    sys.stderr.write(traceback.format_exc())
    sys.exit(1)
"""


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None
    """The child's exit status; negative for a signal (-9 when the harness killed it)."""
    value: Any = None
    error_type: str | None = None
    """Qualified name of the exception ``fn`` raised, e.g. ``gsync.errors.ConfigError``."""
    error: str | None = None
    """The exception's message."""
    traceback: str | None = None
    stderr: str = ""
    killed: bool = False
    returned: bool = False
    """Whether ``fn`` returned (or raised) and its result was written, whatever happened after."""

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.returncode == 0 and not self.killed

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.error_type is not None:
            return f"rank {self.rank}: {self.error_type}: {self.error}\n{self.traceback}"
        if self.killed:
            how = "returned its result, then was killed by the harness" if self.returned else "killed by the harness"
        elif self.returned:
            how = f"returned its result {self.value!r}, then exited with {_status(self.returncode)} while the process shut down"
        else:
            how = f"exited with {_status(self.returncode)} and no result"
        return f"rank {self.rank}: {how}; stderr tail:\n{self.stderr[-6000:]}"

    def unwrap(self) -> Any:
        if not self.ok:
            raise AssertionError(self.describe())
        return self.value


def _status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return str(returncode)


class RanksTimedOut(AssertionError):
    """The ranks did not all finish within the hard timeout; they were killed."""

    def __init__(self, timeout: float, results: Sequence[RankResult]) -> None:
        stuck = [r.rank for r in results if r.killed]
        details = "\n".join(r.describe() for r in results if not r.ok)
        super().__init__(f"ranks {stuck} did not finish within {timeout:g} s and were killed\n{details}")
        self.results = list(results)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    # Two ranks on a small machine: one intra-op thread each avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    # Keep gloo on loopback whatever the host name resolves to.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra or {})
    return env


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    check: bool = False,
    failure_grace: float = FAILURE_GRACE_S,
) -> list[RankResult]:
    """Run ``fn(*args)`` in ``world_size`` processes, one per rank; return each rank's result in rank order.

    ``fn`` must be a module-level function of an importable file; ``args`` and
    its return value must pickle. ``env`` adds to every child's environment.
    With ``check=True``, raise when any rank did not return normally. Once a
    rank has failed, the others get ``failure_grace`` seconds to finish before
    they are killed (their results then say ``killed``).

    :raises RanksTimedOut: when the ranks are not all done within ``timeout``
        seconds and none failed (every child is killed first).
    """
    module = sys.modules[fn.__module__]
    path = getattr(module, "__file__", None)
    if path is None or fn.__qualname__ != fn.__name__:
        raise TypeError(f"{fn!r} must be a module-level function of a module loaded from a file")
    return run_file_ranks(
        path, fn.__name__, world_size, module=fn.__module__, args=args, timeout=timeout, env=env, check=check,
        failure_grace=failure_grace,
    )


def run_file_ranks(
    path: str | os.PathLike[str],
    function: str,
    world_size: int = 2,
    *,
    module: str | None = None,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    check: bool = False,
    failure_grace: float = FAILURE_GRACE_S,
) -> list[RankResult]:
    """:func:`run_ranks` for the function named ``function`` of the Python file ``path``, which only the ranks
    import (as ``module``, by default the file's name): a tool runs a test file's rank functions this way without
    importing the test module itself."""
    path = os.fspath(path)
    module = module or Path(path).stem
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gsync-ranks-") as tmp:
        workdir = Path(tmp)
        args_path = workdir / "args.pkl"
        args_path.write_bytes(pickle.dumps(tuple(args)))
        procs: list[subprocess.Popen[bytes]] = []
        killed: set[int] = set()
        exited: queue.SimpleQueue[int] = queue.SimpleQueue()
        try:
            for rank in range(world_size):
                stderr = open(workdir / f"stderr{rank}.txt", "wb")
                with stderr:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _BOOT, path, module, function, str(args_path),
                         str(workdir / f"result{rank}.pkl"), str(max(timeout - 2.0, 0.5)), str(os.getpid()),
                         json.dumps([entry for entry in sys.path if isinstance(entry, str)])],
                        env=_rank_env(rank, world_size, port, env),
                        stdin=subprocess.DEVNULL,
                        stdout=stderr,
                        stderr=subprocess.STDOUT,
                    )
                procs.append(proc)
                # One waiter per child, so the parent wakes on whichever exits first.
                threading.Thread(target=lambda r=rank, p=proc: (p.wait(), exited.put(r)), daemon=True).start()
            deadline = time.monotonic() + timeout
            failure_seen = False
            pending = set(range(world_size))
            while pending:
                try:
                    rank = exited.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                pending.discard(rank)
                if not failure_seen and (procs[rank].returncode != 0 or not _result_ok(workdir, rank)):
                    failure_seen = True
                    deadline = min(deadline, time.monotonic() + failure_grace)
        finally:
            _kill_all(procs, killed)
        results = [_collect(workdir, rank, procs[rank].returncode, rank in killed) for rank in range(world_size)]
    if killed and not failure_seen:
        raise RanksTimedOut(timeout, results)
    if check:
        failed = [r for r in results if not r.ok]
        if failed:
            raise AssertionError("\n".join(r.describe() for r in failed))
    return results


def _kill_all(procs: Sequence[subprocess.Popen[bytes]], killed: set[int]) -> None:
    """SIGKILL every child still running (by pid), after asking it to dump its stacks; reap them all."""
    running = [(rank, proc) for rank, proc in enumerate(procs) if proc.poll() is None]
    for _, proc in running:
        proc.send_signal(signal.SIGUSR1)
    dump_deadline = time.monotonic() + 0.5
    for rank, proc in running:
        try:
            proc.wait(timeout=max(dump_deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
        killed.add(rank)
    for proc in procs:
        proc.wait()


def _result_ok(workdir: Path, rank: int) -> bool:
    path = workdir / f"result{rank}.pkl"
    if not path.exists():
        return False
    return bool(pickle.loads(path.read_bytes()).get("ok"))


def _collect(workdir: Path, rank: int, returncode: int | None, killed: bool) -> RankResult:
    stderr = (workdir / f"stderr{rank}.txt").read_bytes().decode(errors="replace")
    path = workdir / f"result{rank}.pkl"
    if not path.exists():
        return RankResult(rank, returncode, stderr=stderr, killed=killed)
    payload = pickle.loads(path.read_bytes())
    if payload["ok"]:
        return RankResult(rank, returncode, value=payload["value"], stderr=stderr, killed=killed, returned=True)
    return RankResult(
        rank,
        returncode,
        error_type=payload["type"],
        error=payload["message"],
        traceback=payload["traceback"],
        stderr=stderr,
        killed=killed,
        returned=True,
    )


# -- self-test helpers (no torch, so they start fast) ---------------------------


def selftest_echo(tag: str) -> dict[str, str]:
    return {"tag": tag, "pid": str(os.getpid()), **{k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}}


def selftest_import_path() -> list[str]:
    return list(sys.path)


def selftest_fail_on(rank: int) -> str:
    if os.environ["RANK"] == str(rank):
        raise ValueError(f"boom on rank {rank}")
    return "fine"


def selftest_hang() -> None:
    threading.Event().wait()


def selftest_fail_one_hang_others(rank: int) -> None:
    if os.environ["RANK"] == str(rank):
        raise RuntimeError("first failure")
    threading.Event().wait()


def selftest_return_then_abort() -> str:
    # The result is written after this returns; the abort comes during shutdown.
    import atexit

    atexit.register(os.abort)
    return "done"
