"""``shard_optimizer=True`` against unsharded, and against torch's ZeroRedundancyOptimizer under DDP, in one run.

    python bench/sharding.py [--steps 12] [--repeats 2] [--devices 2,3,4]

The reference MLP (784-2048-2048-2048-10, 10.0M parameters, batch 256) with AdamW (lr 1e-3, weight decay
0.01). Every configuration runs in a fresh process (peak RSS is a process's high-water mark), sharded and
unsharded alternated ``--repeats`` times so that drift on the machine falls on both alike.

1. In one process, on 2, 3 and 4 virtual CPU devices: per device, the optimizer state's bytes (read from
   each replica's optimizer), what gsync holds for training (parameters, gradient buckets, optimizer state,
   the all-gather's buffer), the process's peak RSS divided by the devices, and the median step time;
   side-by-side ratios sharded / unsharded, and the optimizer state against 1/N of unsharded.
2. Across 2 processes x 1 device over gloo: gsync unsharded and sharded, torch DDP with AdamW, and DDP with
   ``ZeroRedundancyOptimizer(AdamW)``: per rank, optimizer-state bytes, peak RSS, median step time.

It prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path (never tests/), as -m puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import peak_rss_mib, quiet_warnings  # noqa: E402

quiet_warnings()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.workloads import loss_fn, make_batches, make_mlp, shard  # noqa: E402

MiB = 2**20


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def _held_bytes(session: Any) -> list[int]:
    """Per device: parameters, their gradients (one each, in a bucket or in ``.grad``), the optimizer state and
    the all-gather's buffer: what a device holds for training, activations aside."""
    core = session._core
    sharding = core._parts.sharding
    held = []
    for index, actor in enumerate(core._actors):
        params = sum(p.numel() * p.element_size() for p in actor.replica.parameters() if p.requires_grad)
        scratch = 0
        if sharding is not None:
            scratch = sum(t.numel() * t.element_size() for t in sharding._scratch[index].values())
        held.append(2 * params + state_bytes(actor.optimizer) + scratch)
    return held


