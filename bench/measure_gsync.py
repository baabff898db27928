"""gsync measurements: reference step time (with trace analysis), control-plane cost, and
one rank of gsync across processes. Each function runs in a fresh worker process."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from typing import Any

import torch

import gsync

from . import baselines
from .analysis import summarize_trace
from .common import Window, median, minor_faults, os_threads, summarize_ms
from .workloads import (
    TINY_LAYERS,
    loss_fn,
    make_batches,
    make_mlp,
    make_tiny,
    make_tiny_batches,
    sgd,
    tiny_loss,
)


def _devices(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


class _ThreadProbe:
    """Records, per OS thread, ``torch.get_num_threads()`` as seen by that thread, and the
    most OS threads the process had."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.max_os_threads = 0
        self.samples: list[tuple[float, int]] = []
        """(process CPU seconds, minor faults) at each forward of the first replica seen: once per step,
        whichever thread runs it (devices may share one)."""
        self._first: int | None = None
        self._lock = threading.Lock()

    def restart(self) -> None:
        """Forget the samples so far: the next fit builds new replicas."""
        with self._lock:
            self.samples.clear()
            self._first = None

    def observe(self, replica: torch.nn.Module) -> None:
        name = threading.current_thread().name
        if name not in self.seen:
            with self._lock:
                self.seen[name] = torch.get_num_threads()
        with self._lock:
            if self._first is None:
                self._first = id(replica)
        if id(replica) == self._first:
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
    loop: str = "fit",
    checkpoint_every: int | None = None,
    device_threads: str = "auto",
) -> dict[str, Any]:
    """(c) gsync on ``devices`` virtual CPU devices, reference workload.

    ``loop`` is ``"fit"`` or ``"session"`` (a plain ``for`` loop awaiting
    ``session.step`` per batch, as a user's own loop would). With
    ``checkpoint_every`` the measured fit writes checkpoints into a temporary
    directory every that many steps (and at the end).

    A first fit of ``warmup`` steps warms the process (allocator, OpenMP pools); a second,
    traced fit of ``steps`` steps is measured. Step time = period between consecutive
    optimizer ends in the trace (the first period of the fit dropped).

    ``device_threads``: ``gsync.Engine``'s setting.
    """
    probe = _ThreadProbe()
    comm_threads: dict[str, int] = {}

    # Instrumentation only, in this worker process only: which torch thread count the
    # communication thread runs the in-process reduction with (a wrapper around
    # LocalCollective.all_reduce_each, which its all_reduce also goes through; removed after the fit).
    collective_cls = getattr(sys.modules.get("gsync.comm.local"), "LocalCollective", None)
    original = getattr(collective_cls, "all_reduce_each", None)
    if original is not None:

        def probed_all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
            comm_threads.setdefault(threading.current_thread().name, torch.get_num_threads())
            return original(self, *args, **kwargs)

        collective_cls.all_reduce_each = probed_all_reduce  # type: ignore[union-attr]

    def probed_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        probe.observe(model)
        return loss_fn(model, batch)

    model = make_mlp()
    engine = gsync.Engine(
        _devices(devices), bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, trace=True,
        device_threads=device_threads,  # type: ignore[arg-type]
    )
    await engine.fit(model, make_batches(warmup), optimizer=sgd, loss_fn=probed_loss)
    data = make_batches(steps)
    probe.restart()
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
        collective_cls.all_reduce_each = original  # type: ignore[union-attr]
    assert trace is not None
    summary = summarize_trace(trace.events, shared_thread=engine.device_threads == "shared")
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


class _LoopCounter:
    """Counts, on the running asyncio loop, callbacks scheduled from other threads
    (``call_soon_threadsafe``: gsync's threads reporting back), loop iterations (selector
    polls) and wake-ups (polls that could block: the loop slept until a thread or a timer
    woke it). Instrumentation of this worker process only: it wraps the loop's
    ``call_soon_threadsafe`` and its selector's ``select`` (CPython's selector event loop),
    so it must be installed before the session that should use it binds the loop."""

    def __init__(self) -> None:
        self.posts = self.polls = self.wakeups = 0
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted_call_soon_threadsafe(*args: Any, **kwargs: Any) -> Any:
            self.posts += 1  # from several threads: may undercount by a hair (no lock, as intended: no new contention)
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted_call_soon_threadsafe  # type: ignore[method-assign]
        selector = getattr(loop, "_selector", None)
        if selector is not None:
            select = selector.select

            def counted_select(timeout: float | None = None) -> Any:
                self.polls += 1
                if timeout is None or timeout > 0:
                    self.wakeups += 1
                return select(timeout)

            selector.select = counted_select

    def read(self) -> tuple[int, int, int]:
        return self.posts, self.polls, self.wakeups


