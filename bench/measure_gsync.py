"""gsync measurements: reference step time (with trace analysis), control-plane cost,
and the torch-threads experiment. Each function runs in a fresh worker process."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any

import torch

import gsync

from .analysis import summarize_trace
from .common import Window, minor_faults, os_threads, summarize_ms
from .workloads import loss_fn, make_batches, make_mlp, make_tiny, make_tiny_batches, sgd, tiny_loss


def _devices(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


class _ThreadProbe:
    """Records, per OS thread, ``torch.get_num_threads()`` as seen by that thread, and the
    most OS threads the process had; optionally sets the thread count once per thread."""

    def __init__(self, set_threads: int | None = None) -> None:
        self.set_threads = set_threads
        self.seen: dict[str, int] = {}
        self.max_os_threads = 0
        self.samples: list[tuple[float, int]] = []
        """(process CPU seconds, minor faults) at each forward of the first device seen."""
        self._first: str | None = None
        self._lock = threading.Lock()

    def observe(self) -> None:
        name = threading.current_thread().name
        if name not in self.seen:
            if self.set_threads is not None:
                torch.set_num_threads(self.set_threads)
            with self._lock:
                self.seen[name] = torch.get_num_threads()
                if self._first is None:
                    self._first = name
        if name == self._first:
            self.samples.append((time.process_time(), minor_faults()))
        self.max_os_threads = max(self.max_os_threads, os_threads() or 0)

    def steady_state(self, skip: int = 1) -> tuple[float | None, float | None]:
        """CPU ms and minor page faults per step between the forwards of step ``skip`` and
        the last step (the fit's setup and teardown excluded)."""
        samples = self.samples[skip:]
        if len(samples) < 2:
            return None, None
        steps = len(samples) - 1
        return ((samples[-1][0] - samples[0][0]) * 1e3 / steps, (samples[-1][1] - samples[0][1]) / steps)


async def gsync_steps(
    devices: int = 2,
    steps: int = 30,
    warmup: int = 5,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    threads: int | None = None,
    threads_mode: str = "main",
    loop: str = "fit",
    checkpoint_every: int | None = None,
) -> dict[str, Any]:
    """(c) gsync on ``devices`` virtual CPU devices, reference workload.

    ``loop`` is ``"fit"`` or ``"session"`` (a plain ``for`` loop awaiting
    ``session.step`` per batch, as a user's own loop would). With
    ``checkpoint_every`` the measured fit writes checkpoints into a temporary
    directory every that many steps (and at the end).

    A first fit of ``warmup`` steps warms the process (allocator, OpenMP pools); a second,
    traced fit of ``steps`` steps is measured. Step time = period between consecutive
    optimizer ends in the trace (the first period of the fit dropped).

    ``threads``: torch intra-op threads; ``threads_mode`` "main" calls
    ``torch.set_num_threads`` in the main thread before the fit (worker threads pick the
    value up when they first run an op), "in_thread" calls it inside ``loss_fn`` once per
    worker thread.
    """
    probe = _ThreadProbe(threads if threads_mode == "in_thread" else None)
    comm_threads: dict[str, int] = {}
    if threads is not None and threads_mode == "main":
        torch.set_num_threads(threads)

    # Instrumentation only, in this worker process only: which torch thread count the
    # communication thread runs the in-process reduction with (a wrapper around
    # LocalCollective.all_reduce, removed after the fit).
    collective_cls = getattr(sys.modules.get("gsync.comm.local"), "LocalCollective", None)
    original = getattr(collective_cls, "all_reduce", None)
    if original is not None:

        def probed_all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
            comm_threads.setdefault(threading.current_thread().name, torch.get_num_threads())
            return original(self, *args, **kwargs)

        collective_cls.all_reduce = probed_all_reduce  # type: ignore[union-attr]

    def probed_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        probe.observe()
        return loss_fn(model, batch)

    model = make_mlp()
    engine = gsync.Engine(_devices(devices), bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, trace=True)
    await engine.fit(model, make_batches(warmup), optimizer=sgd, loss_fn=probed_loss)
    data = make_batches(steps)
    probe.samples.clear()
    window = Window()
    sizes: list[int] = []
    started = time.perf_counter()
    if loop == "session":
        async with engine.session(model, optimizer=sgd, loss_fn=probed_loss) as session:
            for batch in data:
                await session.step(batch)
            trace, stats = session.trace, session.stats
    else:
        with tempfile.TemporaryDirectory(prefix="gsync-bench-ckpt-") as directory:
            extra: dict[str, Any] = {} if checkpoint_every is None else {"checkpoint_dir": directory, "checkpoint_every": checkpoint_every}
            result = await engine.fit(model, data, optimizer=sgd, loss_fn=probed_loss, **extra)
            sizes = [os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)]
        trace, stats = result.trace, result.stats
    wall = time.perf_counter() - started
    win = window.stop()
    if original is not None:
        collective_cls.all_reduce = original  # type: ignore[union-attr]
    assert trace is not None
    summary = summarize_trace(trace.events)
    periods = summary["step_periods_us"]
    cpu_per_step, faults_per_step = probe.steady_state()
    return {
        "devices": devices,
        "checkpoint_every": checkpoint_every,
        "checkpoint_mib": max(sizes) / 2**20 if sizes else None,
        "bucket_cap_mb": bucket_cap_mb,
        "step": summarize_ms([p / 1e6 for p in periods]),
        "wall_ms_per_step_incl_fit_setup": wall * 1e3 / steps,
        "window": win,
        "cpu_ms_per_step": cpu_per_step,
        "faults_per_step": faults_per_step,
        "stats": {
            "steps": stats.steps,
            "buckets": stats.buckets,
            "bucket_sizes_mib": [round(b / 2**20, 3) for b in stats.bucket_sizes],
            "bucket_ready_messages_per_step": stats.bucket_ready_messages / max(stats.steps, 1),
        },
        "torch_threads_seen": {"workers": probe.seen, "comm": comm_threads, "main": torch.get_num_threads()},
        "max_os_threads": probe.max_os_threads,
        **summary,
    }


