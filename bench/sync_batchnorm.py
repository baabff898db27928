"""What nn.SyncBatchNorm costs per step in gsync, against plain BatchNorm (per-shard statistics), side by side.

    python bench/sync_batchnorm.py [--steps 20] [--repeats 3] [--no-processes]

A small conv net (3 conv + BatchNorm2d + ReLU layers, 16x16 inputs, global
batch 64, SGD) trains through ``session.step`` on two virtual CPU devices in
this process, and then on 2 processes x 1 device over gloo (started by the
tests' own harness), once with plain ``nn.BatchNorm2d`` and once converted
with ``nn.SyncBatchNorm.convert_sync_batchnorm``, alternated per repeat so
drift on the machine falls on both alike. The statistic is the median wall
time per step (each session's first step left out); the ratio is
SyncBatchNorm / BatchNorm. SyncBatchNorm adds, per layer and step, a
rendezvous of the devices in forward and one in backward and, across
processes, a small all-reduce on a gloo group of its own for each.
torch DDP's SyncBatchNorm needs CUDA tensors, so it has no CPU row here.
Benchmarks print; they never assert timings.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path (never tests/), as -m puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import quiet_warnings  # noqa: E402

quiet_warnings()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import gsync  # noqa: E402

ROWS = 64


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def make_batches(steps: int, rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 3, 16, 16, generator=generator), torch.randint(0, 10, (rows,), generator=generator)) for _ in range(steps)]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def variant(name: str) -> nn.Module:
    model = make_net()
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if name == "SyncBatchNorm" else model


async def timed_session(engine: gsync.Engine, model: nn.Module, batches: list[Any], **kwargs: Any) -> list[float]:
    times = []
    async with engine.session(model, optimizer=sgd, loss_fn=loss_fn, **kwargs) as session:
        for batch in batches:
            started = time.perf_counter()
            await session.step(batch)
            times.append(time.perf_counter() - started)
    return times[1:]


async def in_process(steps: int, repeats: int) -> dict[str, list[float]]:
    batches = make_batches(steps)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    times: dict[str, list[float]] = {"BatchNorm": [], "SyncBatchNorm": []}
    for _ in range(repeats):
        for name in times:
            times[name] += await timed_session(engine, variant(name), batches)
    return times


def rank_times(steps: int, repeats: int) -> dict[str, list[float]]:
    """One rank of 2 (process-local halves of each batch): both variants, alternated."""
    rank = int(os.environ["RANK"])
    batches = [(x[rank * ROWS // 2 : (rank + 1) * ROWS // 2], y[rank * ROWS // 2 : (rank + 1) * ROWS // 2]) for x, y in make_batches(steps)]
    engine = gsync.Engine(["cpu"], sync_timeout=60)
    times: dict[str, list[float]] = {"BatchNorm": [], "SyncBatchNorm": []}

    async def run() -> None:
        for _ in range(repeats):
            for name in times:
                times[name] += await timed_session(engine, variant(name), copy.deepcopy(batches), process_local_data=True)

    asyncio.run(run())
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    plain = statistics.median(times["BatchNorm"])
    print(f"== {title} ==")
    print(f"  {'layers':16} {'ms/step (median)':>17} {'vs BatchNorm':>13}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:16} {median * 1e3:17.2f} {median / plain:13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-processes", action="store_true", help="only the in-process comparison")
    args = parser.parse_args()
    steps = args.steps + 1
    label = f"{args.steps} steps x {args.repeats} repeats each, conv net (3 BatchNorm2d), global batch {ROWS}"
    report(f"2 x cpu in one process: {label}", asyncio.run(in_process(steps, args.repeats)))
    if not args.no_processes:
        from bench.sync_batchnorm import rank_times as ranks_fn  # by its module name: a rank must not run main()
        from tests.support.harness import run_ranks

        results = run_ranks(ranks_fn, 2, args=(steps, args.repeats), timeout=600, check=True)
        report(f"2 processes x 1 cpu over gloo (rank 0): {label}", results[0].value)
    print("  torch DDP with SyncBatchNorm: not measured (its SyncBatchNorm needs CUDA tensors)")


if __name__ == "__main__":
    main()
