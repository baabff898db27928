"""The GPU check's parts that the 2026-12-04 run on one H200 added by hand (``nosync``, ``loop``, ``transformer``,
``launch``) and the process-group path on CUDA (``multiproc``). ``tools/gpu_check.py`` runs each in its own
process; under ``--rehearse`` they run on the CPU at toy sizes, which checks this code and not gsync's CUDA path.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.gpu_common import (
    ROOT,
    Timed,
    ce_loss,
    exactness_batches,
    exactness_model,
    free_port,
    gate,
    gpu_count,
    guarded,
    main_device,
    max_param_diff,
    note,
    percentile,
    rehearsal,
    result,
    sgd,
    synchronize,
)

__all__ = ("part_launch", "part_loop", "part_multiproc", "part_nosync", "part_transformer")


def _mlp(width: int, layers: int, classes: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    stack: list[nn.Module] = []
    for _ in range(layers):
        stack += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*stack, nn.Linear(width, classes))


def _mlp_batches(width: int, classes: int, rows: int, count: int, device: str) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(2)
    distinct = [(torch.randn(rows, width, generator=generator), torch.randint(0, classes, (rows,), generator=generator)) for _ in range(4)]
    return [(x.to(device), y.to(device)) for x, y in (distinct[i % len(distinct)] for i in range(count))]


# ------------------------------------------------------------------------------------------------
# nosync: no synchronizing call inside a steady-state step
# ------------------------------------------------------------------------------------------------

SYNC_WARNING = "called a synchronizing CUDA operation"
GRAD_SCALER = os.path.join("torch", "amp", "grad_scaler.py")


@dataclass
class SyncCalls:
    """The synchronizing CUDA calls torch's sync debug mode warns of, by call site, inside steady-state steps or not.

    A call's site is the innermost frame of this repository (gsync, the check's own code), else the innermost
    frame. Calls made inside ``torch.amp.GradScaler.step`` (it reads ``found_inf`` back, as in any plain loop)
    are counted apart. Warnings torch raises outside any Python call (in autograd's C++ threads) reach stderr,
    not here.
    """

    stepping: threading.Event = field(default_factory=threading.Event)
    inside: Counter[str] = field(default_factory=Counter)
    outside: Counter[str] = field(default_factory=Counter)
    grad_scaler: Counter[str] = field(default_factory=Counter)

    @contextlib.contextmanager
    def watching(self, cuda: bool) -> Iterator[None]:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("always")  # every call, not once per place
            warnings.showwarning = self._seen
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")

    def _seen(
        self, message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if SYNC_WARNING not in str(message):
            return  # the mode's own "prototype feature" warning, and anything else
        stack = traceback.extract_stack()[:-1]
        ours = [frame for frame in stack if frame.filename.startswith(str(ROOT)) and "gpu_parts.py" not in frame.filename]
        frame = (ours or stack)[-1]
        site = f"{Path(frame.filename).relative_to(ROOT) if ours else frame.filename}:{frame.lineno} {frame.name}"
        if any(GRAD_SCALER in f.filename for f in stack):
            self.grad_scaler[site] += 1
        elif self.stepping.is_set():
            self.inside[site] += 1
        else:
            self.outside[site] += 1


class _Window:
    """Batches that mark the steady state: from batch ``warmup`` on, until the data ends (before the fit closes)."""

    def __init__(self, batches: list[Any], warmup: int, stepping: threading.Event) -> None:
        self.batches, self.warmup, self.stepping = batches, warmup, stepping

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.batches):
            if index == self.warmup:
                self.stepping.set()
            yield batch
        self.stepping.clear()


def _sites(counts: Counter[str], limit: int = 6) -> str:
    return "; ".join(f"{site} (x{n})" for site, n in counts.most_common(limit)) or "none"


def part_nosync() -> None:
    import torch

    import gsync

    device = main_device()
    cuda = device.startswith("cuda")
    width, layers, rows = (1024, 4, 512) if cuda else (32, 2, 16)
    warmup, measured = 3, 8
    model = _mlp(width, layers, 10)

    def recipe(kind: str) -> dict[str, Any]:
        if kind == "bf16":
            return {
                "autocast": torch.bfloat16,
                "clip_grad_norm": 1.0,
                "scheduler": lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)),
            }
        if kind == "fp16":
            return {"autocast": torch.float16}
        return {}

    def run(label: str, how: str, kind: str, batches_on: str) -> None:
        batches = _mlp_batches(width, 10, rows, warmup + measured, batches_on)
        calls = SyncCalls()
        engine = gsync.Engine([device], sync_timeout=60)

        async def loop() -> None:
            session = await engine.session(copy.deepcopy(model), optimizer=sgd, loss_fn=ce_loss, **recipe(kind))
            try:
                for index, batch in enumerate(batches):
                    if index == warmup:
                        calls.stepping.set()
                    await session.step(batch)
            finally:
                calls.stepping.clear()
                await session.aclose()

        with calls.watching(cuda):
            if how == "fit":
                data = _Window(batches, warmup, calls.stepping)
                asyncio.run(engine.fit(copy.deepcopy(model), data, optimizer=sgd, loss_fn=ce_loss, progress=False, **recipe(kind)))
            else:
                asyncio.run(loop())
        where = "" if cuda else " (CPU rehearsal: no sync debug mode, nothing to see)"
        if calls.inside:
            result(f"nosync {label}: FAILED {sum(calls.inside.values())} synchronizing call(s) inside steady-state steps: {_sites(calls.inside)}")
        else:
            result(
                f"nosync {label}: PASS no synchronizing call inside {measured} steady-state steps{where}; "
                f"{sum(calls.outside.values())} at open, the first {warmup} steps and close"
            )
        if calls.outside:
            note(f"synchronized outside the steady state at: {_sites(calls.outside)}")
        if calls.grad_scaler:
            note(f"inside torch.amp.GradScaler.step (it reads found_inf back, as in a plain loop): {_sites(calls.grad_scaler)}")

    runs = (
        ("fit, fp32, batches on the GPU", "fit", "fp32", device),
        ("fit, bf16 autocast + clip_grad_norm + scheduler, batches on the CPU", "fit", "bf16", "cpu"),
        ("session.step loop, fp32, batches on the CPU", "step", "fp32", "cpu"),
        ("session.step loop, bf16 autocast + clip_grad_norm + scheduler, batches on the GPU", "step", "bf16", device),
        ("fit, fp16 + GradScaler (torch's own found_inf reads listed apart)", "fit", "fp16", device),
    )
    for label, how, kind, batches_on in runs:
        guarded(f"nosync {label}", lambda l=label, h=how, k=kind, b=batches_on: run(l, h, k, b))  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# loop: the event loop stays responsive while gsync trains
# ------------------------------------------------------------------------------------------------


class _Ticker:
    """A 1 ms ticker on the event loop: the spacing of its ticks is how long the loop was unable to run it."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Ticker:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def describe(self) -> str:
        if not self.gaps:
            return "no ticks"
        ms = [gap * 1e3 for gap in self.gaps]
        return f"p50 {percentile(ms, 0.5):.2f} ms, p99 {percentile(ms, 0.99):.2f} ms, max {max(ms):.2f} ms over {len(ms)} ticks"

    def p99_ms(self) -> float:
        return percentile([gap * 1e3 for gap in self.gaps], 0.99) if self.gaps else float("inf")


LOOP_TARGET_P99_MS = 5.0


def part_loop() -> None:
    import torch

    import gsync
    from tests.support.plain_loop import train_steps

    device = main_device()
    cuda = device.startswith("cuda")
    width, layers, rows, steps = (4096, 8, 1024, 40) if cuda else (32, 2, 16, 10)
    model = _mlp(width, layers, 1000)
    batches = _mlp_batches(width, 1000, rows, steps, device)
    shape = f"MLP {width} x {layers} + head, batch {rows}, {steps} steps"

    def optimizer(params: list[Any]) -> Any:
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)

    def verdict(ticker: _Ticker) -> str:
        return "PASS" if ticker.p99_ms() <= LOOP_TARGET_P99_MS else "ABOVE TARGET"

    def during_fit(which: str) -> None:
        async def go() -> _Ticker:
            engine = gsync.Engine([device], sync_timeout=60)
            replica = copy.deepcopy(model)  # the caller's work, not gsync's: off the ticker's watch
            async with _Ticker() as ticker:
                await engine.fit(replica, batches, optimizer=optimizer, loss_fn=ce_loss, progress=False)
            return ticker

        ticker = asyncio.run(go())
        result(f"loop fit on {device}, {which} ({shape}, open and close included): ticker gaps {ticker.describe()} "
               f"(target p99 <= {LOOP_TARGET_P99_MS:g} ms: {verdict(ticker)})")

    def during_held_steps(devices: list[str], label: str) -> None:
        async def go() -> _Ticker:
            engine = gsync.Engine(devices, sync_timeout=60)
            session = await engine.session(copy.deepcopy(model), optimizer=optimizer, loss_fn=ce_loss)
            try:
                async with _Ticker() as ticker:
                    for batch in batches:
                        await session.step(batch)
            finally:
                await session.aclose()
            return ticker

        ticker = asyncio.run(go())
        result(f"{label} ({shape}): ticker gaps {ticker.describe()} (target p99 <= {LOOP_TARGET_P99_MS:g} ms: {verdict(ticker)})")

    def plain_in_a_coroutine() -> None:
        replica = copy.deepcopy(model).to(device)
        step_optimizer = optimizer(list(replica.parameters()))

        async def go() -> _Ticker:
            async with _Ticker() as ticker:
                for batch in batches:
                    train_steps(replica, step_optimizer, [batch], ce_loss)
                    await asyncio.sleep(0)  # the friendliest plain loop: it yields between steps
            return ticker

        ticker = asyncio.run(go())
        result(f"loop plain loop in a coroutine on {device}, yielding between steps ({shape}): ticker gaps {ticker.describe()}")

    # The process's first optimizer imports torch._dynamo (1.2 s on the 2-core CPU machine), and a session builds
    # its optimizers on the event loop: the first fit shows that once, the second what every later one costs.
    guarded("loop first fit", lambda: during_fit("the process's first (torch's one-time imports included)"))
    guarded("loop second fit", lambda: during_fit("a second one"))
    guarded("loop held session", lambda: during_held_steps([device], f"loop held session's steps on {device}"))
    guarded("loop plain loop", plain_in_a_coroutine)
    gpus = gpu_count()
    if gate("loop held session on every GPU (several GPUs in one process)", gpus):
        every = ["cpu:0", "cpu:1"] if rehearsal() else [f"cuda:{index}" for index in range(gpus)]
        guarded("loop held session on every GPU", lambda: during_held_steps(every, f"loop held session's steps on {every}"))


