"""gsync benchmark suite: one command, printed tables, JSON (and a PNG if matplotlib is there).

    python bench/run.py --quick              # ~2 min on 2 cores (python -m bench.run works the same)
    python bench/run.py                      # full: 3 interleaved repeats, ~6 min on 2 cores
    python bench/run.py --only step          # step time: gsync vs one process vs the floor vs DDP
    python bench/run.py --only control,memory --out /tmp/x.json

Sections (``--only`` takes a comma-separated subset; default all):

- ``step``: reference MLP (784-2048-2048-2048-10, batch 256, SGD momentum) median ms/step for
  one plain process, the 2-replica compute floor (two threads, no sync), gsync on 2 CPU
  devices (through ``fit`` and through a plain ``for`` loop over ``session.step``, with gsync's
  default threads; and on one thread the devices share), torch DDP gloo
  (2 processes x 1 thread), with ratios and gsync's trace analysis
- ``memory``: peak RSS per configuration (each measured in its own fresh process)
- ``control``: control-plane cost on 200 tiny parameter tensors (gsync against the same work
  sequentially in one thread, measured between gsync's repeats in its process), messages per step
- ``control8``: 8 virtual CPU devices on 100 tiny parameter tensors, one bucket (on the shared
  thread and with a thread per device) and one bucket per tensor, against the 8 replicas' work
  done sequentially in one thread (paired as in ``control``): ms/step, ratio, event-loop CPU,
  BucketReady messages, thread posts and loop wake-ups per step, loop CPU per message
- ``sweeps``: gsync step time vs bucket_cap_mb and vs device count
- ``checkpoint`` (full mode, or on request): gsync's step time with ``fit(checkpoint_dir=...)`` writing
  every step and every 50 steps, against none (100 measured steps each)
- ``ablation`` (full mode, or on request): the 2-replica floor holding gradients the way gsync
  does (persistent bucket views, zeroed and accumulated) vs plain PyTorch vs DDP-style copies
- ``compression`` (full mode, or on request): 2 processes (gloo, 1 thread each), gsync with and without
  ``Engine(compression="bf16")`` beside torch DDP with and without ``bf16_compress_hook``
- ``multiprocess`` (on request): the same without compression: gsync across 2 processes vs DDP

Every configuration runs in a fresh process with a timeout; benchmarks never assert timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # python bench/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import report  # noqa: E402
from bench.common import NOISY_CORES, median, other_load, system_busy_s  # noqa: E402
from bench.isolate import ROOT, TaskFailed, run_ranks, run_task  # noqa: E402

SECTIONS = ("step", "memory", "control", "control8", "sweeps", "checkpoint", "ablation", "compression",
            "multiprocess")
QUICK_DEFAULT = ("step", "memory", "control", "control8", "sweeps")  # the rest only on request in --quick
FULL_DEFAULT = SECTIONS[:-1]  # multiprocess is a subset of compression


@dataclass(frozen=True)
class Plan:
    repeats: int
    steps: int
    warmup: int
    sweep_steps: int
    sweep_warmup: int
    control_short: int
    control_long: int
    control_repeats: int
    per_param_short: int
    per_param_long: int
    control8_short: int
    control8_long: int
    control8_repeats: int
    tiny_floor_steps: int
    timeout: float
    retries: int  # reruns of one noisy measurement
    retry_budget: int  # reruns in the whole run
    quiet_wait_budget_s: float  # seconds the whole run may wait for other load to drop
    patience_until_s: float  # no more waiting or rerunning once the run is this old


QUICK = Plan(repeats=1, steps=10, warmup=3, sweep_steps=6, sweep_warmup=2, control_short=30, control_long=150,
             control_repeats=2, per_param_short=8, per_param_long=32, control8_short=10, control8_long=40, control8_repeats=2,
             tiny_floor_steps=100, timeout=120,
             retries=1, retry_budget=3, quiet_wait_budget_s=20, patience_until_s=80)
# The 2-device control rows pair many short repeats with their baselines: this machine's speed moves by a
# third between runs seconds apart, which long repeats average into the pairing instead of cancelling.
FULL = Plan(repeats=3, steps=30, warmup=5, sweep_steps=20, sweep_warmup=3, control_short=30, control_long=180,
            control_repeats=9, per_param_short=20, per_param_long=100, control8_short=40, control8_long=200,
            control8_repeats=3, tiny_floor_steps=600, timeout=300,
            retries=2, retry_budget=12, quiet_wait_budget_s=90, patience_until_s=330)

# Step-section configurations: (key, label, how to run it).
STEP_CONFIGS: tuple[tuple[str, str], ...] = (
    ("plain", "one process (torch default threads)"),
    ("gsync_1", "gsync 1 x cpu (default threads)"),
    ("floor_t1", "floor: 2 threads x set_num_threads(1)"),
    ("floor_inherit", "floor: 2 threads, inherited threads"),
    ("gsync", "gsync 2 x cpu (default threads)"),
    ("gsync_session", "gsync 2 x cpu, session.step loop"),
    ("gsync_shared", "gsync 2 x cpu, one shared thread"),
    ("ddp", "DDP gloo, 2 procs x 1 thread"),
)


class Runner:
    """Runs measurements one at a time, each in a fresh process.

    The machine may be shared: before each measurement it waits (bounded) for the other load
    to drop, and a measurement during which other processes used more than ``NOISY_CORES``
    cores is rerun (bounded), keeping the quietest attempt. Every table shows the other load.
    """

    NOISY_CORES = NOISY_CORES

    def __init__(self, plan: Plan, env: dict[str, str] | None = None) -> None:
        self.plan = plan
        self.env = env or {}
        self.started = time.perf_counter()
        self.failures: list[str] = []
        self.retries_left = plan.retry_budget
        self.wait_left = plan.quiet_wait_budget_s

    def impatient(self) -> bool:
        """Past the plan's patience: measure once, without waiting, so the run stays bounded."""
        return time.perf_counter() - self.started > self.plan.patience_until_s

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {text}", file=sys.stderr, flush=True)

    def wait_quiet(self) -> None:
        """Wait (at most a few seconds, within the run's budget) until the machine is idle."""
        waited = 0.0
        while self.wait_left > 0 and waited < 10.0 and not self.impatient():
            before = system_busy_s()
            time.sleep(0.3)
            after = system_busy_s()
            if before is None or after is None or (after - before) / 0.3 < self.NOISY_CORES:
                break
            waited += 0.3
            self.wait_left -= 0.3
        if waited:
            self.log(f"  (waited {waited:.1f} s for other load to drop)")

    def measure(self, label: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        attempts: list[dict[str, Any]] = []
        while True:
            self.wait_quiet()
            self.log(f"{label} ...")
            try:
                result = run()
            except TaskFailed as error:
                self.failures.append(f"{label}: {error}")
                self.log(f"{label} FAILED: {str(error).splitlines()[0]}")
                break
            attempts.append(result)
            load = result.get("other_load_cores")
            if (load is None or load <= self.NOISY_CORES or self.retries_left <= 0
                    or len(attempts) > self.plan.retries or self.impatient()):
                break
            self.retries_left -= 1
            self.log(f"  noisy: other processes used {load:.2f} cores during the measurement; measuring again")
        if not attempts:
            return None
        best = min(attempts, key=lambda r: r.get("other_load_cores") or 0.0)
        best["attempts"] = len(attempts)
        return best

    def task(self, label: str, task: str, **kwargs: Any) -> dict[str, Any] | None:
        def run() -> dict[str, Any]:
            result = run_task(task, kwargs, self.plan.timeout, self.env)
            result["other_load_cores"] = other_load([result["window"]]) if "window" in result else None
            return result

        return self.measure(label, run)

    def ddp(self, label: str, steps: int, warmup: int) -> dict[str, Any] | None:
        return self.ranks(label, "ddp_rank", steps=steps, warmup=warmup, threads=1)

    def ranks(self, label: str, task: str, **kwargs: Any) -> dict[str, Any] | None:
        """2 rank processes of ``task`` (``ddp_rank``, ``gsync_rank``); the slowest rank's step times."""

        def run() -> dict[str, Any]:
            ranks = run_ranks(task, 2, kwargs, timeout=self.plan.timeout, env=self.env)
            slowest = max(ranks, key=lambda r: r["step"]["median_ms"])
            return {
                "step": slowest["step"],
                "ranks": ranks,
                "cpu_ms_per_step": sum(r.get("cpu_ms_per_step", float("nan")) for r in ranks),
                "faults_per_step": sum(r.get("faults_per_step", float("nan")) for r in ranks),
                "peak_rss_mib": sum(r["peak_rss_mib"] for r in ranks),
                "other_load_cores": other_load([r["window"] for r in ranks]),
            }

        return self.measure(label, run)

    def step_config(self, key: str, label: str, steps: int, warmup: int) -> dict[str, Any] | None:
        if key == "plain":
            return self.task(label, "plain", steps=steps, warmup=warmup)
        if key == "floor_t1":
            return self.task(label, "floor", steps=steps, warmup=warmup, threads_per_replica=1)
        if key == "floor_inherit":
            return self.task(label, "floor", steps=steps, warmup=warmup, threads_per_replica=None)
        if key == "gsync":
            return self.task(label, "gsync", steps=steps, warmup=warmup)
        if key == "gsync_1":
            return self.task(label, "gsync", steps=steps, warmup=warmup, devices=1)
        if key == "gsync_session":
            return self.task(label, "gsync", steps=steps, warmup=warmup, loop="session")
        if key == "gsync_shared":
            return self.task(label, "gsync", steps=steps, warmup=warmup, device_threads="shared")
        if key == "ddp":
            return self.ddp(label, steps, warmup)
        raise KeyError(key)


def _undisturbed(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The repeats to take statistics over (those no other process disturbed, if any), and the undisturbed ones."""
    clean = [run for run in runs if (run["other_load_cores"] or 0.0) <= NOISY_CORES]
    return clean or runs, clean


def section_step(runner: Runner, steps: int | None = None, repeats: int | None = None) -> dict[str, Any]:
    """Interleaved repeats (rotating the order) of every step configuration."""
    plan = runner.plan
    steps = steps or plan.steps
    repeats = repeats or plan.repeats
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in STEP_CONFIGS}
    for r in range(repeats):
        order = STEP_CONFIGS[r % len(STEP_CONFIGS) :] + STEP_CONFIGS[: r % len(STEP_CONFIGS)]
        for key, label in order:
            result = runner.step_config(key, f"step: {label} [{r + 1}/{repeats}]", steps, plan.warmup)
            if result is not None:
                runs[key].append(result)
                runner.log(f"  -> {result['step']['median_ms']:.1f} ms/step")
    configs: dict[str, Any] = {}
    for key, label in STEP_CONFIGS:
        if not runs[key]:
            continue
        # Statistics over the repeats no other process disturbed, if there are any.
        use, clean = _undisturbed(runs[key])
        configs[key] = {
            "label": label,
            "median_ms": median([run["step"]["median_ms"] for run in use]),
            "repeat_medians_ms": [run["step"]["median_ms"] for run in runs[key]],
            "repeat_other_load": [run["other_load_cores"] for run in runs[key]],
            "noisy": not clean,
            "cpu_ms_per_step": median([run["cpu_ms_per_step"] for run in use]),
            "faults_per_step": median([run["faults_per_step"] for run in use]),
            "other_load_cores": median([run["other_load_cores"] or 0.0 for run in use]),
            "peak_rss_mib": runs[key][0]["peak_rss_mib"],
            "runs": runs[key],
            "representative": sorted(use, key=lambda r: r["step"]["median_ms"])[(len(use) - 1) // 2],
        }
    return {"steps": steps, "warmup": plan.warmup, "repeats": repeats, "configs": configs, "ratios": report.step_ratios(configs)}


def section_memory(runner: Runner, step: dict[str, Any] | None) -> dict[str, Any]:
    """Peak RSS of each configuration's own fresh process; reuses the step section's processes
    when it ran, else runs short dedicated ones."""
    if step is None:
        step = section_step(runner, steps=3, repeats=1)
    idle = runner.task("memory: python + torch + gsync imported, nothing else", "idle")
    configs = step["configs"]
    out = {key: {"label": c["label"], "peak_rss_mib": c["peak_rss_mib"]} for key, c in configs.items()}
    if idle is not None:
        out["idle"] = {"label": "one idle process (imports only)", "peak_rss_mib": idle["peak_rss_mib"]}
    return out


def section_control(runner: Runner) -> dict[str, Any]:
    plan = runner.plan
    # Each gsync row carries its own baselines (sequential, and the design's floor), measured between its repeats.
    threads = runner.task(
        "control: 2 threads, one replica each, no sync (tiny floor)", "floor",
        steps=plan.tiny_floor_steps, warmup=20, threads_per_replica=1, workload="tiny",
    )
    default = runner.task(
        "control: gsync 2 x cpu, default buckets", "gsync_control_plane",
        short_steps=plan.control_short, long_steps=plan.control_long, repeats=plan.control_repeats,
    )
    per_param = runner.task(
        "control: gsync 2 x cpu, one bucket per parameter", "gsync_control_plane",
        short_steps=plan.per_param_short, long_steps=plan.per_param_long, repeats=plan.control_repeats,
        per_param_buckets=True,
    )
    return {"threads_no_sync": threads, "gsync_default_buckets": default, "gsync_per_param_buckets": per_param}


CONTROL8_DEVICES = 8
CONTROL8_LAYERS = 50  # x Linear(8, 8): 100 parameter tensors


def section_control8(runner: Runner) -> dict[str, Any]:
    """gsync on 8 virtual CPU devices, the tiny model of 100 tensors, one bucket and one bucket per tensor,
    against the same 8 replicas' work done sequentially in one plain thread, handed out by a loop to threads
    (the design's floor), and in 8 plain threads with no synchronization at all (what one thread per device
    costs before gsync does anything)."""
    plan = runner.plan
    common = {"devices": CONTROL8_DEVICES, "layers": CONTROL8_LAYERS, "repeats": plan.control8_repeats}
    # Each gsync row carries its own baselines (sequential, and the design's floor), measured between its repeats.
    out = {
        "threads": runner.task(
            f"control8: {CONTROL8_DEVICES} plain threads, one replica each, no sync", "floor",
            steps=plan.control8_long, warmup=10, threads_per_replica=1, replicas=CONTROL8_DEVICES, workload="tiny",
            layers=CONTROL8_LAYERS,
        ),
        "one_bucket": runner.task(
            f"control8: gsync {CONTROL8_DEVICES} x cpu, one bucket", "gsync_control_plane",
            short_steps=plan.control8_short, long_steps=plan.control8_long, bucket_mb=1024.0, **common,
        ),
        "one_bucket_per_device": runner.task(
            f"control8: gsync {CONTROL8_DEVICES} x cpu, one bucket, a thread per device", "gsync_control_plane",
            short_steps=plan.control8_short, long_steps=plan.control8_long, bucket_mb=1024.0,
            device_threads="per_device", **common,
        ),
        "per_tensor": runner.task(
            f"control8: gsync {CONTROL8_DEVICES} x cpu, one bucket per tensor", "gsync_control_plane",
            short_steps=plan.per_param_short, long_steps=plan.per_param_long, per_param_buckets=True, **common,
        ),
    }
    out["ratios"] = report.control8_ratios(out)
    return out


def _representative(step: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The step section's run of ``key`` whose median is the median over repeats (for reuse)."""
    if step is None or key not in step["configs"]:
        return None
    run = dict(step["configs"][key]["representative"])
    run["reused_from"] = "step section"
    return run


def section_sweeps(runner: Runner, bucket_caps: list[float], device_counts: list[int],
                   step: dict[str, Any] | None) -> dict[str, Any]:
    """gsync at the default configuration (2 devices, 25 MiB) is taken from the step section when it ran."""
    plan = runner.plan
    default = _representative(step, "gsync")
    buckets = {}
    for cap in bucket_caps:
        if cap == 25.0 and default is not None:
            buckets[str(cap)] = default
            continue
        result = runner.task(f"sweep: bucket_cap_mb={cap:g}, 2 devices", "gsync", devices=2, bucket_cap_mb=cap,
                             steps=plan.sweep_steps, warmup=plan.sweep_warmup)
        if result is not None:
            buckets[str(cap)] = result
            runner.log(f"  -> {result['step']['median_ms']:.1f} ms/step, {result['stats']['buckets']} buckets")
    devices = {}
    for count in device_counts:
        if count == 2 and default is not None:
            devices[str(count)] = default
            continue
        result = runner.task(f"sweep: {count} device(s), bucket_cap_mb=25", "gsync", devices=count,
                             steps=plan.sweep_steps, warmup=plan.sweep_warmup)
        if result is not None:
            devices[str(count)] = result
            runner.log(f"  -> {result['step']['median_ms']:.1f} ms/step")
    return {"bucket_cap_mb": buckets, "devices": devices}


CHECKPOINT_STEPS = 100


def section_checkpoint(runner: Runner) -> dict[str, Any]:
    """What durable checkpoints cost a step: none, every 50 steps, every step (rank 0 writes in a thread)."""
    out: dict[str, Any] = {}
    for key, every in (("none", None), ("every_50", 50), ("every_1", 1)):
        result = runner.task(f"checkpoint: gsync, checkpoint_every={every}", "gsync", steps=CHECKPOINT_STEPS,
                             warmup=runner.plan.warmup, checkpoint_every=every)
        if result is not None:
            out[key] = result
    return out


ABLATION = (
    ("fresh", "plain: zero_grad(), fresh grads"),
    ("bucket_zero", "gsync-style: bucket views, zero_ + accumulate"),
    ("bucket_copy", "DDP-style: bucket views, copy in hook"),
)


def section_ablation(runner: Runner) -> dict[str, Any]:
    """The 2-replica floor (no sync at all) with gsync's way of holding gradients, to separate
    the cost of persistent bucket-view gradients from the cost of synchronizing them."""
    plan = runner.plan
    repeats = plan.repeats
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in ABLATION}
    for r in range(repeats):
        for key, label in ABLATION[r % 3 :] + ABLATION[: r % 3]:
            result = runner.task(f"ablation: floor, {label} [{r + 1}/{repeats}]", "floor", steps=plan.steps,
                                 warmup=plan.warmup, threads_per_replica=1, grads=key)
            if result is not None:
                runs[key].append(result)
                runner.log(f"  -> {result['step']['median_ms']:.1f} ms/step")
    out = {}
    for key, label in ABLATION:
        if runs[key]:
            use, clean = _undisturbed(runs[key])
            out[key] = {
                "label": label,
                "median_ms": median([run["step"]["median_ms"] for run in use]),
                "repeat_medians_ms": [run["step"]["median_ms"] for run in runs[key]],
                "phase_mean_us": {
                    name: median([run["phase_mean_us"][name] for run in use]) for name in use[0]["phase_mean_us"]
                },
                "faults_per_step": median([run["faults_per_step"] for run in use]),
                "other_load_cores": median([run["other_load_cores"] or 0.0 for run in use]),
                "runs": runs[key],
            }
    return out


COMPRESSION = (
    ("gsync", "gsync, 2 processes", "gsync_rank", {}),
    ("gsync_bf16", "gsync, 2 processes, compression='bf16'", "gsync_rank", {"compression": "bf16"}),
    ("ddp", "DDP, 2 processes", "ddp_rank", {}),
    ("ddp_bf16", "DDP, 2 processes, bf16_compress_hook", "ddp_rank", {"comm_hook": "bf16"}),
)


def section_compression(runner: Runner, configs: tuple[tuple[str, str, str, dict[str, Any]], ...] = COMPRESSION,
                        name: str = "compression") -> dict[str, Any]:
    """Interleaved repeats of gsync and DDP across 2 processes, each with and without bf16 compression
    (``configs``: a subset of ``COMPRESSION``)."""
    plan = runner.plan
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, *_ in configs}
    n = len(configs)
    for r in range(plan.repeats):
        for key, label, task, kwargs in configs[r % n :] + configs[: r % n]:
            result = runner.ranks(f"{name}: {label} [{r + 1}/{plan.repeats}]", task, steps=plan.steps,
                                  warmup=plan.warmup, threads=1, **kwargs)
            if result is not None:
                runs[key].append(result)
                runner.log(f"  -> {result['step']['median_ms']:.1f} ms/step")
    out: dict[str, Any] = {}
    for key, label, _, _ in configs:
        if runs[key]:
            use, clean = _undisturbed(runs[key])
            out[key] = {
                "label": label,
                "median_ms": median([run["step"]["median_ms"] for run in use]),
                "repeat_medians_ms": [run["step"]["median_ms"] for run in runs[key]],
                "other_load_cores": median([run["other_load_cores"] or 0.0 for run in use]),
                "noisy": not clean,
                "reduced_bytes_per_step": runs[key][0]["ranks"][0].get("reduced_bytes_per_step"),
                "runs": runs[key],
            }
    return out


