"""What an elastic run's failures cost, over real processes and gloo, in one run.

    .venv/bin/python bench/elastic.py            # ~4-5 min on 2 cores
    .venv/bin/python bench/elastic.py --quick    # ~2 min: fewer repeats, shorter runs
    .venv/bin/python bench/elastic.py --only recovery,overhead
    .venv/bin/python bench/elastic.py --only recovery,departure --repeats 2 --workloads small

Sections (``--only`` takes a comma-separated subset; default all):

- ``recovery``: 3 ranks, ``Engine(elastic=True)`` (default ``Elastic()``), rank 1 SIGKILLs itself in its
  ``loss_fn`` at step 4; the survivors' ``MembershipChange.seconds`` and the wall time from the kill (the time
  the victim wrote just before ``os.kill``) to the survivors' next applied step, the first on 2 ranks (their
  ``on_step_end`` ``time.time()``: one machine, one clock). A row for each workload (``--workloads``):
  torchft's own small elastic workload (``Linear(8,16)-Tanh-Linear(16,2)``, 24 rows; goal <= 0.2 s, beating
  torchft's 0.21 s) and the reference MLP (goal <= 0.4 s).
- ``departure``: the same with SIGTERM (the rank finishes its step in flight and leaves): the wall time from
  the SIGTERM to the others' first step applied without it. Goals <= 0.08 s (small) and <= 0.2 s (MLP).
  Printed as not measured while gsync has no departure (no ``gsync.Departed``, or a trial run that did not
  depart cleanly).
- ``overhead``: what ``elastic=True`` costs per step when nothing fails: the reference MLP over 2 processes,
  fits with ``elastic=False`` and ``elastic=True`` alternated in the same two processes (A B A B ... A), each
  ``elastic=True`` fit's median step period against the mean of the ``elastic=False`` fits either side of it.
  Goal <= 1.01.
- ``restart``: the time one failure costs: total wall time of a 2-rank run in which rank 1 is SIGKILLed at
  step 15, minus the same run's uninterrupted wall time; with ``elastic=True`` (the survivor goes on alone; and
  rank 1 started again at once by this script, as a scheduler would, rejoining at a step boundary) against
  ``torchrun --max-restarts 1`` with ``fit(checkpoint_dir=..., checkpoint_every=10, resume=checkpoint_dir)``
  (torchrun stops the survivor, starts both again, and they redo the steps since the newest checkpoint).
  Also from each interrupted run's own timeline: its last step's time minus the kill, minus the steps left at
  the kill at the run's pace before it (no second run in the difference, so less noisy on a shared machine).

The store is hosted by this script (``TORCHELASTIC_USE_AGENT_STORE=True`` in the ranks, as torchrun's agent
would host it), so any rank is losable. Every rank process is started with a timeout and killed (by pid) in a
``finally``; ranks also die with their parent (``PR_SET_PDEATHSIG``). Benchmarks print; they assert nothing.

This file is also the rank program: ``bench/elastic.py --rank CONFIG_JSON OUT_DIR`` (what this script and
torchrun start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import quiet_warnings, system_busy_s  # noqa: E402

quiet_warnings()

# Where the kill falls, for every scenario: well after the first (slow) steps.
KILL_STEP = 4
RESTART_KILL_STEP = 15
CHECKPOINT_EVERY = 10


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    steps: int
    """Steps of a recovery or departure run (the kill at KILL_STEP, well before the end)."""
    kill_goal: float
    """Issue 41's goal for SIGKILL to the survivors' next applied step (s)."""
    term_goal: float
    """Issue 41's goal for a SIGTERM departure to the others' next step without the rank (s)."""


WORKLOADS = {
    # torchft's own elastic workload, to compare with torchft's figures on it (0.21-0.24 s after a SIGKILL).
    "small": Workload("small", "torchft's small workload", 12, 0.2, 0.08),
    "mlp": Workload("mlp", "reference MLP", 8, 0.4, 0.2),
}
SMALL_ROWS = 24


def make_small() -> Any:
    """torchft's elastic workload: ``Linear(8,16)-Tanh-Linear(16,2)``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def small_batches(steps: int) -> list[Any]:
    """``steps`` global batches of 24 rows (8 a rank on 3 ranks), cycling through 4 random ones."""
    import torch

    generator = torch.Generator().manual_seed(1)
    pool = [(torch.randn(SMALL_ROWS, 8, generator=generator), torch.randint(0, 2, (SMALL_ROWS,), generator=generator))
            for _ in range(4)]
    return [pool[i % len(pool)] for i in range(steps)]


def small_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


# ============================================================================================ the rank program


