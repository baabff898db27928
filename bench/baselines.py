"""Baselines without gsync: one plain process, the 2-replica compute floor, torch DDP (gloo)
and, for the control-plane benchmarks, N replicas trained sequentially in one thread, and the same
work handed out by an asyncio loop to threads as gsync does, with nothing else (the design's floor).

Each function runs inside a fresh worker process (see ``isolate.py``) and
returns a JSON-able dict; step times are wall-clock per optimizer step,
measured after ``warmup`` steps.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from tests.support.plain_loop import train_steps

from .common import Window, os_threads, summarize_ms
from .workloads import (
    TINY_LAYERS,
    loss_fn,
    make_batches,
    make_mlp,
    make_tiny,
    make_tiny_batches,
    sgd,
    shard,
    tiny_loss,
)


def _timed_steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], warmup: int
) -> tuple[list[float], dict[str, Any]]:
    """The plain loop (``tests/support/plain_loop.py``); the per-step wall times after ``warmup`` steps, and the
    resource window over them."""
    stamps: list[float] = []
    window: list[Window] = []

    def before_step(index: int) -> None:
        if index == warmup:
            window.append(Window())
        stamps.append(time.perf_counter())

    train_steps(model, optimizer, batches, loss_fn, before_step=before_step)
    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])], window[0].stop()


def plain(steps: int, warmup: int, threads: int | None = None) -> dict[str, Any]:
    """(a) One process, a plain PyTorch loop over the whole global batch."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = make_mlp()
    optimizer = sgd(model.parameters())
    batches = make_batches(warmup + steps)
    times, win = _timed_steps(model, optimizer, batches, warmup)
    return {
        "step": summarize_ms(times),
        "window": win,
        "cpu_ms_per_step": win["own_cpu_s"] * 1e3 / steps,
        "faults_per_step": win["minor_faults"] / steps,
        "torch_threads": torch.get_num_threads(),
    }