async def gsync_control_plane(
    short_steps: int,
    long_steps: int,
    repeats: int = 3,
    per_param_buckets: bool = False,
    devices: int = 2,
    layers: int = TINY_LAYERS,
    bucket_mb: float | None = None,
    device_threads: str = "auto",
) -> dict[str, Any]:
    """Time per step of gsync on the tiny model (``layers`` x Linear(8, 8)), without trace, against
    the same replicas' work done sequentially in one plain thread and handed out by a loop to threads
    (the design's floor), both measured between gsync's repeats.

    Per-step figures = (long fit - short fit) / (long - short), so the fixed cost of a fit
    (replicas, threads, teardown) cancels; the median over ``repeats`` pairs is kept. Taken
    so: wall time; the event-loop thread's CPU time (this coroutine runs on that thread);
    thread posts, loop iterations and loop wake-ups (:class:`_LoopCounter`).
    ``per_param_buckets`` gives every parameter its own bucket (the worst case for
    per-message costs); ``bucket_mb`` sets both bucket caps (a large value: one bucket).
    ``device_threads``: ``gsync.Engine``'s setting.

    Two baselines run before the first repeat and after each, in this process: the sequential
    loop (:func:`bench.baselines.sequential`) and the same jobs handed out by an asyncio loop to
    two plain threads (:func:`bench.baselines.handoff_floor`, the design's floor). Each repeat is
    compared with the mean of the two runs of a baseline around it; ``ratio_to_sequential``,
    ``minus_sequential_us_per_step``, ``ratio_to_handoff`` and ``handoff_ratio_to_sequential``
    are medians over repeats. The machine's speed drifts by tens of percent over minutes; a
    baseline measured in another process minutes away compares with gsync no better than that.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    counter = _LoopCounter()
    model = make_tiny(layers)
    cap, first = (25.0, 1.0) if bucket_mb is None else (bucket_mb, bucket_mb)
    if per_param_buckets:
        cap = first = 1e-9
    engine = gsync.Engine(_devices(devices), bucket_cap_mb=cap, first_bucket_mb=first, device_threads=device_threads)  # type: ignore[arg-type]
    await engine.fit(model, make_tiny_batches(20), optimizer=sgd, loss_fn=tiny_loss)  # warm-up
    short_data, long_data = make_tiny_batches(short_steps), make_tiny_batches(long_steps)
    per_step: dict[str, list[float]] = {"wall": [], "loop_cpu": [], "posts": [], "polls": [], "wakeups": []}
    fixed: list[float] = []
    stats: Any = None
    window = Window()
    extra_steps = long_steps - short_steps

    def sample() -> tuple[float, ...]:
        return (time.perf_counter(), time.thread_time(), *counter.read())

    handoff_loop_cpu: list[float] = []

    async def baselines_us(handoff_first: bool) -> tuple[float, float]:
        """Both baselines' us/step; which runs first alternates, so that over the repeats neither sits
        systematically earlier than gsync's runs (the machine drifts)."""

        async def handed_out() -> float:
            result = await baselines.handoff_floor(steps=extra_steps, warmup=10, replicas=devices, layers=layers,
                                                   device_threads=engine.device_threads)
            handoff_loop_cpu.append(result["loop_cpu_us_per_step"])
            return float(result["us_per_step"])

        if handoff_first:
            handoff_us = await handed_out()
        by_hand = float(baselines.sequential(steps=extra_steps, warmup=10, replicas=devices, layers=layers)["us_per_step"])
        if not handoff_first:
            handoff_us = await handed_out()
        return by_hand, handoff_us

    by_hand, handed_out = await baselines_us(handoff_first=False)
    sequential, handoff = [by_hand], [handed_out]
    for repeat in range(repeats):
        # Whatever the baseline left cold (allocator, caches) is paid here, not by the short fit alone.
        await engine.fit(model, make_tiny_batches(20), optimizer=sgd, loss_fn=tiny_loss)
        s0 = sample()
        await engine.fit(model, short_data, optimizer=sgd, loss_fn=tiny_loss)
        s1 = sample()
        result = await engine.fit(model, long_data, optimizer=sgd, loss_fn=tiny_loss)
        s2 = sample()
        for key, a, b, c in zip(per_step, s0, s1, s2):
            per_step[key].append(((c - b) - (b - a)) / extra_steps)
        fixed.append((s1[0] - s0[0]) - short_steps * per_step["wall"][-1])
        stats = result.stats
        by_hand, handed_out = await baselines_us(handoff_first=repeat % 2 == 0)
        sequential.append(by_hand)
        handoff.append(handed_out)
    win = window.stop()
    mid = {key: median(values) for key, values in per_step.items()}
    walls_us = [s * 1e6 for s in per_step["wall"]]
    around = [(before + after) / 2 for before, after in zip(sequential, sequential[1:])]
    paired = [wall / baseline for wall, baseline in zip(walls_us, around)]
    handoff_around = [(before + after) / 2 for before, after in zip(handoff, handoff[1:])]
    over_handoff = [wall / baseline for wall, baseline in zip(walls_us, handoff_around)]
    handoff_over_sequential = [h / s for h, s in zip(handoff_around, around)]
    return {
        "window": win,
        "us_per_step": mid["wall"] * 1e6,
        "all_us_per_step": walls_us,
        "sequential_us_per_step": median(sequential),
        "all_sequential_us_per_step": sequential,
        "ratio_to_sequential": median(paired),
        "all_ratios_to_sequential": paired,
        "minus_sequential_us_per_step": median([wall - baseline for wall, baseline in zip(walls_us, around)]),
        "handoff_us_per_step": median(handoff),
        "all_handoff_us_per_step": handoff,
        "ratio_to_handoff": median(over_handoff),
        "all_ratios_to_handoff": over_handoff,
        "all_handoff_ratios_to_sequential": handoff_over_sequential,
        "handoff_ratio_to_sequential": median(handoff_over_sequential),
        "handoff_loop_cpu_us_per_step": median(handoff_loop_cpu),
        "loop_cpu_us_per_step": mid["loop_cpu"] * 1e6,
        "thread_posts_per_step": mid["posts"],
        "loop_iterations_per_step": mid["polls"],
        "loop_wakeups_per_step": mid["wakeups"],
        "fixed_ms_per_fit": median(fixed) * 1e3,
        "buckets": stats.buckets,
        "devices": devices,
        "device_threads": engine.device_threads,
        "messages_per_step": stats.bucket_ready_messages / stats.steps,
        "params": sum(1 for _ in model.parameters()),
    }