def _die_with_parent() -> None:
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def rank_main(config: dict[str, Any], out_dir: Path) -> None:
    """One rank: the fits ``config["fits"]`` lists, one after the other, in this process; a JSON of what happened."""
    _die_with_parent()
    rank = int(os.environ["RANK"])
    name = os.environ.get("GSYNC_BENCH_NAME") or f"{rank}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    (out_dir / f"pid.{name}").write_text(str(os.getpid()))

    import asyncio
    import logging

    import torch

    import gsync
    from bench.workloads import loss_fn, make_batches, make_mlp, sgd

    workload = WORKLOADS[config.get("workload", "mlp")]
    if workload.name == "small":
        make_model, batches_of, loss_of = make_small, small_batches, small_loss
    else:
        make_model, batches_of, loss_of = make_mlp, make_batches, loss_fn

    logging.basicConfig(format=f"%(asctime)s rank {rank} pid {os.getpid()}: %(message)s", level=logging.INFO)
    torch.set_num_threads(1)
    die: dict[str, Any] = config.get("die") or {}
    marker = Path(die["marker"]) if die else None
    # A process started again (by torchrun or by this script) finds the marker and does not die again.
    dying = bool(die) and rank == die["rank"] and marker is not None and not marker.exists()
    signals = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
    last_applied = {"step": -1}
    fired = {"done": False}

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if dying and not fired["done"] and last_applied["step"] == die["step"] - 1:
            fired["done"] = True
            assert marker is not None
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(repr(time.time()))
            os.replace(tmp, marker)
            os.kill(os.getpid(), signals[die["how"]])
        return loss_of(model, batch)

    outcome: dict[str, Any] = {"name": name, "rank": rank, "pid": os.getpid(), "fits": [], "current": None}

    def save() -> None:
        tmp = out_dir / f"rank.{name}.json.tmp"
        tmp.write_text(json.dumps(outcome))
        os.replace(tmp, out_dir / f"rank.{name}.json")

    async def one_fit(spec: dict[str, Any]) -> dict[str, Any]:
        times: list[tuple[int, float, int, float]] = []
        losses: list[float] = []

        class Probe:
            def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
                last_applied["step"] = result.step
                times.append((result.step, time.time(), getattr(result, "world_size", 0), time.process_time()))
                losses.append(result.loss)

        elastic = spec.get("elastic", False)
        if isinstance(elastic, dict):
            elastic = gsync.Elastic(**elastic)
        record: dict[str, Any] = {"elastic": bool(elastic), "times": times, "losses": losses}
        outcome["current"] = record
        started = time.time()
        model = make_model()
        kwargs: dict[str, Any] = {}
        if spec.get("checkpoint_dir"):
            kwargs.update(checkpoint_dir=spec["checkpoint_dir"], checkpoint_every=spec["checkpoint_every"])
            if spec.get("resume"):
                kwargs["resume"] = spec["checkpoint_dir"]
        try:
            engine = gsync.Engine(["cpu"], elastic=elastic, sync_timeout=30)
            result = await engine.fit(model, batches_of(spec["steps"]), optimizer=sgd, loss_fn=loss,
                                      callbacks=[Probe()], progress=False, **kwargs)
        except BaseException as error:  # noqa: BLE001 - the parent reads what this rank raised
            record.update(ok=False, type=type(error).__name__, message=str(error)[:2000],
                          last_step=getattr(error, "last_step", None))
        else:
            record.update(
                ok=True,
                first_step=result.first_step,
                membership=[[c.step, list(c.lost), list(c.joined), c.world_size, c.seconds, c.reason]
                            for c in getattr(result, "membership", ())],
            )
        record.update(
            started=started,
            ended=time.time(),
            param_sum=float(sum(p.detach().double().sum() for p in model.parameters())),
        )
        return record

    async def fits() -> None:
        for spec in config["fits"]:
            outcome["fits"].append(await one_fit(spec))
            outcome["current"] = None
            save()

    if not any(spec.get("elastic") for spec in config["fits"]):
        # torchrun stops the ranks it restarts with SIGTERM: keep the steps this one applied, then die of it.
        def stopped(signum: int, frame: object) -> None:
            save()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, stopped)

    try:
        asyncio.run(fits())
    finally:
        save()


# ============================================================================================ launching ranks


class Timeout(RuntimeError):
    pass


def _free_port() -> int:
    from tests.support.harness import free_port

    return free_port()


