"""An online-learning service: train on a stream of examples while answering HTTP requests, in one event loop.

    python examples/online_service.py --port 8000          # 2 virtual CPU devices in this process
    torchrun --nproc-per-node 2 examples/online_service.py  # one device per process; rank 0 serves HTTP
    curl 127.0.0.1:8000/metrics
    python examples/online_service.py --prometheus-port 9100   # also gsync's Prometheus metrics (gsync[monitoring])
    curl -d '{"inputs": [[0.5, -1.0, ...32 numbers]]}' 127.0.0.1:8000/predict

A producer task streams labelled examples into a queue, as a feed (a socket,
a message bus) would; the training loop takes a global batch from the queue
for each `session.step`; the HTTP endpoint answers from `session.model`, a
snapshot of the weights at most one step old. gsync's devices compute in
threads of their own and `session.step` is awaited, so requests are answered
during steps, not only between them. Ctrl-C or SIGTERM stops the feed, ends
training at a step boundary (the same step on every rank), closes the session
and saves the trained weights (`--save`).

The server is the standard library's `asyncio.start_server`, with a few lines
of HTTP/1.0-style parsing (one request per connection): two JSON endpoints do
not warrant a dependency. A platform that scrapes Prometheus gets gsync's own
metrics (steps, step durations, loss, bytes reduced, failures) from
`gsync.metrics.serve` with `--prometheus-port`, on each rank (`port + rank`).
"""

from __future__ import annotations

import argparse
import asyncio
import http
import json
import os
import signal
import time
from collections import deque
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import gsync
import gsync.metrics

FEATURES, CLASSES = 32, 4


async def produce(queue: asyncio.Queue, seed: int) -> None:
    """The feed: labelled examples, one at a time, labelled by a fixed random teacher.

    Seeded, so every rank reads the same stream and, taking examples in order,
    the same global batches, as gsync expects by default. A feed that differs
    per rank (a partition of a topic each) would use `process_local_data=True`
    with equal batches instead.
    """
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    while True:
        x = torch.randn(16, FEATURES, generator=generator)  # a burst, as one read of a socket returns
        for example in zip(x, (x @ teacher).argmax(dim=1)):
            await queue.put(example)  # waits while the queue is full: the trainer sets the pace
        await asyncio.sleep(0)  # a real feed awaits its socket between reads


class Metrics:
    """What /metrics reports, from the last 50 steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.recent: deque[tuple[float, int, float]] = deque(maxlen=50)  # (time, rows, loss)

    def record(self, result: gsync.StepResult) -> None:
        self.steps = result.step + 1
        self.recent.append((time.perf_counter(), result.rows, result.loss))

    def as_dict(self) -> dict:
        losses = [loss for _, _, loss in self.recent]
        rate = None
        if len(self.recent) > 1:
            # Rows of the steps that ended after the first one of the window, over the time since it ended.
            rate = sum(rows for _, rows, _ in list(self.recent)[1:]) / (self.recent[-1][0] - self.recent[0][0])
        return {"step": self.steps, "loss": sum(losses) / len(losses) if losses else None, "samples_per_s": rate}


def predict(session: gsync.Session, body: bytes) -> dict:
    inputs = torch.tensor(json.loads(body)["inputs"], dtype=torch.float32)
    if inputs.ndim != 2 or inputs.shape[1] != FEATURES:
        raise ValueError(f"inputs must be a list of rows of {FEATURES} numbers")
    model = session.model.eval()  # a snapshot: training never reads it, so a request cannot disturb a step
    with torch.no_grad():
        probabilities = F.softmax(model(inputs), dim=1)
    return {"classes": probabilities.argmax(dim=1).tolist(), "probabilities": probabilities.tolist()}


async def handle(session: gsync.Session, metrics: Metrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    status, payload = 200, {}
    try:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").split("\r\n")
        method, path = head[0].split()[:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if path == "/metrics" and method == "GET":
            payload = metrics.as_dict()
        elif path == "/predict" and method == "POST":
            payload = {"step": metrics.steps, **predict(session, body)}
        else:
            status, payload = 404, {"error": "GET /metrics or POST /predict"}
    except (ValueError, KeyError, TypeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as error:
        status, payload = 400, {"error": str(error)}
    except gsync.SessionClosed:
        status, payload = 503, {"error": "the service is shutting down"}
    data = json.dumps(payload).encode()
    writer.write(
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
    )
    try:
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except ConnectionError:
        pass  # the client left first


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


async def train(session: gsync.Session, queue: asyncio.Queue, stopping: asyncio.Event, metrics: Metrics, batch_size: int) -> None:
    while True:
        # A collective, once per step: the ranks stop together at the first step boundary after any of them
        # was asked to (torchrun forwards a signal to every rank, but not at the same instant).
        if await session.all_reduce(int(stopping.is_set()), op="max"):
            return
        examples = [await queue.get() for _ in range(batch_size)]
        x, y = torch.stack([x for x, _ in examples]), torch.stack([y for _, y in examples])
        metrics.record(await session.step((x, y)))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")), help="0: any free port")
    parser.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"], help="ignored under torchrun")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="online_model.pt", help="where the trained state_dict goes")
    parser.add_argument(
        "--prometheus-port", type=int, default=None,
        help="also serve gsync's Prometheus metrics here (plus the rank; 0: any free port); needs gsync[monitoring]",
    )
    args = parser.parse_args()

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)

    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES))
    engine = gsync.Engine(None if under_torchrun else args.devices)  # under torchrun: this process's device
    session = await engine.session(
        model, optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9), loss_fn=loss_fn
    )
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * args.batch_size)
    producer = asyncio.create_task(produce(queue, args.seed))
    metrics = Metrics()
    server = None
    scraped = None
    try:
        if rank == 0:
            server = await asyncio.start_server(partial(handle, session, metrics), "127.0.0.1", args.port)
            port = server.sockets[0].getsockname()[1]
            print(f"serving on http://127.0.0.1:{port} (GET /metrics, POST /predict), pid {os.getpid()}", flush=True)
        if args.prometheus_port is not None:
            scraped = gsync.metrics.serve(args.prometheus_port + rank if args.prometheus_port else 0)
            print(f"prometheus metrics on {scraped.url}, rank {rank}", flush=True)
        await train(session, queue, stopping, metrics, args.batch_size)
    finally:
        producer.cancel()
        if server is not None:
            server.close()
            await server.wait_closed()
        if scraped is not None:
            scraped.close()
        await session.aclose()  # writes the trained weights into `model`
    if rank == 0:
        torch.save(model.state_dict(), args.save)
        print(f"stopped after {metrics.steps} steps, last loss {metrics.as_dict()['loss']}; saved {args.save}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
