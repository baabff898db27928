"""What logging every step costs: a fit with gsync's CSVLogger and TensorBoardLogger against the same fit without.

    python bench/logging_overhead.py [--steps 30] [--repeats 3]

The reference MLP (784-2048-2048-2048-10, batch 256, SGD) on two virtual CPU
devices, with ``trace=True`` so the logged metrics include the exposed
communication (the most a step's logging does). Two numbers:

- **direct**: the wall time spent in the session's monitor each step (the
  metrics built, both loggers called: CSV row written and flushed,
  TensorBoard scalars queued), timed around it, over the median step time.
  This is what logging adds to a step, and it does not depend on the noise
  of the machine.
- **end to end**: the median step time of fits with and without the loggers,
  alternated repeat by repeat. On a shared 2-core machine its spread is
  larger than the goal (1 %), so it shows only that nothing is far off.

The first step of each fit (torch's first calls) is left out. Benchmarks
print; they never assert timings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path (never tests/), as -m puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import quiet_warnings  # noqa: E402
from bench.workloads import loss_fn, make_batches, make_mlp, sgd  # noqa: E402

import gsync  # noqa: E402
from gsync._core.monitoring.monitor import SessionMonitor  # noqa: E402
from gsync.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

_in_monitor: list[float] = []


def _timed_stepped() -> None:
    """Time each call of the monitor's per-step work (a bench's instrument, not a change to gsync)."""
    stepped = SessionMonitor.stepped

    def timed(self: SessionMonitor, result: Any) -> None:
        start = time.perf_counter()
        stepped(self, result)
        _in_monitor.append(time.perf_counter() - start)

    SessionMonitor.stepped = timed  # type: ignore[method-assign]


async def one_fit(steps: int, directory: Path | None) -> list[float]:
    engine = gsync.Engine(["cpu:0", "cpu:1"], trace=True)
    loggers = [CSVLogger(directory / "csv"), TensorBoardLogger(directory / "tb")] if directory is not None else []
    result = await engine.fit(
        make_mlp(), make_batches(steps), optimizer=sgd, loss_fn=loss_fn, loggers=loggers, progress=False
    )
    return [record.seconds for record in result.history[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quiet_warnings()
    _timed_stepped()
    plain: list[float] = []
    logged: list[float] = []
    per_repeat: list[tuple[float, float]] = []
    monitor: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            without = asyncio.run(one_fit(args.steps, None))
            _in_monitor.clear()
            with_loggers = asyncio.run(one_fit(args.steps, Path(scratch) / str(repeat)))
            plain += without
            logged += with_loggers
            per_repeat.append((statistics.median(without), statistics.median(with_loggers)))
            monitor += _in_monitor[1:]  # the first step's call includes its first-time costs, as the step does
    step = statistics.median(plain)
    spent = statistics.median(monitor)
    print(f"reference MLP, 2 CPU devices, {args.steps} steps x {args.repeats} repeats, {os.cpu_count()} cores")
    print(f"  median step, no loggers          {step * 1e3:9.2f} ms")
    print(f"  median step, CSV + TensorBoard   {statistics.median(logged) * 1e3:9.2f} ms")
    print("  per repeat (ms, without / with)  "
          + ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in per_repeat))
    print(f"  monitor per step, median         {spent * 1e6:9.1f} us  (max {max(monitor) * 1e6:.1f} us)")
    print(f"  direct overhead                  {spent / step * 100:9.3f} % of a step")
    print(f"  end to end (median with/without) {(statistics.median(logged) / step - 1) * 100:+9.2f} %")


if __name__ == "__main__":
    main()