class Job:
    """Rank processes of one run (started by this script around a store it hosts, or by torchrun), their outputs.

    Every process it started, and every rank whose pid file it finds, is killed and reaped in :meth:`close`.
    """

    def __init__(self, config: dict[str, Any], *, store: bool = True) -> None:
        self.config = config
        self.dir = Path(tempfile.mkdtemp(prefix="gsync-bench-elastic-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ended: dict[str, float] = {}
        self.store = None
        if store:
            from datetime import timedelta

            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
        self.started = time.time()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        return env

    def _cmd(self, config: dict[str, Any] | None = None) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--rank", json.dumps(config or self.config), str(self.dir)]

    def start(self, rank: int, world_size: int, config: dict[str, Any] | None = None) -> str:
        """Start (or start again) launch rank ``rank`` on this job's store; its name (``"1"``, then ``"1b"``)."""
        assert self.store is not None
        name = str(rank)
        while name in self.procs:
            name += "b"
        env = self._base_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True",
                   GSYNC_BENCH_NAME=name)
        with open(self.dir / f"log.{name}", "wb") as log:
            self.procs[name] = subprocess.Popen(self._cmd(config), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, cwd=ROOT)
        return name

    def torchrun(self, nproc: int, max_restarts: int) -> str:
        port = _free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--master-addr", "127.0.0.1", "--master-port", str(port),
               *self._cmd()[1:]]
        with open(self.dir / "log.torchrun", "wb") as log:
            self.procs["torchrun"] = subprocess.Popen(cmd, env=self._base_env(), stdin=subprocess.DEVNULL, stdout=log,
                                                      stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        return "torchrun"

    def poll(self) -> dict[str, int | None]:
        now = time.time()
        codes = {}
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None and name not in self.ended:
                self.ended[name] = now
            codes[name] = code
        return codes

    def wait(self, names: Sequence[str] | None, timeout: float, on_exit: Callable[[str, int], None] | None = None) -> None:
        """Until every process (or those named) has exited; ``on_exit(name, code)`` as each one does."""
        deadline = time.monotonic() + timeout
        seen: set[str] = set()
        while True:
            codes = self.poll()
            for name, code in codes.items():
                if code is not None and name not in seen:
                    seen.add(name)
                    if on_exit is not None:
                        on_exit(name, code)
            codes = self.poll()  # on_exit may have started another process
            wanted = [n for n in (names if names is not None else list(codes)) if n in codes]
            if all(codes[n] is not None for n in wanted):
                return
            if time.monotonic() > deadline:
                error = Timeout(f"processes {[n for n in wanted if codes[n] is None]} still running after {timeout:.0f} s")
                error.details = self.logs(6000)  # type: ignore[attr-defined]
                raise error
            time.sleep(0.01)

    def outcome(self, name: str) -> dict[str, Any] | None:
        path = self.dir / f"rank.{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def outcomes(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in sorted(self.dir.glob("rank.*.json")):
            found[path.name[len("rank."):-len(".json")]] = json.loads(path.read_text())
        return found

    def kill_time(self) -> float | None:
        marker = self.dir / "died"
        return float(marker.read_text()) if marker.exists() else None

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.dir.glob("log.*")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        try:
            for name, proc in self.procs.items():
                if proc.poll() is None:
                    if name == "torchrun":
                        try:
                            os.killpg(proc.pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    proc.kill()
            # Ranks torchrun started live in sessions of their own: their pid files name them. A pid is killed
            # only while its command line still names this job's folder (a pid that exited may be reused).
            for path in self.dir.glob("pid.*"):
                try:
                    pid = int(path.read_text())
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        if str(self.dir).encode() not in handle.read():
                            continue
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except (ValueError, OSError):
                    pass
            for proc in self.procs.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self.store = None  # the last reference: the server closes
            shutil.rmtree(self.dir, ignore_errors=True)


def _die(job: Job, how: str, rank: int = 1, step: int = KILL_STEP) -> dict[str, Any]:
    return {"rank": rank, "step": step, "how": how, "marker": str(job.dir / "died")}


def _fit(job: Job, cfg: dict[str, Any]) -> dict[str, Any]:
    return {**job.config, **cfg}


class ScenarioFailed(RuntimeError):
    """A run that did not go as the scenario expects; ``str()`` is one line, the ranks' outcomes and logs are kept."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.details = details


_FAILURES: list[Path] = []


def _failure_note(where: str, error: BaseException) -> str:
    """One line for the notes; the whole story (outcomes, rank logs) goes to a file named in it."""
    if not _FAILURES:
        _FAILURES.append(Path(tempfile.gettempdir()) / f"gsync-bench-elastic-failures-{os.getpid()}.txt")
    details = getattr(error, "details", "") or str(error)
    with open(_FAILURES[0], "a") as handle:
        handle.write(f"===== {where}: {str(error).splitlines()[0] if str(error) else type(error).__name__}\n{details}\n")
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"{where} failed: {first[:600]} (outcomes and rank logs in {_FAILURES[0]})"


def _require(condition: bool, what: str, job: Job) -> None:
    if not condition:
        raise ScenarioFailed(what, f"{json.dumps(job.outcomes(), default=str)[:6000]}\n{job.logs(6000)}")


# ============================================================================================ measurements


def _steady_period(times: list[list[float]], skip: int = 2, column: int = 1) -> float:
    """Median period between consecutive applied steps, the first ``skip`` periods (warm-up) left out.

    ``column`` 1: wall time; 3: the rank process's CPU time (all its threads).
    """
    ends = [row[column] for row in times]
    periods = [b - a for a, b in itertools.pairwise(ends)][skip:]
    return statistics.median(periods) if periods else float("nan")


def _lost_one(how: str, workload: Workload, timeout: float) -> dict[str, Any]:
    """3 elastic ranks, rank 1 SIGKILLed or SIGTERMed in its loss_fn at step KILL_STEP; the survivors' numbers."""
    steps = workload.steps
    with Job({}) as job:
        job.config = {"fits": [{"steps": steps, "elastic": True}], "die": _die(job, how), "workload": workload.name}
        for rank in range(3):
            job.start(rank, 3)
        job.wait(["0", "2"], timeout)
        job.wait(["1"], 15)  # a departing rank ends too; a killed one is gone already
        killed_at = job.kill_time()
        _require(killed_at is not None, "rank 1 never reached its step to die", job)
        assert killed_at is not None
        outcomes = job.outcomes()
        survivors = [outcomes.get("0"), outcomes.get("2")]
        _require(all(s is not None and s["fits"] and s["fits"][0]["ok"] for s in survivors),
                 f"a survivor did not end its fit cleanly (return codes {job.poll()})", job)
        fits = [s["fits"][0] for s in survivors]  # type: ignore[index]
        after = []
        without = []
        for fit in fits:
            later = [t for _, t, _, _ in fit["times"] if t > killed_at]
            smaller = [t for _, t, w, _ in fit["times"] if t > killed_at and w == 2]
            _require(bool(later) and bool(smaller), "a survivor applied no step after the signal", job)
            after.append(later[0] - killed_at)
            without.append(smaller[0] - killed_at)
        changes = [fit["membership"] for fit in fits]
        _require(all(len(c) == 1 and c[0][1] == [1] for c in changes), f"unexpected membership {changes}", job)
        reasons = {c[0][5] for c in changes}
        steps_applied = [[row[0] for row in fit["times"]] for fit in fits]
        _require(all(s == list(range(steps)) for s in steps_applied), f"steps not applied once each: {steps_applied}", job)
        phases = [_phases(job, name, killed_at) for name in ("0", "2")]
        result = {
            "phases": [p for p in phases if p is not None],
            "kill_to_any_s": max(after),
            "kill_to_without_s": max(without),
            "change_seconds": max(c[0][4] for c in changes),
            "step_s": statistics.median(_steady_period(fit["times"][:KILL_STEP]) for fit in fits),
            "reasons": sorted(reasons),
            "victim": outcomes.get("1"),
            "victim_code": job.poll()["1"],
        }
        return result


def _log_time(line: str) -> float:
    """The time of a rank's log line (``logging``'s asctime: local time, milliseconds)."""
    stamp, millis = line[:23].split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1e3


def _phases(job: Job, name: str, signalled: float) -> tuple[float, float] | None:
    """From a survivor's log: the signal to the new membership decided, and that to its session started."""
    path = job.dir / f"log.{name}"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    decided = [_log_time(line) for line in lines if "membership change at step" in line]
    sessions = [_log_time(line) for line in lines if "gsync: session on" in line]
    if not decided or len(sessions) < 2:
        return None
    return decided[0] - signalled, sessions[1] - decided[0]


def _phase_note(what: str, results: list[dict[str, Any]]) -> str | None:
    phases = [p for r in results for p in r["phases"]]
    if not phases:
        return None
    return (f"{what}: from the signal, the new membership was decided after {statistics.median(p[0] for p in phases):.2f} s "
            f"(median over survivors and runs), the next session was up {statistics.median(p[1] for p in phases):.2f} s "
            "after that (gsync's log lines, millisecond stamps); the rest is the redone step")


def departure_available() -> str | None:
    """None when gsync has SIGTERM departure, else why not."""
    import gsync

    if not hasattr(gsync, "Departed"):
        return "gsync has no Departed"
    return None


@dataclass
class Row:
    label: str
    values: list[float]
    unit: str  # "s" or "x" (a ratio)
    goal: float | None = None
    what: str = ""
    """One line: what the row measures."""
    missing: str = ""
    """Why the row has no values (printed in their place)."""

    def cells(self) -> tuple[str, ...]:
        if not self.values:
            return self.label, self.missing or "no clean run (see the notes)", "", "", ""
        med = statistics.median(self.values)
        fmt = (lambda v: f"{v:.3f}") if self.unit == "x" else (lambda v: f"{v:.2f}")
        unit = "" if self.unit == "x" else " s"
        spread = f"{fmt(min(self.values))}..{fmt(max(self.values))}{unit}" if len(self.values) > 1 else ""
        goal = "" if self.goal is None else f"<= {self.goal:g}{unit}"
        ratio = "" if self.goal is None else f"{med / self.goal:.2f}"
        return self.label, f"{fmt(med)}{unit}", f"{spread} (n={len(self.values)})", goal, ratio


def section_recovery(repeats: int, workloads: Sequence[Workload]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    for workload in workloads:
        new_rows, new_notes = _recovery(repeats, workload)
        rows += new_rows
        notes += new_notes
    return rows, notes


def _recovery(repeats: int, workload: Workload) -> tuple[list[Row], list[str]]:
    rows_next, rows_change, step_times, notes = [], [], [], []
    results: list[dict[str, Any]] = []
    for attempt in range(repeats):
        try:
            r = _lost_one("kill", workload, timeout=120)
        except (ScenarioFailed, Timeout) as error:
            notes.append(_failure_note(f"recovery ({workload.label}) run {attempt + 1}", error))
            continue
        results.append(r)
        rows_next.append(r["kill_to_without_s"])
        rows_change.append(r["change_seconds"])
        step_times.append(r["step_s"])
        if r["victim_code"] != -signal.SIGKILL:
            notes.append(f"recovery ({workload.label}) run {attempt + 1}: rank 1 exited with {r['victim_code']}, not SIGKILL")
    if step_times:
        notes.append(f"recovery ({workload.label}): a step of 3 ranks took {statistics.median(step_times) * 1e3:.0f} ms "
                     "before the kill (part of each recovery: the interrupted step is redone)")
    phase = _phase_note(f"recovery ({workload.label})", results)
    if phase:
        notes.append(phase)
    return [
        Row(f"1 SIGKILL -> survivors' next applied step, {workload.label}", rows_next, "s", workload.kill_goal,
            f"3 ranks ({_described(workload)}, 1 thread each), Engine(elastic=True); rank 1 SIGKILLs itself in "
            f"loss_fn at step {KILL_STEP}: wall time from the kill to the later survivor's first step applied on 2 "
            "ranks (the interrupted step, redone), from the time the victim wrote just before os.kill and the "
            "survivors' on_step_end time.time()"),
        Row(f"1 MembershipChange.seconds, {workload.label}", rows_change, "s", workload.kill_goal,
            "the same runs: the later survivor's FitResult.membership[0].seconds (its last step applied before the "
            "change to the first applied after it)"),
    ], notes


def _described(workload: Workload) -> str:
    if workload.name == "small":
        return f"torchft's Linear(8,16)-Tanh-Linear(16,2), {SMALL_ROWS} rows a global batch"
    return "reference MLP, 256 rows a global batch"


def section_departure(repeats: int, workloads: Sequence[Workload]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    for workload in workloads:
        new_rows, new_notes = _departure(repeats, workload)
        rows += new_rows
        notes += new_notes
    return rows, notes


def _departure(repeats: int, workload: Workload) -> tuple[list[Row], list[str]]:
    label = f"2 SIGTERM -> others' first step without it, {workload.label}"
    what = (f"3 ranks as in 1 ({_described(workload)}), rank 1 sends itself SIGTERM in loss_fn at step "
            f"{KILL_STEP} (it finishes that step and departs): wall time from the signal to the later survivor's "
            "first step applied on 2 ranks")
    why = departure_available()

    def not_measured(reason: str) -> tuple[list[Row], list[str]]:
        return [Row(label, [], "s", workload.term_goal, what, f"not measured: SIGTERM departure not implemented yet ({reason})")], []

    if why is not None:
        return not_measured(why)
    values, changes, nexts, notes = [], [], [], []
    results: list[dict[str, Any]] = []
    reasons: list[str] = []
    for attempt in range(repeats):
        try:
            r = _lost_one("term", workload, timeout=120)
        except (ScenarioFailed, Timeout) as error:
            notes.append(_failure_note(f"departure ({workload.label}) run {attempt + 1}", error))
            continue
        victim = ((r["victim"] or {}).get("fits") or [{}])[0]
        if victim.get("type") != "Departed":
            if not results and attempt == 0:
                return not_measured(f"rank 1 ended with {victim.get('type')}: {str(victim.get('message'))[:200]}")
            notes.append(f"departure ({workload.label}) run {attempt + 1}: rank 1 ended with {victim.get('type')}, not Departed")
            continue
        results.append(r)
        reasons += r["reasons"]
        values.append(r["kill_to_without_s"])
        nexts.append(r["kill_to_any_s"])
        changes.append(r["change_seconds"])
    if nexts:
        notes.append(f"departure ({workload.label}): SIGTERM -> the others' next applied step of any kind (the departing "
                     f"rank's last one included): median {statistics.median(nexts):.2f} s")
    if reasons and set(reasons) != {"left"}:
        notes.append(f"departure ({workload.label}): the survivors recorded the change as {reasons} (one per run): "
                     "'lost' means the departing rank's word came after answer_within (0.25 s) and the others went on "
                     "without it as from a loss")
    phase = _phase_note(f"departure ({workload.label})", results)
    if phase:
        notes.append(phase)
    return [
        Row(label, values, "s", workload.term_goal, what),
        Row(f"2 MembershipChange.seconds, {workload.label}", changes, "s", workload.term_goal,
            "the same runs: the later survivor's MembershipChange.seconds"),
    ], notes


def section_overhead(pairs: int, steps: int, timeout: float) -> tuple[list[Row], list[str]]:
    notes: list[str] = []
    with Job({}) as job:
        order = [{"steps": 6, "elastic": False}, {"steps": 6, "elastic": True}]  # warm-up of each, left out
        for _ in range(pairs):
            order += [{"steps": steps, "elastic": False}, {"steps": steps, "elastic": True}]
        order.append({"steps": steps, "elastic": False})
        job.config = {"fits": order}
        for rank in range(2):
            job.start(rank, 2)
        job.wait(None, timeout)
        outcomes = job.outcomes()
        zero = outcomes.get("0")
        _require(zero is not None and len(zero["fits"]) == len(order) and all(f["ok"] for f in zero["fits"]),
                 "the overhead ranks did not run every fit", job)
        fits = zero["fits"][2:]  # type: ignore[index]
        periods = [_steady_period(f["times"]) for f in fits]
        cpu = [_steady_period(f["times"], column=3) for f in fits]
        setup = [f["times"][0][1] - f["started"] for f in fits]
    plain, elastic = periods[0::2], periods[1::2]
    ratios = [e / ((a + b) / 2) for e, a, b in zip(elastic, plain, plain[1:])]
    cpu_ratios = [e / ((a + b) / 2) for e, a, b in zip(cpu[1::2], cpu[0::2], cpu[2::2])]
    notes.append(f"overhead: reference MLP, 2 processes x 1 thread, {steps} steps a fit: elastic=False "
                 f"{statistics.median(plain) * 1e3:.1f} ms/step (median of {len(plain)} fits), elastic=True "
                 f"{statistics.median(elastic) * 1e3:.1f} ms/step ({len(elastic)} fits); rank 0's CPU per step "
                 f"{statistics.median(cpu[0::2]) * 1e3:.1f} and {statistics.median(cpu[1::2]) * 1e3:.1f} ms; "
                 f"fit() to its first applied step {statistics.median(setup[0::2]):.2f} s and "
                 f"{statistics.median(setup[1::2]):.2f} s")
    return [Row("3 step time elastic=True / elastic=False", ratios, "x", 1.01,
                "reference MLP over 2 processes (1 thread each, gloo), nothing failing: fits with elastic=False and "
                f"elastic=True alternated in the same two processes ({steps} steps each); each elastic fit's median "
                "step period (wall) over the mean of the elastic=False fits either side of it"),
            Row("3 the same in CPU time per step", cpu_ratios, "x", 1.01,
                "the same fits: rank 0's process CPU time (all threads) per step; less sensitive to other load")], notes


def _applied_at(fit: dict[str, Any], step: int, after: float = 0.0) -> float | None:
    """When ``fit`` applied ``step`` (the first time after ``after``)."""
    return next((t for s, t, _, _ in fit["times"] if s == step and t > after), None)


def _restart_run(kind: str, steps: int, timeout: float) -> dict[str, Any]:
    """One 2-rank run; ``kind``: e0 e1 e2 (elastic: uninterrupted, lost, lost and started again), t0 t1 (torchrun)."""
    elastic = kind.startswith("e")
    with Job({}, store=elastic) as job:
        spec = {"steps": steps, "elastic": elastic, "checkpoint_dir": str(job.dir / "ckpt"),
                "checkpoint_every": CHECKPOINT_EVERY, "resume": not elastic}
        job.config = {"fits": [spec]}
        if kind.endswith(("1", "2")):
            job.config["die"] = _die(job, "kill", rank=1, step=RESTART_KILL_STEP)
        started = time.time()
        restarted: dict[str, str] = {}
        if elastic:
            for rank in range(2):
                job.start(rank, 2)

            def again(name: str, code: int) -> None:
                if kind == "e2" and name == "1" and code == -signal.SIGKILL:
                    restarted["name"] = job.start(1, 2)  # at once, as a scheduler restarting it would

            job.wait(["0", "1"], timeout, on_exit=again)
            if kind == "e2" and "name" in restarted:
                try:
                    job.wait([restarted["name"]], 15)
                except Timeout:
                    pass  # reported below: it is still waiting to be taken in
        else:
            job.torchrun(2, max_restarts=1)
            job.wait(["torchrun"], timeout)
            _require(job.poll()["torchrun"] == 0, f"torchrun exited with {job.poll()['torchrun']}", job)
        ended = max(job.ended.get(name, time.time()) for name in job.procs)
        outcomes = job.outcomes()
        killed_at = job.kill_time()
        zero_name = "0" if elastic else max((n for n in outcomes if n.startswith("0.")), default="0.0")
        zero = outcomes.get(zero_name)
        _require(zero is not None and bool(zero["fits"]) and zero["fits"][0]["ok"], f"rank 0 did not end its fit ({kind})", job)
        fit = zero["fits"][0]  # type: ignore[index]
        _require(fit["times"][-1][0] == steps - 1, f"rank 0 ended at step {fit['times'][-1][0]} ({kind})", job)
        phases: dict[str, float] = {}
        if killed_at is not None and kind != "t1":
            after = [t for _, t, w, _ in fit["times"] if t > killed_at and w == 1]
            if after:
                phases["survivor's first step alone"] = after[0] - killed_at
        if kind == "e2":
            joiner_fit = (outcomes.get(restarted.get("name", "")) or {"fits": [{}]})["fits"][0]
            joined = [c for c in fit.get("membership") or [] if c[5] == "joined"]
            _require(bool(joined) and joiner_fit.get("ok", False),
                     f"the rank started again was not taken in before the run ended (rank 0's membership "
                     f"{fit.get('membership')}; the restarted rank: {joiner_fit.get('type')}: "
                     f"{str(joiner_fit.get('message'))[:300]}; still running: {job.poll().get(restarted.get('name', ''))})",
                     job)
            if killed_at is not None:
                phases["restarted process in fit()"] = joiner_fit["started"] - killed_at
                at = _applied_at(fit, joined[0][0], killed_at)
                if at is not None:
                    phases["the first step on 2 ranks again applied"] = at - killed_at
                phases["the survivor's stall at the join (MembershipChange.seconds)"] = joined[0][4]
        if kind == "t1" and killed_at is not None:
            phases["restarted ranks in fit()"] = fit["started"] - killed_at
            if fit["times"]:
                phases["first step after restart"] = fit["times"][0][1] - killed_at
            back = _applied_at(fit, RESTART_KILL_STEP, killed_at)
            if back is not None:
                phases[f"step {RESTART_KILL_STEP} applied"] = back - killed_at
        timeline = None
        if killed_at is not None:
            # The run's own pace before the kill (rank 0 of the first attempt: torchrun's saved it on SIGTERM).
            first = fit
            if kind == "t1":
                first = (outcomes.get("0.0") or {}).get("current") or {"times": []}
            before = [row for row in first["times"] if row[1] < killed_at]
            pace = _steady_period(before)
            if not math.isnan(pace):
                timeline = fit["times"][-1][1] - killed_at - (steps - RESTART_KILL_STEP) * pace
        losses = {int(row[0]): loss for row, loss in zip(fit["times"], fit.get("losses", []))}
        return {"wall_s": ended - started, "timeline_s": timeline, "losses": losses,
                "first_step": fit.get("first_step"), "param_sum": fit["param_sum"],
                "membership": fit.get("membership"), "step_s": _steady_period(fit["times"][:RESTART_KILL_STEP]),
                "launch_to_first_step_s": fit["times"][0][1] - started if kind != "t1" else None, "phases": phases}


def section_restart(repeats: int, steps: int) -> tuple[list[Row], list[str]]:
    kinds = ("e0", "t0", "e1", "t1", "e2")
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    costs: dict[str, list[float]] = {k: [] for k in ("e1", "e2", "t1")}
    timeline: dict[str, list[float]] = {k: [] for k in ("e1", "e2", "t1")}
    sums: dict[str, list[float]] = {k: [] for k in kinds}
    phases: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    startup: dict[str, list[float]] = {k: [] for k in kinds}
    per_repeat: list[dict[str, float]] = []
    loss_mismatches: list[str] = []
    loss_checked = 0
    notes: list[str] = []
    for attempt in range(repeats):
        run: dict[str, dict[str, Any]] = {}
        for kind in kinds if attempt % 2 == 0 else tuple(reversed(kinds)):
            try:
                run[kind] = _restart_run(kind, steps, timeout=180)
            except (ScenarioFailed, Timeout) as error:
                notes.append(_failure_note(f"restart run {attempt + 1}, {kind}", error))
                continue
            walls[kind].append(run[kind]["wall_s"])
            sums[kind].append(run[kind]["param_sum"])
            if run[kind]["timeline_s"] is not None:
                timeline[kind].append(run[kind]["timeline_s"])
            for phase, value in run[kind]["phases"].items():
                phases[kind].setdefault(phase, []).append(value)
            if run[kind]["launch_to_first_step_s"] is not None:
                startup[kind].append(run[kind]["launch_to_first_step_s"])
        for kind, base in (("e1", "e0"), ("e2", "e0"), ("t1", "t0")):
            if kind in run and base in run:
                ref = run[base]["losses"]
                off = [(step, loss - ref[step]) for step, loss in sorted(run[kind]["losses"].items())
                       if step in ref and abs(loss - ref[step]) > 1e-4 * max(1.0, abs(ref[step]))]
                if off:
                    loss_mismatches.append(f"repeat {attempt + 1} {kind}: rank 0's loss differs from {base}'s from step "
                                           f"{off[0][0]} on ({len(off)} steps, first by {off[0][1]:+.2e}); membership "
                                           f"{run[kind]['membership']}")
                else:
                    loss_checked += 1
        cost = {kind: run[kind]["wall_s"] - run[base]["wall_s"]
                for kind, base in (("e1", "e0"), ("e2", "e0"), ("t1", "t0")) if kind in run and base in run}
        for kind, value in cost.items():
            costs[kind].append(value)
        per_repeat.append(cost)
        if "t1" in run:
            notes.append(f"restart run {attempt + 1}: torchrun resumed at step {run['t1']['first_step']} "
                         f"({RESTART_KILL_STEP - (run['t1']['first_step'] or 0)} steps redone)")
    if walls["e0"] and walls["t0"]:
        notes.append(f"restart: uninterrupted {steps}-step runs took {statistics.median(walls['e0']):.2f} s (elastic) "
                     f"and {statistics.median(walls['t0']):.2f} s (torchrun), launch to first applied step "
                     f"{statistics.median(startup['e0']):.2f} s and {statistics.median(startup['t0']):.2f} s")
    names = {"e1": "elastic, alone", "e2": "elastic, rank started again", "t1": "torchrun"}
    for kind, name in names.items():
        if phases[kind]:
            notes.append(f"restart, {name}: from the kill, " + ", ".join(
                f"{phase} {statistics.median(values):.2f} s" for phase, values in phases[kind].items()))
    if loss_checked:
        notes.append(f"restart: rank 0's loss at every step matched the uninterrupted run's (to 1e-4) in {loss_checked} "
                     "interrupted run(s)")
    notes += [f"restart: {line}" for line in loss_mismatches]
    reference = statistics.median(sums["e0"]) if sums["e0"] else None
    if reference is not None:
        sum_off = {k: max(abs(s - reference) for s in v) for k, v in sums.items() if v}
        notes.append("restart: rank 0's final parameter sum off the uninterrupted elastic run's by at most "
                     + ", ".join(f"{k} {v:.2e}" for k, v in sum_off.items()))
    common = (f"2 ranks, reference MLP {steps} steps, fit(checkpoint_dir=..., checkpoint_every={CHECKPOINT_EVERY}) in "
              f"every run, rank 1 SIGKILLs itself in loss_fn at step {RESTART_KILL_STEP}; total wall time (launch to "
              "the last process's exit) minus the uninterrupted run's of the same repeat")
    rows = [
        Row("4 failure cost: elastic, survivor goes on alone", costs["e1"], "s", None,
            f"{common}; elastic=True, the survivor finishes alone"),
        Row("4 failure cost: elastic, killed rank started again", costs["e2"], "s", None,
            f"{common}; elastic=True, this script starts rank 1 again as soon as it is dead; it knocks and is taken in "
            "at a step boundary"),
        Row("4 failure cost: torchrun --max-restarts 1 + resume", costs["t1"], "s", None,
            f"{common}; elastic=False under torchrun, which stops rank 0 and starts both again; they resume from "
            "the newest checkpoint (resume=checkpoint_dir) and redo the steps since it"),
        Row("4 the same from each run's timeline: elastic, alone", timeline["e1"], "s", None,
            "the interrupted runs above, each against its own pace: rank 0's last applied step minus the kill, minus "
            f"the {steps - RESTART_KILL_STEP} steps left at the kill at rank 0's median step period before it (no "
            "second run in it, so less noisy on a shared machine; it leaves out process start and end)"),
        Row("4 the same from each run's timeline: elastic, again", timeline["e2"], "s", None, "as above"),
        Row("4 the same from each run's timeline: torchrun", timeline["t1"], "s", None,
            "as above (rank 0's pace before the kill: its steps saved when torchrun SIGTERMed it)"),
        Row("4 elastic (started again) / torchrun", [c["e2"] / c["t1"] for c in per_repeat if "e2" in c and "t1" in c], "x", None,
            "the two rows above, repeat by repeat"),
        Row("4 elastic (alone) / torchrun", [c["e1"] / c["t1"] for c in per_repeat if "e1" in c and "t1" in c], "x", None,
            "the survivor-alone row over the torchrun row, repeat by repeat"),
    ]
    return rows, notes


# ============================================================================================ the report

def print_table(rows: list[Row]) -> None:
    header = ("row", "median", "spread min..max (runs)", "goal", "median/goal")
    cells = [row.cells() for row in rows]
    complete = [c for c in cells if c[2]]
    widths = [max(len(c[i]) for c in [header, *complete]) for i in range(len(header))]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for c in cells:
        if c[2]:
            print("  " + "  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
        else:
            print("  " + c[0].ljust(widths[0]) + "  " + c[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter runs (~2 min)")
    parser.add_argument("--only", default="recovery,departure,overhead,restart")
    parser.add_argument("--workloads", default="small,mlp",
                        help="the recovery and departure sections' workloads: small (torchft's), mlp (the reference)")
    parser.add_argument("--repeats", type=int, default=0, help="runs of each recovery and departure row (default 4 and 3; quick 2 and 1)")
    parser.add_argument("--rank", nargs=2, metavar=("CONFIG_JSON", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(json.loads(args.rank[0]), Path(args.rank[1]))
        return
    only = {part.strip() for part in args.only.split(",") if part.strip()}
    quick = args.quick
    workloads = [WORKLOADS[name.strip()] for name in args.workloads.split(",") if name.strip()]
    import torch

    import gsync

    print(f"gsync elastic benchmark ({'quick' if quick else 'full'}): torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.2f}; gsync from {Path(gsync.__file__).parent}")
    rows: list[Row] = []
    notes: list[str] = []
    sections = [
        ("recovery", lambda: section_recovery(args.repeats or (2 if quick else 4), workloads)),
        ("departure", lambda: section_departure(args.repeats or (1 if quick else 3), workloads)),
        ("overhead", lambda: section_overhead(2 if quick else 6, 12 if quick else 15, 300)),
        ("restart", lambda: section_restart(1 if quick else 2, 45 if quick else 50)),
    ]
    began = time.monotonic()
    for name, run in sections:
        if name not in only:
            continue
        t0, busy0 = time.monotonic(), system_busy_s()
        children0 = _children_cpu()
        new_rows, new_notes = run()
        wall = time.monotonic() - t0
        busy1 = system_busy_s()
        other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - (_children_cpu() - children0)) / wall)
        rows += new_rows
        notes += new_notes
        notes.append(f"{name}: {wall:.0f} s" + (f", other load {other:.2f} cores" if other is not None else ""))
        print(f"  ... {name} done in {wall:.0f} s", flush=True)
    print(f"\n== elastic membership: failure cost and steady-state cost (total {time.monotonic() - began:.0f} s) ==")
    print_table(rows)
    print("\nWhat each row measures:")
    for row in rows:
        if row.what:
            print(f"  {row.label}: {row.what}")
    print("\nNotes:")
    for line in notes:
        print(f"  {line}")


def _children_cpu() -> float:
    """CPU seconds of this process and of its reaped children (torchrun's ranks included, once torchrun is reaped)."""
    total = 0.0
    for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


if __name__ == "__main__":
    main()
