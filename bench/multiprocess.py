"""gsync across processes (torch.distributed, gloo) against torch DDP on the same ranks.

    .venv/bin/python bench/multiprocess.py [--steps 30] [--warmup 5] [--repeats 3]

Each configuration is 2 fresh rank processes with 1 torch thread each, on the
reference MLP at global batch 256: torch DDP, and gsync with one CPU device
per process (``Engine(["cpu"])`` under torchrun-style environment variables).
Step time is the median per-step wall time of rank 0 after warm-up; gsync's is
the period between consecutive optimizer ends in its trace, as in run.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.isolate import free_port, run_ddp, run_group  # noqa: E402


def gsync_rank(rank: int, world_size: int, port: int, steps: int, warmup: int, threads: int = 1) -> dict[str, Any]:
    """One rank of gsync over torch.distributed (gloo); every rank reads the same global batches."""
    import torch

    import gsync
    from bench.workloads import loss_fn, make_batches, make_mlp, sgd

    torch.set_num_threads(threads)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size)}
    )

    async def fits() -> list[float]:
        model = make_mlp()
        await gsync.Engine(["cpu"]).fit(model, make_batches(warmup), optimizer=sgd, loss_fn=loss_fn)
        result = await gsync.Engine(["cpu"], trace=True).fit(model, make_batches(steps), optimizer=sgd, loss_fn=loss_fn)
        assert result.trace is not None
        ends = sorted(e.end_us for e in result.trace.select("optimizer"))
        return [(b - a) / 1e3 for a, b in zip(ends[1:], ends[2:])]

    periods = asyncio.run(fits())
    return {"rank": rank, "step_ms": statistics.median(periods)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gsync_ms, ddp_ms = [], []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        port = free_port()
        tasks = [("gsync_rank", {"rank": r, "world_size": 2, "port": port, "steps": args.steps, "warmup": args.warmup}) for r in range(2)]
        gsync_ms.append(run_group(tasks, timeout=300)[0]["step_ms"])
        ddp = run_ddp(2, args.steps, args.warmup, threads=1, timeout=300)
        ddp_ms.append(ddp[0]["step"]["median_ms"])
        print(f"[{time.perf_counter() - started:6.1f} s] repeat {repeat + 1}: gsync {gsync_ms[-1]:.1f} ms/step, DDP {ddp_ms[-1]:.1f} ms/step")
    gsync_median, ddp_median = statistics.median(gsync_ms), statistics.median(ddp_ms)
    print("\n== gsync across 2 processes vs torch DDP (gloo, 2 processes x 1 thread), reference MLP, batch 256 ==")
    print(f"  gsync, 2 processes x cpu   {gsync_median:7.1f} ms/step   repeats {' '.join(f'{v:.1f}' for v in gsync_ms)}")
    print(f"  DDP,   2 processes         {ddp_median:7.1f} ms/step   repeats {' '.join(f'{v:.1f}' for v in ddp_ms)}")
    print(f"  gsync / DDP = {gsync_median / ddp_median:.3f}   (target <= 1.00: {'met' if gsync_median <= ddp_median else 'MISSED'})")


if __name__ == "__main__":
    main()
