"""What holding a session costs: ``session.step`` in the held form against the scoped form, in one run.

    python bench/held_session.py [--steps 30] [--repeats 5]

Both forms run the reference MLP (784-2048-2048-2048-10, batch 256) on two
virtual CPU devices in this process, each repeat a fresh session of each
form, alternated so that drift on the machine falls on both alike. The
statistic is the median wall time per step (the first step of each session,
which makes torch's first calls, left out); the ratio is held / scoped. A
held session's calls run in the caller's task and meet the actors through
their mailboxes, as the scoped form's do: what could differ is the check
that a call comes from the loop's thread, and the service task that sits
waiting. The step also runs from a task other than the opener's, as a
notebook cell would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path (never tests/), as -m puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import quiet_warnings  # noqa: E402

quiet_warnings()

import torch  # noqa: E402

import gsync  # noqa: E402
from bench.workloads import loss_fn, make_batches, make_mlp, sgd  # noqa: E402


async def timed_steps(session: gsync.Session, batches: list, in_other_task: bool) -> list[float]:
    async def run() -> list[float]:
        times = []
        for batch in batches:
            started = time.perf_counter()
            await session.step(batch)
            times.append(time.perf_counter() - started)
        return times[1:]

    if in_other_task:
        return await asyncio.get_running_loop().create_task(run())
    return await run()


async def main(steps: int, repeats: int) -> None:
    torch.manual_seed(0)
    batches = make_batches(steps)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    per_form: dict[str, list[float]] = {"scoped (async with)": [], "held (await, stepped from another task)": []}
    for _ in range(repeats):
        async with engine.session(make_mlp(), optimizer=sgd, loss_fn=loss_fn) as session:
            per_form["scoped (async with)"] += await timed_steps(session, batches, in_other_task=False)
        held = await engine.session(make_mlp(), optimizer=sgd, loss_fn=loss_fn)
        try:
            per_form["held (await, stepped from another task)"] += await timed_steps(held, batches, in_other_task=True)
        finally:
            await held.aclose()
    scoped = statistics.median(per_form["scoped (async with)"])
    print(f"== held session vs scoped session: reference MLP, 2 x cpu, {steps - 1} steps x {repeats} repeats each ==")
    print(f"  {'form':42} {'ms/step (median)':>17} {'held/scoped':>12}")
    for name, times in per_form.items():
        median = statistics.median(times)
        print(f"  {name:42} {median * 1e3:17.2f} {median / scoped:12.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.repeats))