def gsync_rank(rank: int, world_size: int, port: int, steps: int, warmup: int, threads: int = 1,
               compression: str | None = None) -> dict[str, Any]:
    """One rank of gsync over torch.distributed (gloo), one CPU device per process; every rank
    reads the same global batches. Step time: the period between optimizer ends in the trace.

    ``compression``: ``Engine(compression=...)``, e.g. ``"bf16"``.
    """
    torch.set_num_threads(threads)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size)}
    )

    async def fits() -> tuple[list[float], dict[str, Any], int]:
        model = make_mlp()
        await gsync.Engine(["cpu"], compression=compression).fit(model, make_batches(warmup), optimizer=sgd, loss_fn=loss_fn)
        window = Window()
        result = await gsync.Engine(["cpu"], trace=True, compression=compression).fit(
            model, make_batches(steps), optimizer=sgd, loss_fn=loss_fn
        )
        win = window.stop()
        assert result.trace is not None
        ends = sorted(e.end_us for e in result.trace.select("optimizer"))
        return [(b - a) / 1e3 for a, b in zip(ends[1:], ends[2:])], win, result.stats.reduced_bytes

    periods, win, reduced_bytes = asyncio.run(fits())
    return {"rank": rank, "step_ms": median(periods), "step": summarize_ms([p / 1e3 for p in periods]),
            "window": win, "reduced_bytes_per_step": reduced_bytes / steps}


def idle() -> dict[str, Any]:
    """Peak RSS of a process that only imported torch and gsync (the per-process floor)."""
    return {"torch_threads": torch.get_num_threads(), "gsync": gsync.__name__}