def environment() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "git_commit": git("rev-parse", "HEAD").strip(),
        "gsync_dirty_files": [line[3:] for line in git("status", "--porcelain", "gsync").splitlines()],
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "noisy_threshold_cores": Runner.NOISY_CORES,
        "argv": sys.argv,
    }
    try:
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", "import torch; print(torch.__version__, torch.get_num_threads())"],
                             capture_output=True, text=True, timeout=60).stdout.split()
        info["torch"], info["torch_default_threads"] = out[0], int(out[1])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return info


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through isolate's cleanup: no worker is left behind


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and one repeat (~2 min on 2 cores)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but "
                                         f"multiprocess; --quick: {','.join(QUICK_DEFAULT)})")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "latest.json"),
                        help="JSON output path; the PNG goes next to it (default bench/results/latest.json)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats of the step section")
    parser.add_argument("--steps", type=int, help="measured steps per step-section run")
    parser.add_argument("--bucket-caps", default="1,5,25,100", help="bucket_cap_mb values of the sweep")
    parser.add_argument("--device-counts", default="1,2,3,4", help="device counts of the sweep")
    parser.add_argument("--timeout", type=float, help="seconds each measurement process may run")
    parser.add_argument("--retries", type=int, help="reruns of a measurement disturbed by other load (0: never)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for every measurement process (repeatable), e.g. "
                             "MALLOC_TRIM_THRESHOLD_=-1 or OMP_NUM_THREADS=1")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)

    only = args.only or ",".join(QUICK_DEFAULT if args.quick else FULL_DEFAULT)
    sections = [s.strip() for s in only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    plan = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("repeats", args.repeats), ("steps", args.steps), ("timeout", args.timeout),
                                                 ("retries", args.retries)) if v is not None}
    plan = Plan(**{**plan.__dict__, **overrides})
    child_env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env takes KEY=VALUE, got {item!r}")
        child_env[key] = value
    runner = Runner(plan, child_env)
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "plan": plan.__dict__, "env": environment()}
    results["env"]["child_env"] = child_env
    report.print_header(results)

    step = None
    if "step" in sections:
        step = results["step"] = section_step(runner)
        report.print_step(step)
    if "memory" in sections:
        results["memory"] = section_memory(runner, step)
        report.print_memory(results["memory"])
    if "control" in sections:
        results["control"] = section_control(runner)
        report.print_control(results["control"])
    if "control8" in sections:
        results["control8"] = section_control8(runner)
        report.print_control8(results["control8"])
    if "sweeps" in sections:
        caps = [float(c) for c in args.bucket_caps.split(",")]
        counts = [int(c) for c in args.device_counts.split(",")]
        results["sweeps"] = section_sweeps(runner, caps, counts, step)
        report.print_sweeps(results["sweeps"])

    if "checkpoint" in sections:
        results["checkpoint"] = section_checkpoint(runner)
        report.print_checkpoint(results["checkpoint"])

    if "ablation" in sections:
        results["ablation"] = section_ablation(runner)
        report.print_ablation(results["ablation"])

    if "compression" in sections:
        results["compression"] = section_compression(runner)
        report.print_compression(results["compression"])
    if "multiprocess" in sections and "compression" not in sections:
        results["multiprocess"] = section_compression(
            runner, tuple(c for c in COMPRESSION if c[0] in ("gsync", "ddp")), "multiprocess")
        report.print_compression(results["multiprocess"])

    results["env"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    results["elapsed_s"] = time.perf_counter() - runner.started
    results["failures"] = runner.failures
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"\nresults: {args.out}")
    if not args.no_plot and "sweeps" in results:
        report.plot(results["sweeps"], os.path.splitext(args.out)[0] + ".png", results.get("step"))
    if runner.failures:
        print(f"\n{len(runner.failures)} measurement(s) failed:")
        for failure in runner.failures:
            print("  " + failure.replace("\n", "\n    "))
    print(f"total {results['elapsed_s']:.0f} s")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