async def gsync_control_plane(
    short_steps: int,
    long_steps: int,
    repeats: int = 3,
    per_param_buckets: bool = False,
    devices: int = 2,
) -> dict[str, Any]:
    """Time per step of gsync on the tiny 200-tensor model, without trace.

    Per-step time = (wall(long fit) - wall(short fit)) / (long - short), so the fixed cost of
    a fit (replicas, threads, teardown) cancels; the median over ``repeats`` pairs is kept.
    ``per_param_buckets`` gives every parameter its own bucket (200 buckets: the worst case
    for per-message costs).
    """
    model = make_tiny()
    cap = 1e-9 if per_param_buckets else 25.0
    first = 1e-9 if per_param_buckets else 1.0
    engine = gsync.Engine(_devices(devices), bucket_cap_mb=cap, first_bucket_mb=first)
    await engine.fit(model, make_tiny_batches(20), optimizer=sgd, loss_fn=tiny_loss)  # warm-up
    short_data, long_data = make_tiny_batches(short_steps), make_tiny_batches(long_steps)
    per_step: list[float] = []
    loop_cpu: list[float] = []
    fixed: list[float] = []
    stats = None
    window = Window()
    for _ in range(repeats):
        # Wall time and the event-loop thread's own CPU time (this thread runs the loop).
        t0, c0 = time.perf_counter(), time.thread_time()
        await engine.fit(model, short_data, optimizer=sgd, loss_fn=tiny_loss)
        t1, c1 = time.perf_counter(), time.thread_time()
        result = await engine.fit(model, long_data, optimizer=sgd, loss_fn=tiny_loss)
        t2, c2 = time.perf_counter(), time.thread_time()
        per_step.append(((t2 - t1) - (t1 - t0)) / (long_steps - short_steps))
        loop_cpu.append(((c2 - c1) - (c1 - c0)) / (long_steps - short_steps))
        fixed.append((t1 - t0) - short_steps * per_step[-1])
        stats = result.stats
    win = window.stop()
    assert stats is not None
    per_step.sort()
    loop_cpu.sort()
    fixed.sort()
    return {
        "window": win,
        "us_per_step": per_step[len(per_step) // 2] * 1e6,
        "all_us_per_step": [s * 1e6 for s in per_step],
        "loop_cpu_us_per_step": loop_cpu[len(loop_cpu) // 2] * 1e6,
        "fixed_ms_per_fit": fixed[len(fixed) // 2] * 1e3,
        "buckets": stats.buckets,
        "devices": devices,
        "messages_per_step": stats.bucket_ready_messages / stats.steps,
        "params": sum(1 for _ in model.parameters()),
    }


def idle() -> dict[str, Any]:
    """Peak RSS of a process that only imported torch and gsync (the per-process floor)."""
    return {"torch_threads": torch.get_num_threads(), "gsync": gsync.__name__}