# ------------------------------------------------------------------------------------------------
# transformer: a GPT-2-shaped model, bf16 autocast, AdamW
# ------------------------------------------------------------------------------------------------


def _gpt2(small: bool) -> tuple[Callable[[], Any], str, int]:
    """A seeded builder of the GPT-2-shaped model, what it is, and its vocabulary size."""
    import torch

    vocab, context, width, layers, heads = (256, 64, 64, 2, 4) if small else (50257, 1024, 768, 12, 12)
    try:
        transformers = importlib.import_module("transformers")  # optional: not a dependency of gsync or its tools
    except ImportError:
        from tools.gpt2_small import GPT2Shaped

        def ours() -> Any:
            torch.manual_seed(0)
            return GPT2Shaped(vocab, context, width, layers, heads)

        return ours, "tools/gpt2_small.GPT2Shaped (transformers is not installed)", vocab

    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )

    def theirs() -> Any:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    return theirs, "transformers GPT2LMHeadModel from a GPT2Config", vocab


def part_transformer() -> None:
    # cuBLAS is deterministic only with a fixed workspace, which it reads as CUDA starts: before anything touches it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.nn.functional as F

    import gsync
    from tests.support.plain_loop import train_steps

    device = main_device()
    cuda = device.startswith("cuda")
    device_type = torch.device(device).type
    build, source, vocab = _gpt2(small=not cuda)
    rows, length, steps, warmup = (16, 512, 30, 5) if cuda else (4, 32, 6, 2)
    initial = build()
    params = sum(p.numel() for p in initial.parameters())
    generator = torch.Generator().manual_seed(3)
    distinct = []
    for _ in range(4):
        tokens = torch.randint(0, vocab, (rows, length + 1), generator=generator).to(device)
        distinct.append((tokens[:, :-1], tokens[:, 1:]))
    batches = [distinct[i % len(distinct)] for i in range(steps)]
    shape = f"{source}, {params / 1e6:.0f} M params, bf16 autocast, AdamW, batch {rows} x {length}, {steps} steps"
    print(f"   {shape}", flush=True)

    def lm_loss(model: Any, batch: Any) -> Any:
        output = model(batch[0])
        logits = getattr(output, "logits", output)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    def plain_loss(model: Any, batch: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return lm_loss(model, batch)

    def adamw(parameters: list[Any]) -> Any:
        return torch.optim.AdamW(parameters, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def plain() -> tuple[list[float], dict[str, Any], float]:
        model = copy.deepcopy(initial).to(device)
        data = Timed(batches)
        losses = train_steps(model, adamw(list(model.parameters())), data, plain_loss)
        synchronize(device)
        state = {name: p.detach().cpu() for name, p in model.named_parameters()}
        del model
        return losses, state, data.median_step(warmup)

    def ours() -> tuple[list[float], dict[str, Any], float]:
        data = Timed(batches)
        engine = gsync.Engine([device], sync_timeout=120)
        fitted = asyncio.run(
            engine.fit(copy.deepcopy(initial), data, optimizer=adamw, loss_fn=lm_loss, autocast=torch.bfloat16, progress=False)
        )
        state = {name: p.detach().cpu() for name, p in fitted.model.named_parameters()}
        return list(fitted.losses), state, data.median_step(warmup)

    def deterministic() -> None:
        torch.backends.cudnn.benchmark = False
        # warn_only: an operation without a deterministic implementation is named in a note, not raised.
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plain_losses, plain_state, plain_s = plain()
                our_losses, our_state, our_s = ours()
        finally:
            torch.use_deterministic_algorithms(False)
        differing = [i for i, (a, b) in enumerate(zip(plain_losses, our_losses)) if a != b]
        same_params = all(torch.equal(plain_state[name], value) for name, value in our_state.items())
        identical = not differing and same_params and len(plain_losses) == len(our_losses)
        if identical:
            verdict = "PASS bit-identical to the plain loop (every loss, every parameter)"
        else:
            verdict = (
                f"FAILED losses differ at steps {differing[:5]}{'...' if len(differing) > 5 else ''}, max |param diff| "
                f"{max_param_diff(our_state, plain_state):.3g}"
            )
        result(f"transformer deterministic algorithms, {shape}: {verdict}; step time ratio {our_s / plain_s:.3f} "
               f"(gsync {our_s * 1e3:.2f} ms, plain {plain_s * 1e3:.2f} ms)")
        nondeterministic = sorted({str(w.message).split("\n")[0][:160] for w in caught if "deterministic" in str(w.message)})
        if nondeterministic:
            note(f"torch warned of operations without a deterministic implementation: {nondeterministic[:4]}")

    def step_time() -> None:
        first = plain()[2]
        if cuda:
            torch.cuda.empty_cache()
        mine = ours()[2]
        second = plain()[2]
        baseline = (first + second) / 2
        ratio = mine / baseline
        result(
            f"transformer step time, {shape}: gsync {mine * 1e3:.2f} ms/step (median), plain loop {baseline * 1e3:.2f} ms "
            f"(loss.item() every step; runs {first * 1e3:.2f} / {second * 1e3:.2f}), ratio {ratio:.3f} "
            f"(target <= 1.03: {'PASS' if ratio <= 1.03 else 'ABOVE TARGET'})"
        )

    guarded("transformer deterministic", deterministic)
    if cuda:
        torch.cuda.empty_cache()
    guarded("transformer step time", step_time)


# ------------------------------------------------------------------------------------------------
# launch: torchrun and an elastic world of one
# ------------------------------------------------------------------------------------------------


def _torchrun(processes: int, timeout: float) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "examples/train_mlp.py", "--epochs", "1",
    ]
    print("   $ torchrun " + " ".join(command[3:]), flush=True)
    label = f"launch torchrun --nproc-per-node {processes} examples/train_mlp.py --epochs 1"
    try:
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result(f"{label}: FAILED still running after {timeout:.0f} s (killed)")
        return
    output = completed.stdout + completed.stderr
    print("\n".join("   | " + line for line in output.rstrip().splitlines()[-25:]), flush=True)
    trained_on = next((line for line in output.splitlines() if line.startswith("training on ")), "")
    finished = next((line for line in output.splitlines() if " steps in " in line), "")
    want = "cpu" if rehearsal() else "cuda"
    ok = completed.returncode == 0 and want in trained_on and bool(finished)
    status = "PASS" if ok else f"FAILED (exit {completed.returncode})"
    result(f"{label}: {status}: {trained_on or 'no training line'}; {finished or 'no result line'}")


def _elastic_world_of_one() -> None:
    import torch.distributed as dist

    import gsync
    from tests.support.plain_loop import train_steps

    device = main_device()
    batches = exactness_batches()
    initial = exactness_model()
    reference = copy.deepcopy(initial).to(device)
    train_steps(reference, sgd(list(reference.parameters())), [(x.to(device), y.to(device)) for x, y in batches], ce_loss)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", TORCHELASTIC_RUN_ID=f"gpu-check-{os.getpid()}")
    engine = gsync.Engine([device], elastic=True, store=store, sync_timeout=60)
    fitted = asyncio.run(engine.fit(copy.deepcopy(initial), batches, optimizer=sgd, loss_fn=ce_loss, progress=False))
    diff = max_param_diff(fitted.model, reference)
    ok = diff <= 1e-5 and len(fitted.losses) == len(batches) and not fitted.membership
    result(
        f"launch Engine(elastic=True, store=TCPStore) on {device}, a world of one: {'PASS' if ok else 'FAILED'} "
        f"max |param diff| vs the plain loop = {diff:.3g} (tolerance 1e-05), steps {len(fitted.losses)}, "
        f"membership changes {list(fitted.membership)}"
    )


def part_launch() -> None:
    guarded("launch torchrun 1", lambda: _torchrun(1, 40))
    if gate("launch torchrun --nproc-per-node 2 (multi-process NCCL)", gpu_count()):
        guarded("launch torchrun 2", lambda: _torchrun(2, 40))
    guarded("launch elastic world of one", _elastic_world_of_one)


# ------------------------------------------------------------------------------------------------
# multiproc: the process-group path on CUDA tensors
# ------------------------------------------------------------------------------------------------

GLOO_ON_CUDA_CAVEAT = (
    "gloo on CUDA tensors is a check of the process-group path, not a way to train: each bucket is copied to "
    "the host and back and the communication thread waits for it; and gsync takes CUDA tensors to mean NCCL, "
    "whose waits are stream-ordered, so it waits on gloo's CUDA work unsliced, where the run's abort flag "
    "cannot reach it (a dead peer holds the thread until gloo's timeout). See docs/gpus.md."
)


def _run_ranks(config: dict[str, Any], devices: list[str], timeout: float, store_port: int | None = None) -> tuple[list[dict[str, Any] | None], list[int | None]]:
    """Start one ``tools/gpu_ranks.py`` process per device with torchrun's environment; their outcomes and exit codes.

    ``store_port``: the ranks join the store the caller hosts there, as torchrun's workers join its agent's.
    """
    import torch

    port = store_port if store_port is not None else free_port()
    with tempfile.TemporaryDirectory(prefix="gsync-gpu-check-") as folder:
        outs = [os.path.join(folder, f"rank{rank}.pt") for rank in range(len(devices))]
        processes = []
        for rank, device in enumerate(devices):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(devices)),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"gpu-check-{os.getpid()}",
            )
            if store_port is not None:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            rank_config = json.dumps(dict(config, device=device))
            processes.append(
                subprocess.Popen([sys.executable, "-m", "tools.gpu_ranks", rank_config, outs[rank]], cwd=ROOT, env=env)
            )
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
                codes.append(None)
        outcomes = [torch.load(out) if os.path.exists(out) else None for out in outs]
    return outcomes, codes