def _in_process(devices: int, sharded: bool, steps: int) -> dict[str, Any]:
    import gsync

    batches = make_batches(steps)

    async def run() -> dict[str, Any]:
        engine = gsync.Engine([f"cpu:{i}" for i in range(devices)], shard_optimizer=sharded)
        async with engine.session(make_mlp(), optimizer=adamw, loss_fn=loss_fn) as session:
            times = []
            for batch in batches:
                started = time.perf_counter()
                await session.step(batch)
                times.append(time.perf_counter() - started)
            states = [state_bytes(optimizer) for optimizer in session.optimizers]
            held = _held_bytes(session)
        return {"step_ms": statistics.median(times[2:]) * 1e3, "state": states, "held": held}

    result = asyncio.run(run())
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def rank_main(config: str, steps: int) -> dict[str, Any]:
    """One rank of 2 (gloo, 1 thread each): ``config`` is gsync, gsync_sharded, ddp or ddp_zero."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    batches = make_batches(steps)
    if config.startswith("gsync"):
        import gsync

        async def run() -> dict[str, Any]:
            engine = gsync.Engine(["cpu"], shard_optimizer=config == "gsync_sharded")
            async with engine.session(make_mlp(), optimizer=adamw, loss_fn=loss_fn) as session:
                times = []
                for batch in batches:
                    started = time.perf_counter()
                    await session.step(batch)
                    times.append(time.perf_counter() - started)
                return {"step_ms": statistics.median(times[2:]) * 1e3, "state": state_bytes(session.optimizers[0])}

        result = asyncio.run(run())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model: nn.Module = DistributedDataParallel(make_mlp())
        if config == "ddp_zero":
            optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01
            )
        else:
            optimizer = adamw(model.parameters())
        times = []
        for batch in batches:
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, shard(batch, 2, rank)).backward()
            optimizer.step()
            times.append(time.perf_counter() - started)
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        result = {"step_ms": statistics.median(times[2:]) * 1e3, "state": state_bytes(local)}
        dist.destroy_process_group()
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def _child(devices: int, sharded: bool, steps: int) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, '.'); from bench.sharding import _in_process; "
        f"print('RESULT' + json.dumps(_in_process({devices}, {sharded}, {steps})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT"):
            return dict(json.loads(line[len("RESULT"):]))
    raise RuntimeError(f"{devices} devices sharded={sharded} failed:\n{done.stderr[-3000:]}")


def _fmt_mib(value: float) -> str:
    return f"{value / MiB:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", default="2,3,4")
    parser.add_argument("--only", default="in_process,processes", help="sections: in_process, processes")
    args = parser.parse_args()
    counts = [int(n) for n in args.devices.split(",")] if "in_process" in args.only else []
    params = sum(p.numel() for p in make_mlp().parameters())
    print(f"reference MLP, {params / 1e6:.1f}M parameters, AdamW, batch 256; {args.steps} steps, {args.repeats} repeats")
    print()
    if counts:
        print("In one process (virtual CPU devices), per device:")
    header = (
        f"{'devices':>7} {'mode':>9} {'opt state MiB':>13} {'max/unsharded':>13} {'1/N + bucket':>12} "
        f"{'held MiB':>9} {'peak RSS/N MiB':>14} {'step ms':>8} {'sharded/unsharded':>17}"
    )
    if counts:
        print(header)
    for devices in counts:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for sharded in (False, True):
                runs[sharded].append(_child(devices, sharded, args.steps))
        unsharded_state = max(runs[False][0]["state"])
        step = {mode: statistics.median(r["step_ms"] for r in runs[mode]) for mode in runs}
        bucket = 25 * MiB
        for sharded in (False, True):
            first = runs[sharded][0]
            state = max(first["state"])
            rss = min(r["peak_rss_mib"] for r in runs[sharded]) / devices
            ratio = f"{step[True] / step[False]:17.3f}" if sharded else f"{'':>17}"
            bound = f"{'yes' if state <= unsharded_state / devices + bucket else 'NO':>12}" if sharded else f"{'':>12}"
            print(
                f"{devices:>7} {'sharded' if sharded else 'unsharded':>9} {_fmt_mib(state):>13} "
                f"{state / unsharded_state:13.3f} {bound} {_fmt_mib(max(first['held'])):>9} {rss:14.1f} "
                f"{step[sharded]:8.1f} {ratio}"
            )
    if "processes" not in args.only.split(","):
        return
    from bench.sharding import rank_main as ranked  # by its package name, not __main__, for the ranks to import
    from tests.support.harness import run_ranks

    print()
    print("2 processes x 1 device, gloo, 1 thread each, per rank:")
    print(f"{'config':>34} {'opt state MiB':>13} {'peak RSS MiB':>12} {'step ms':>8} {'vs gsync unsharded':>18}")
    names = {
        "gsync": "gsync unsharded",
        "gsync_sharded": "gsync shard_optimizer=True",
        "ddp": "DDP + AdamW",
        "ddp_zero": "DDP + ZeroRedundancyOptimizer",
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            ranks = run_ranks(ranked, 2, args=(name, args.steps), timeout=600, check=True)
            results[name].append({
                "step_ms": max(r.value["step_ms"] for r in ranks),
                "state": max(r.value["state"] for r in ranks),
                "peak_rss_mib": max(r.value["peak_rss_mib"] for r in ranks),
            })
    base = statistics.median(r["step_ms"] for r in results["gsync"])
    for name, label in names.items():
        runs_ = results[name]
        step_ms = statistics.median(r["step_ms"] for r in runs_)
        print(
            f"{label:>34} {_fmt_mib(runs_[0]['state']):>13} {min(r['peak_rss_mib'] for r in runs_):12.1f} "
            f"{step_ms:8.1f} {step_ms / base:18.3f}"
        )


if __name__ == "__main__":
    main()
