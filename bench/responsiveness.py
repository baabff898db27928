"""Event-loop responsiveness while training: how long the loop goes without running other tasks, five ways, in one run.

    python bench/responsiveness.py [--steps 30]

While the reference MLP (784-2048-2048-2048-10, batch 256, SGD) trains, two
probes run on the same process:

- a ticker task on the event loop, ``await asyncio.sleep(0.010)`` in a loop:
  the gap between consecutive ticks is 10 ms on a free loop, and a longer one
  is time the loop spent unable to run a task (p50, p99 and max gap, ms);
- a loopback HTTP client, in a thread of its own (a blocking ``http.client``
  request every 10 ms, as an outside client would send them), against a tiny
  ``asyncio.start_server`` server on this loop: the latency of each request,
  connect to last byte (p99 and max, ms).

Training runs five ways: gsync ``engine.fit`` and a held session's
``session.step`` loop on ``Engine(["cpu:0", "cpu:1"])``, the measured window
including the session's opening and closing; and one plain PyTorch loop on
the whole batch in this process, run in the coroutine as is, with ``await
asyncio.sleep(0)`` between steps, and with each step in ``asyncio.to_thread``.
For the held session the gaps that overlap its opening and its closing are
reported on their own, as is the time each took. Benchmarks print; they
never assert timings.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import quiet_warnings  # noqa: E402

quiet_warnings()

import torch  # noqa: E402

import gsync  # noqa: E402
from bench.workloads import loss_fn, make_batches, make_mlp, sgd  # noqa: E402

TICK_S = 0.010
DEVICES = ["cpu:0", "cpu:1"]
Phases = dict[str, tuple[float, float]]


async def ticker(ticks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        ticks.append(time.perf_counter())
        await asyncio.sleep(TICK_S)
    ticks.append(time.perf_counter())


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def client(port: int, latencies: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        # A long timeout: a loop blocked for the whole run answers only after it, and that latency is the result.
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        connection.request("GET", "/")
        connection.getresponse().read()
        connection.close()
        latencies.append(time.perf_counter() - started)
        stop.wait(TICK_S)  # the client's pace, not a wait for anything


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


# -- the five ways to train ------------------------------------------------------------


async def gsync_fit(batches: list, phases: Phases) -> None:
    engine = gsync.Engine(DEVICES)
    await engine.fit(make_mlp(), batches, optimizer=sgd, loss_fn=loss_fn, progress=False)


async def gsync_session(batches: list, phases: Phases) -> None:
    engine = gsync.Engine(DEVICES)
    started = time.perf_counter()
    session = await engine.session(make_mlp(), optimizer=sgd, loss_fn=loss_fn)
    phases["opening"] = (started, time.perf_counter())
    try:
        for batch in batches:
            await session.step(batch)
    finally:
        started = time.perf_counter()
        await session.aclose()
        phases["closing"] = (started, time.perf_counter())


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    optimizer.zero_grad()
    loss_fn(model, batch).backward()
    optimizer.step()


async def plain(batches: list, phases: Phases) -> None:
    model = make_mlp()
    optimizer = sgd(model.parameters())
    for batch in batches:
        plain_step(model, optimizer, batch)


async def plain_sleep0(batches: list, phases: Phases) -> None:
    model = make_mlp()
    optimizer = sgd(model.parameters())
    for batch in batches:
        plain_step(model, optimizer, batch)
        await asyncio.sleep(0)


async def plain_to_thread(batches: list, phases: Phases) -> None:
    model = make_mlp()
    optimizer = sgd(model.parameters())
    for batch in batches:
        await asyncio.to_thread(plain_step, model, optimizer, batch)


MODES: list[tuple[str, Callable[[list, Phases], Awaitable[None]]]] = [
    ("gsync engine.fit (2 x cpu)", gsync_fit),
    ("gsync session.step loop (2 x cpu)", gsync_session),
    ("plain loop in the coroutine", plain),
    ("plain loop + await asyncio.sleep(0)", plain_sleep0),
    ("plain loop, each step in to_thread", plain_to_thread),
]


async def measure(train: Callable[[list, Phases], Awaitable[None]], batches: list, port: int) -> dict:
    ticks: list[float] = []
    latencies: list[float] = []
    phases: Phases = {}
    stop_ticks, stop_client = asyncio.Event(), threading.Event()
    tick_task = asyncio.create_task(ticker(ticks, stop_ticks))
    await asyncio.sleep(TICK_S * 3)  # a few free ticks first, so the first gap that training causes is measured whole
    client_thread = threading.Thread(target=client, args=(port, latencies, stop_client), daemon=True)
    client_thread.start()
    started = time.perf_counter()
    await train(batches, phases)
    wall = time.perf_counter() - started
    stop_ticks.set()
    stop_client.set()
    await tick_task
    # The client may be inside a request the loop has yet to answer: it needs the loop running to finish.
    await asyncio.to_thread(client_thread.join)
    gaps = [(b - a, a, b) for a, b in zip(ticks, ticks[1:])]
    ms = [gap * 1e3 for gap, _, _ in gaps]
    result = {
        "wall_s": wall,
        "tick_p50": statistics.median(ms),
        "tick_p99": percentile(ms, 99),
        "tick_max": max(ms),
        "http_p99": percentile([x * 1e3 for x in latencies], 99),
        "http_max": max(latencies) * 1e3 if latencies else float("nan"),
        "requests": len(latencies),
    }
    for name, (begin, end) in phases.items():
        overlapping = [gap * 1e3 for gap, a, b in gaps if a < end and b > begin]
        result[name] = (end - begin, max(overlapping))
    return result


async def main(steps: int) -> None:
    torch.manual_seed(0)
    batches = make_batches(steps)
    # One plain step first: torch's one-time kernel set-up then falls in no mode's window.
    warm = make_mlp()
    plain_step(warm, sgd(warm.parameters()), batches[0])
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    results = [(name, await measure(train, batches, port)) for name, train in MODES]
    server.close()
    await server.wait_closed()

    print(f"== event-loop responsiveness while training: reference MLP, batch 256, {steps} steps, "
          f"{os.cpu_count()} cores, torch {torch.__version__} ==")
    print(f"  {'':38} {'window':>8} {'10 ms ticker gap (ms)':>26} {'HTTP latency (ms)':>20}")
    print(f"  {'training':38} {'s':>8} {'p50':>8} {'p99':>8} {'max':>8} {'p99':>8} {'max':>8} {'requests':>9}")
    for name, r in results:
        print(f"  {name:38} {r['wall_s']:8.2f} {r['tick_p50']:8.1f} {r['tick_p99']:8.1f} {r['tick_max']:8.1f} "
              f"{r['http_p99']:8.1f} {r['http_max']:8.1f} {r['requests']:9d}")
    session = dict(results)["gsync session.step loop (2 x cpu)"]
    for phase in ("opening", "closing"):
        seconds, gap = session[phase]
        print(f"  held session {phase}: {seconds * 1e3:.0f} ms, longest ticker gap overlapping it {gap:.1f} ms")
    worst = max(r["tick_max"] for name, r in results if name.startswith("gsync"))
    p99 = max(r["tick_p99"] for name, r in results if name.startswith("gsync"))
    met = "met" if p99 <= 20 and worst <= 60 else "NOT met"
    print(f"  goal for gsync (ticker p99 <= 20 ms, max <= 60 ms, opening included): {met} (p99 {p99:.1f}, max {worst:.1f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(main(args.steps))