def _describe_ranks(outcomes: list[dict[str, Any] | None], codes: list[int | None]) -> str:
    parts = []
    for rank, (outcome, code) in enumerate(zip(outcomes, codes)):
        if code is None:
            parts.append(f"rank {rank} timed out (killed)")
        elif outcome is None:
            parts.append(f"rank {rank} exited {code} without a result")
        elif not outcome["ok"]:
            parts.append(f"rank {rank} raised {outcome['error'][:200]}")
    return "; ".join(parts)


def part_multiproc() -> None:
    import gsync

    device = main_device()
    gpus = gpu_count()
    steps = 6
    batches = exactness_batches(steps)
    initial = exactness_model()
    one_process: list[Any] = []

    def reference() -> Any:
        # gsync in one process on one device, over the same global batches: what the ranks together must give.
        if not one_process:
            engine = gsync.Engine([device], sync_timeout=60)
            fitted = asyncio.run(engine.fit(copy.deepcopy(initial), batches, optimizer=sgd, loss_fn=ce_loss, progress=False))
            one_process.append({name: p.detach().cpu() for name, p in fitted.model.named_parameters()})
        return one_process[0]

    def compare(label: str, config: dict[str, Any], devices: list[str], caveat: str | None = None) -> None:
        outcomes, codes = _run_ranks(dict(config, steps=steps), devices, timeout=35)
        failed = _describe_ranks(outcomes, codes)
        if failed:
            for outcome in outcomes:
                if outcome is not None and not outcome["ok"]:
                    print(outcome["traceback"], flush=True)
            result(f"{label}: FAILED {failed}")
            return
        expected = reference()
        diffs = [max_param_diff({k: v for k, v in o["state"].items() if k in expected}, expected) for o in outcomes if o]
        ok = max(diffs) <= 1e-5 and all(len(o["losses"]) == steps for o in outcomes if o)
        result(f"{label}: {'PASS' if ok else 'FAILED'} max |param diff| vs one process = {max(diffs):.3g} (tolerance 1e-05), "
               f"{steps} steps on each rank")
        if caveat:
            note(caveat)

    shared = f"multiproc gloo, two processes sharing {device} (process_group=a gloo group)"
    guarded("multiproc gloo", lambda: compare(shared, {"mode": "gloo"}, [device, device], GLOO_ON_CUDA_CAVEAT))
    pair = ["cpu", "cpu"] if rehearsal() else ["cuda:0", "cuda:1"]
    if gate("multiproc NCCL, two processes on two GPUs", gpus):
        guarded("multiproc NCCL", lambda: compare("multiproc NCCL, two processes on two GPUs", {"mode": "env"}, pair))
    if gate("multiproc elastic NCCL, a rank SIGKILLed mid-run", gpus):
        guarded("multiproc elastic NCCL", lambda: _elastic_kill(pair))