def _bucket_views(params: list[torch.nn.Parameter], copy_in_hook: bool) -> torch.Tensor:
    """Give ``params`` gradients that are views into one flat buffer, as gsync's buckets do.

    ``copy_in_hook``: instead of accumulating into the views, leave ``.grad`` unset before
    backward and copy each fresh gradient into its view in a post-accumulate hook
    (DDP's ``gradient_as_bucket_view`` way).
    """
    flat = torch.zeros(sum(p.numel() for p in params))
    views, offset = [], 0
    for param in params:
        views.append(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
        param.grad = views[-1]
    if copy_in_hook:
        for param, view in zip(params, views):

            def hook(p: torch.Tensor, view: torch.Tensor = view) -> None:
                view.copy_(p.grad)
                p.grad = view

            param.register_post_accumulate_grad_hook(hook)
    return flat


def floor(steps: int, warmup: int, threads_per_replica: int | None = 1, replicas: int = 2,
          workload: str = "ref", grads: str = "fresh", layers: int = TINY_LAYERS) -> dict[str, Any]:
    """(b) The compute floor: ``replicas`` plain Python threads, each training its own replica
    on its shard of each global batch, with no gradient synchronization at all.

    A barrier per step only delimits steps. ``threads_per_replica`` is applied with
    ``torch.set_num_threads`` inside each thread (None: inherit the process default).
    Phases are timed per thread so gsync's phases can be compared with them.
    ``workload``: "ref" (the reference MLP) or "tiny" (the control-plane model, ``layers`` x Linear(8, 8)).

    ``grads`` (an ablation of gsync's gradient handling, still without any sync):
    "fresh": ``zero_grad()`` (set to None), autograd hands each fresh gradient over, as in
    plain PyTorch; "bucket_zero": ``.grad`` are persistent views into one flat buffer,
    zeroed every step and accumulated into in place, as gsync does; "bucket_copy": views
    filled by a copy in a post-accumulate hook.
    """
    if grads not in ("fresh", "bucket_zero", "bucket_copy"):
        raise ValueError(f"unknown grads mode {grads!r}")
    if workload == "tiny":
        model, batches, loss = make_tiny(layers), make_tiny_batches(warmup + steps), tiny_loss
    else:
        model, batches, loss = make_mlp(), make_batches(warmup + steps), loss_fn
    barrier = threading.Barrier(replicas)
    releases: list[float] = []
    phases: list[dict[str, list[float]]] = [
        {"zero_grad": [], "forward": [], "backward": [], "optimizer": []} for _ in range(replicas)
    ]
    seen_threads: list[int] = [0] * replicas
    errors: list[BaseException] = []
    window: list[Window] = []

    def train(index: int) -> None:
        try:
            if threads_per_replica is not None:
                torch.set_num_threads(threads_per_replica)
            replica = copy.deepcopy(model)
            optimizer = sgd(replica.parameters())
            params = list(replica.parameters())
            flat = _bucket_views(params, grads == "bucket_copy") if grads != "fresh" else None
            seen_threads[index] = torch.get_num_threads()
            for i, batch in enumerate(batches):
                barrier.wait()
                if index == 0:
                    if i == warmup:
                        window.append(Window())
                    releases.append(time.perf_counter())
                part = shard(batch, replicas, index)
                tz = time.perf_counter()
                if grads == "fresh":
                    optimizer.zero_grad()
                elif grads == "bucket_zero":
                    flat.zero_()  # type: ignore[union-attr]
                else:
                    for param in params:
                        param.grad = None
                t0 = time.perf_counter()
                value = loss(replica, part)
                t1 = time.perf_counter()
                value.backward()
                t2 = time.perf_counter()
                optimizer.step()
                value.item()
                t3 = time.perf_counter()
                if i >= warmup:
                    phases[index]["zero_grad"].append(t0 - tz)
                    phases[index]["forward"].append(t1 - t0)
                    phases[index]["backward"].append(t2 - t1)
                    phases[index]["optimizer"].append(t3 - t2)
            barrier.wait()
            if index == 0:
                releases.append(time.perf_counter())
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    workers = [threading.Thread(target=train, args=(i,), name=f"floor-{i}") for i in range(replicas)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    win = window[0].stop()
    times = [b - a for a, b in zip(releases[warmup:], releases[warmup + 1 :])]
    phase_us = {
        name: sum(sum(p[name]) for p in phases) / sum(len(p[name]) for p in phases) * 1e6 for name in phases[0]
    }
    return {
        "step": summarize_ms(times),
        "window": win,
        "cpu_ms_per_step": win["own_cpu_s"] * 1e3 / steps,
        "faults_per_step": win["minor_faults"] / steps,
        "torch_threads_in_workers": seen_threads,
        "os_threads": os_threads(),
        "phase_mean_us": phase_us,
        "grads": grads,
    }


def ddp_rank(rank: int, world_size: int, port: int, steps: int, warmup: int, threads: int = 1,
             comm_hook: str | None = None) -> dict[str, Any]:
    """(d) One rank of torch DDP over gloo; each rank trains on its shard of each global batch.

    ``comm_hook``: ``"bf16"`` or ``"fp16"`` registers DDP's ``bf16_compress_hook`` or ``fp16_compress_hook``.
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        model = DistributedDataParallel(make_mlp())
        if comm_hook is not None:
            hook = getattr(default_hooks, f"{comm_hook}_compress_hook")
            # DDP refuses bf16_compress_hook by its name unless NCCL is there; gloo sums bf16 fine, so call it unnamed.
            model.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        optimizer = sgd(model.parameters())
        batches = [shard(b, world_size, rank) for b in make_batches(warmup + steps)]
        dist.barrier()
        times, win = _timed_steps(model, optimizer, batches, warmup)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank,
        "step": summarize_ms(times),
        "window": win,
        "cpu_ms_per_step": win["own_cpu_s"] * 1e3 / steps,
        "faults_per_step": win["minor_faults"] / steps,
        "torch_threads": torch.get_num_threads(),
    }


class _TinyReplicas:
    """``replicas`` copies of the tiny model with their optimizers, and the work of one gsync step on them in
    the pieces gsync runs it in: one replica's forward, backward and loss read; the gradients' average."""

    def __init__(self, replicas: int, layers: int) -> None:
        model = make_tiny(layers)
        self.copies = [copy.deepcopy(model) for _ in range(replicas)]
        self.optimizers = [sgd(r.parameters()) for r in self.copies]
        self.params = [list(r.parameters()) for r in self.copies]

    def forward_backward(self, index: int, batch: Any) -> None:
        self.optimizers[index].zero_grad()
        loss = tiny_loss(self.copies[index], shard(batch, len(self.copies), index))
        loss.backward()
        loss.item()

    def average(self) -> None:
        grads = [[p.grad for p in ps] for ps in self.params]
        for other in grads[1:]:
            torch._foreach_add_(grads[0], other)
        torch._foreach_mul_(grads[0], 1.0 / len(grads))
        for other in grads[1:]:
            torch._foreach_copy_(other, grads[0])


def sequential(steps: int, warmup: int, repeats: int = 1, replicas: int = 2, layers: int = TINY_LAYERS) -> dict[str, Any]:
    """Control-plane baseline: the work of a ``replicas``-device gsync step done by hand in one plain thread.

    ``replicas`` replicas of the tiny model (``layers`` x Linear(8, 8)), forward/backward each on its
    shard, gradients averaged by hand (foreach ops), every optimizer stepped, every loss read.
    """
    work = _TinyReplicas(replicas, layers)
    batches = make_tiny_batches(warmup + steps)
    per_step: list[float] = []
    window = Window()
    for _ in range(repeats):
        start = 0.0
        for i, batch in enumerate(batches):
            if i == warmup:
                start = time.perf_counter()
            for index in range(replicas):
                work.forward_backward(index, batch)
            work.average()
            for optimizer in work.optimizers:
                optimizer.step()
        per_step.append((time.perf_counter() - start) / steps)
    win = window.stop()
    per_step.sort()
    return {"window": win, "us_per_step": per_step[len(per_step) // 2] * 1e6, "all_us_per_step": [s * 1e6 for s in per_step],
            "params": len(work.params[0]), "replicas": replicas}


class _JobThread:
    """A plain OS thread running jobs one at a time for an asyncio loop, each result (or error) set on a future.

    Jobs that run back to back report together when the thread runs out of jobs, one loop wake-up per burst,
    as gsync's shared device thread does: without that, this floor would pay wake-ups gsync does not.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        while True:
            if done and self._jobs.empty():
                self._loop.call_soon_threadsafe(_settle, done)
                done = []
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                done.append((future, job(), None))
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
                done.append((future, None, error))

    def run(self, job: Any) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def _settle(done: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, value, error in done:
        if future.done():
            continue  # its awaiter was cancelled: setting it would raise on the loop
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


async def handoff_floor(steps: int, warmup: int, replicas: int = 2, layers: int = TINY_LAYERS,
                        device_threads: str = "shared") -> dict[str, Any]:
    """Control-plane floor of gsync's design: :func:`sequential`'s work, split into the jobs gsync runs and
    handed out by an asyncio loop, with nothing else (no messages, mailboxes, buckets or timeouts).

    Per step: each replica's forward, backward and loss read as one job, on a worker thread the replicas share
    (``device_threads="shared"``) or on the replica's own (``"per_device"``), as gsync runs them; the gradient
    averaging as one job on a second thread (gsync's communication thread), then each replica's optimizer step
    as one job on its worker thread; each phase's jobs are awaited together. What gsync costs over this is its
    own machinery; what this costs over :func:`sequential` is the design's (thread hand-offs, loop wake-ups,
    the GIL shared with the loop and among threads). Also returns the loop thread's CPU time per step. (Its
    threads keep the process's torch thread count, where gsync's split the cores: Linear(8, 8)'s kernels are too
    small for torch to run on more than one thread either way.)
    """
    loop = asyncio.get_running_loop()
    work = _TinyReplicas(replicas, layers)
    batches = make_tiny_batches(warmup + steps)
    if device_threads == "shared":
        shared = _JobThread(loop, "handoff-devices")
        devices = [shared] * replicas
    else:
        devices = [_JobThread(loop, f"handoff-device-{r}") for r in range(replicas)]
    comm = _JobThread(loop, "handoff-comm")
    window = Window()
    start = loop_cpu = 0.0
    try:
        for i, batch in enumerate(batches):
            if i == warmup:
                start, loop_cpu = time.perf_counter(), time.thread_time()
            await asyncio.gather(*(devices[r].run(functools.partial(work.forward_backward, r, batch)) for r in range(replicas)))
            await comm.run(work.average)
            await asyncio.gather(*(device.run(optimizer.step) for device, optimizer in zip(devices, work.optimizers)))
        us_per_step = (time.perf_counter() - start) / steps * 1e6
        loop_cpu_us_per_step = (time.thread_time() - loop_cpu) / steps * 1e6
    finally:
        for device in dict.fromkeys(devices):
            device.stop()
        comm.stop()
    return {"window": window.stop(), "us_per_step": us_per_step, "loop_cpu_us_per_step": loop_cpu_us_per_step,
            "params": len(work.params[0]), "replicas": replicas, "device_threads": device_threads}