def _elastic_kill(devices: list[str]) -> None:
    import torch.distributed as dist

    from tests.support.plain_loop import train_steps

    label = "multiproc elastic NCCL, a rank SIGKILLed mid-run"
    steps, die = 8, 3
    batches = exactness_batches(steps)
    device = devices[0]
    reference = exactness_model().to(device)
    train_steps(reference, sgd(list(reference.parameters())), [(x.to(device), y.to(device)) for x, y in batches], ce_loss)
    expected = {name: p.detach().cpu() for name, p in reference.named_parameters()}
    # Hosted here, outside the ranks, as torchrun's agent hosts it: losing a rank must not lose the store.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outcomes, codes = _run_ranks({"mode": "elastic", "steps": steps, "die": die}, devices, 45, store.port)
    survivor = outcomes[0]
    if codes[1] != -signal.SIGKILL or survivor is None or not survivor["ok"]:
        if survivor is not None and not survivor["ok"]:
            print(survivor["traceback"], flush=True)
        result(f"{label}: FAILED rank 1 exit {codes[1]} (expected {-signal.SIGKILL}); {_describe_ranks(outcomes[:1], codes[:1]) or 'rank 0 no result'}")
        return
    diff = max_param_diff({k: v for k, v in survivor["state"].items() if k in expected}, expected)
    ok = diff <= 1e-5 and len(survivor["membership"]) == 1 and survivor["membership"][0][1] == (1,)
    result(f"{label}: {'PASS' if ok else 'FAILED'} rank 0 went on alone: max |param diff| vs the uninterrupted plain loop "
           f"= {diff:.3g} (tolerance 1e-05), membership changes {survivor['membership']}")
