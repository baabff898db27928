"""One script to run on a GPU machine: everything we need to know about gsync's CUDA path, in < 8 minutes.

    python tools/gpu_check.py                  # every part, within --budget seconds (default 450)
    python tools/gpu_check.py --only tests,exactness

Parts, each in its own subprocess with its own timeout, so a hang or a crash in
one prints a FAILED line and the next part still runs; within a part each
check is guarded and timed on its own:

  versions    torch / CUDA / NCCL versions, GPU names
  tests       python -m pytest -q tests/unit/streams tests/unit/transports tests/unit/comm/test_*conformance.py
              tests/unit/step/test_readout.py tests/unit/test_cuda_desk_check.py
  exactness   gsync.Engine(["cuda:0"]) vs a plain one-GPU loop; then recipes (BatchNorm, accumulation,
              fp16 + GradScaler, clipping, a complex parameter, a model with its own side stream) on 1 GPU
              (and 2) vs gsync on as many CPU devices (which the CPU suite ties to plain PyTorch); and a
              checkpoint and resume on CUDA (dropout: the CUDA generator too) vs the same steps straight
  steptime    one GPU: median step time of gsync vs a plain PyTorch loop (MLP 4096 x 8, fp32 and bf16 autocast)
  bandwidth   >= 2 GPUs: NcclCollective vs bare torch.cuda.nccl.all_reduce; on one GPU: host cost per bucket

One GPU checks gsync's streams, events, readouts and a one-device run; NCCL
between GPUs (complex tensors on the wire, two-device exactness, bandwidth)
needs two. docs/gpus.md says which result means what.

Every result is also printed as a ``RESULT`` line and repeated in the summary at the end.
The repository root is put on PYTHONPATH, so gsync need not be installed (the plain loop
is the tests' own, ``tests/support/plain_loop.py``); it needs
msgspec and anyio (and pytest-asyncio for the test config), which the script checks first.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ("main",)

ROOT = Path(__file__).resolve().parent.parent
PARTS: dict[str, float] = {  # part -> timeout in seconds; the sum stays under the default budget
    "versions": 30,
    "tests": 120,
    "exactness": 140,
    "steptime": 110,
    "bandwidth": 45,
}
TEST_FILES = (
    "tests/unit/streams",
    "tests/unit/transports",
    "tests/unit/comm/test_conformance.py",
    "tests/unit/comm/test_nccl_conformance.py",
    "tests/unit/step/test_readout.py",
    "tests/unit/test_cuda_desk_check.py",
)
RESULT = "RESULT "


def result(line: str) -> None:
    print(RESULT + line, flush=True)


def guarded(name: str, fn: Callable[[], None]) -> None:
    """Run one sub-check; a failure prints FAILED with the exception and the run goes on."""
    started = time.perf_counter()
    try:
        fn()
    except BaseException as error:  # noqa: BLE001 - reported, then the next sub-check runs
        if isinstance(error, KeyboardInterrupt):
            raise
        traceback.print_exc()
        result(f"{name}: FAILED {type(error).__name__}: {error}".replace("\n", " ")[:400])
    finally:
        print(f"   ({name} took {time.perf_counter() - started:.1f} s)", flush=True)


# ------------------------------------------------------------------------------------------------
# Parent: runs each part in a subprocess with a timeout
# ------------------------------------------------------------------------------------------------


def preflight() -> list[str]:
    """Packages gsync needs that are missing here, with a hint; imports nothing heavy."""
    missing = [name for name in ("torch", "msgspec", "anyio", "pytest") if importlib.util.find_spec(name) is None]
    for name in missing:
        result(f"preflight: FAILED python package {name!r} is missing")
    if missing:
        print(
            "   carry wheels for the missing packages (Python "
            f"{sys.version_info.major}.{sys.version_info.minor}), e.g. msgspec and pytest-asyncio, and install them "
            "with pip install --no-index --target /tmp/site, then PYTHONPATH=/tmp/site",
            flush=True,
        )
    return missing


def run_part(name: str, timeout: float, summary: list[str]) -> None:
    print(f"\n===== {name} (timeout {timeout:.0f} s) =====", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--part", name],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout kills the part's own children too
    )

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            if line.startswith(RESULT):
                summary.append(line[len(RESULT) :].rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(timeout=5)
        line = f"{name}: FAILED timed out after {timeout:.0f} s (killed)"
        print(RESULT + line, flush=True)
        summary.append(line)
        return
    reader.join(timeout=5)
    took = time.perf_counter() - started
    if code != 0:
        line = f"{name}: FAILED exit code {code} after {took:.1f} s"
        print(RESULT + line, flush=True)
        summary.append(line)
    else:
        print(f"   ({name} finished in {took:.1f} s)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    args = parser.parse_args(argv)
    if args.part:
        PART_FUNCTIONS[args.part]()
        return 0

    deadline = time.monotonic() + args.budget
    print(f"gsync GPU check: {time.strftime('%Y-%m-%d %H:%M:%S')}, python {sys.version.split()[0]}, root {ROOT}")
    summary: list[str] = []
    if preflight():
        summary.append("preflight: FAILED missing packages (see above)")
    for name in [p.strip() for p in args.only.split(",") if p.strip()]:
        if name not in PARTS:
            summary.append(f"{name}: FAILED unknown part (choose from {', '.join(PARTS)})")
            continue
        left = deadline - time.monotonic()
        if left < 10:
            summary.append(f"{name}: SKIPPED budget spent")
            continue
        run_part(name, min(PARTS[name], left), summary)
    print("\n===== summary =====")
    for line in summary:
        print(line)
    failed = sum("FAILED" in line for line in summary)
    print(f"{failed} failure line(s); total {args.budget - (deadline - time.monotonic()):.0f} s")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------
# Parts (each runs in its own process)
# ------------------------------------------------------------------------------------------------


def part_versions() -> None:
    import torch

    result(f"versions: torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
    try:
        import torch.cuda.nccl

        result(f"versions: NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    except Exception as error:  # noqa: BLE001 - a build without NCCL is a result, not a crash
        result(f"versions: NCCL unavailable ({type(error).__name__}: {error})")
    if not torch.cuda.is_available():
        result("versions: FAILED torch.cuda.is_available() is False")
        return
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        result(
            f"versions: cuda:{index} {props.name}, {props.total_memory / 2**30:.0f} GiB, "
            f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs"
        )
    result(f"versions: torch.cuda._sleep {'available' if hasattr(torch.cuda, '_sleep') else 'MISSING (some tests skip)'}")


def part_tests() -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TEST_FILES]
    if importlib.util.find_spec("pytest_asyncio") is None:
        # pyproject's asyncio_* options are unknown without the plugin, and config warnings are errors.
        command[3:3] = ["-W", "ignore::pytest.PytestConfigWarning"]
        print("   pytest-asyncio is not installed: ignoring its config options (these tests need no event loop)")
    print("   $ " + " ".join(command[1:]), flush=True)
    try:
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=PARTS["tests"] - 15)
    except subprocess.TimeoutExpired as expired:
        partial = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        print("\n".join(partial.rstrip().splitlines()[-60:]), flush=True)
        result(f"tests: FAILED pytest still running after {expired.timeout:.0f} s (killed); output so far above")
        return
    lines = (completed.stdout + completed.stderr).rstrip().splitlines()
    print("\n".join(lines[-60:]), flush=True)
    tail = lines[-1] if lines else "(no output)"
    status = "PASS" if completed.returncode == 0 else f"FAILED (pytest exit {completed.returncode})"
    result(f"tests: {status}: {tail}")


def _exactness_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _sgd(params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _ce_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(batch[0]), batch[1])


def _recipe_models() -> dict[str, Callable[[], Any]]:
    """Models for the recipe runs, each built from seed 0 (deep-copied per run, so their devices differ)."""
    import torch
    from torch import nn

    side_streams: dict[Any, Any] = {}

    class SideStreamNet(nn.Module):
        """Part of forward on a stream of its own, as a user's overlap trick would: its gradients' hooks run there."""

        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(32, 256)
            self.side = nn.Linear(256, 256)
            self.head = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            if not x.is_cuda:
                return self.head(torch.tanh(self.side(h)) + h)
            current = torch.cuda.current_stream(x.device)
            stream = side_streams.setdefault(x.device, torch.cuda.Stream(x.device))
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                s = torch.tanh(self.side(h))
            current.wait_stream(stream)
            s.record_stream(current)
            return self.head(s + h)

    class ComplexNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(32, 64)
            self.mix = nn.Parameter(torch.randn(64, dtype=torch.complex64) * 0.5 + 1)
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head((self.first(x) * self.mix).abs())

    def seeded(build: Callable[[], Any]) -> Callable[[], Any]:
        def make() -> Any:
            torch.manual_seed(0)
            return build()

        return make

    return {
        "batchnorm": seeded(lambda: nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Linear(256, 10))),
        "complex": seeded(ComplexNet),
        "side-stream": seeded(SideStreamNet),
        "dropout": seeded(lambda: nn.Sequential(nn.Linear(32, 256), nn.Dropout(0.2), nn.Tanh(), nn.Linear(256, 10))),
    }


def part_exactness() -> None:
    import torch

    import gsync
    from tests.support.plain_loop import train_steps

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)) for _ in range(6)]
    initial = _exactness_model()
    cached: list[tuple[dict[str, Any], list[float]]] = []
    gpus = torch.cuda.device_count()

    def plain_reference() -> tuple[dict[str, Any], list[float]]:
        if not cached:
            reference = copy.deepcopy(initial).to("cuda:0")
            on_gpu = [(x.to("cuda:0"), y.to("cuda:0")) for x, y in batches]
            losses = train_steps(reference, _sgd(list(reference.parameters())), on_gpu, _ce_loss)
            cached.append(({name: p.detach().cpu() for name, p in reference.named_parameters()}, losses))
        return cached[0]

    def check(devices: list[str], tolerance: float) -> None:
        expected, reference_losses = plain_reference()
        model = copy.deepcopy(initial)
        engine = gsync.Engine(devices, sync_timeout=60)
        fitted = asyncio.run(engine.fit(model, batches, optimizer=_sgd, loss_fn=_ce_loss, progress=False))
        diff = max((p.detach().cpu() - expected[name]).abs().max().item() for name, p in fitted.model.named_parameters())
        loss_diff = max(abs(a - b) for a, b in zip(fitted.losses, reference_losses))
        status = "PASS" if diff <= tolerance and len(fitted.losses) == len(batches) else "FAILED"
        result(
            f"exactness {devices}: {status} max |param diff| = {diff:.3g} (tolerance {tolerance:g}), "
            f"max |loss diff| = {loss_diff:.3g}, steps = {len(fitted.losses)}"
        )

    def fit(devices: list[str], model: Any, data: list[Any], **recipe: Any) -> Any:
        engine = gsync.Engine(devices, sync_timeout=60)
        return asyncio.run(
            engine.fit(copy.deepcopy(model), data, optimizer=_sgd, loss_fn=_ce_loss, progress=False, **recipe)
        )

    def state_diff(a: Any, b: Any) -> float:
        theirs = b.state_dict()
        return max(
            ((value.detach().cpu() - theirs[name].detach().cpu()).abs().max().item() for name, value in a.state_dict().items()
             if value.is_floating_point() or value.is_complex()),
            default=0.0,
        )

    def recipe_run(label: str, n: int, model: Any, tolerance: float, **recipe: Any) -> None:
        on_cpu = fit([f"cpu:{i}" for i in range(n)], model, batches, **recipe)
        on_gpu = fit([f"cuda:{i}" for i in range(n)], model, batches, **recipe)
        diff = state_diff(on_gpu.model, on_cpu.model)
        loss_diff = max(abs(a - b) for a, b in zip(on_gpu.losses, on_cpu.losses))
        same_skips = on_gpu.skipped_steps == on_cpu.skipped_steps
        ok = diff <= tolerance and len(on_gpu.losses) == len(on_cpu.losses) and same_skips
        result(
            f"exactness {label} on {n} GPU(s) vs {n} CPU device(s): {'PASS' if ok else 'FAILED'} max |state diff| = "
            f"{diff:.3g} (tolerance {tolerance:g}), max |loss diff| = {loss_diff:.3g}, skipped {on_gpu.skipped_steps} "
            f"(CPU {on_cpu.skipped_steps})"
        )

    def resume_run() -> None:
        model = _recipe_models()["dropout"]()
        # Both runs start from the same generators; the resumed one must take them from the checkpoint.
        torch.manual_seed(7)
        straight = fit(["cuda:0"], model, batches)
        torch.manual_seed(7)
        first = fit(["cuda:0"], model, batches[:3])
        torch.manual_seed(8)  # anything else: what the resumed run draws must come from the checkpoint
        if first.checkpoint is None:
            raise AssertionError("fit returned no checkpoint")
        resumed = fit(["cuda:0"], model, batches, resume=first.checkpoint)
        diff = state_diff(resumed.model, straight.model)
        loss_diff = max(abs(a - b) for a, b in zip(resumed.losses, straight.losses[3:]))
        ok = diff <= 1e-6 and resumed.first_step == 3 and len(resumed.losses) == len(batches) - 3
        result(
            f"exactness checkpoint and resume on cuda:0 (dropout): {'PASS' if ok else 'FAILED'} max |state diff| vs "
            f"straight = {diff:.3g}, max |loss diff| = {loss_diff:.3g}, resumed at step {resumed.first_step}"
        )

    guarded("exactness 1 GPU", lambda: check(["cuda:0"], 1e-5))
    if gpus >= 2:
        guarded("exactness 2 GPUs", lambda: check(["cuda:0", "cuda:1"], 1e-4))
    else:
        result(f"exactness ['cuda:0', 'cuda:1']: SKIPPED ({gpus} GPU)")
    models = _recipe_models()
    recipes: list[tuple[str, Any, float, dict[str, Any]]] = [
        ("batchnorm", models["batchnorm"](), 1e-4, {}),
        ("accumulate=2", initial, 1e-4, {"accumulate": 2}),
        ("clip_grad_norm=0.5", initial, 1e-4, {"clip_grad_norm": 0.5}),
        ("fp16 + GradScaler", initial, 5e-3, {"autocast": torch.float16}),
        ("complex parameter", models["complex"](), 1e-4, {}),
        ("side-stream model", models["side-stream"](), 1e-4, {}),
    ]
    for n in [1, 2] if gpus >= 2 else [1]:
        for label, model, tolerance, recipe in recipes:
            guarded(f"exactness {label} {n} GPU(s)", lambda l=label, m=model, t=tolerance, r=recipe, k=n: recipe_run(l, k, m, t, **r))  # type: ignore[misc]
    if gpus < 2:
        result("exactness recipes on 2 GPUs (NCCL: complex on the wire, BatchNorm buffers broadcast): SKIPPED (1 GPU)")
    guarded("exactness checkpoint and resume", resume_run)


class _Timed:
    """Re-iterable batches that stamp the time each one is taken: the spacing is the step time."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.stamps: list[float] = []

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.stamps.append(time.perf_counter())
            yield batch

    def median_step(self, warmup: int) -> float:
        stamps = self.stamps[warmup:]
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def part_steptime() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import gsync
    from tests.support.plain_loop import train_steps

    warmup, steps = 10, 50

    def run(label: str, batch_rows: int, autocast: bool) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(4096, 4096), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(4096, 1000))
        device = torch.device("cuda:0")
        distinct = [
            (torch.randn(batch_rows, 4096, device=device), torch.randint(0, 1000, (batch_rows,), device=device))
            for _ in range(4)
        ]
        batches = [distinct[i % len(distinct)] for i in range(warmup + steps)]

        def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                return F.cross_entropy(m(batch[0]), batch[1])

        def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=1e-4, momentum=0.9)

        def plain(sync_every_step: bool) -> float:
            replica = copy.deepcopy(model).to(device)
            data = _Timed(batches)
            begin = [time.perf_counter()]

            def before_step(index: int) -> None:
                if index == warmup:
                    torch.cuda.synchronize()
                    begin[0] = time.perf_counter()

            train_steps(replica, optimizer(list(replica.parameters())), data, loss_fn, read_loss=sync_every_step,
                        before_step=before_step)
            torch.cuda.synchronize()
            end = time.perf_counter()
            del replica
            return data.median_step(warmup) if sync_every_step else (end - begin[0]) / (len(batches) - warmup)

        def with_gsync() -> float:
            data = _Timed(batches)
            engine = gsync.Engine(["cuda:0"], sync_timeout=60)
            asyncio.run(engine.fit(copy.deepcopy(model), data, optimizer=optimizer, loss_fn=loss_fn))
            return data.median_step(warmup)

        params = sum(p.numel() for p in model.parameters())
        print(f"   {label}: MLP 4096 x 8 + head ({params / 1e6:.0f} M params), batch {batch_rows}", flush=True)
        plain_first = plain(sync_every_step=True)
        ours = with_gsync()
        plain_second = plain(sync_every_step=True)
        pipelined = plain(sync_every_step=False)
        baseline = (plain_first + plain_second) / 2
        ratio = ours / baseline
        status = "PASS" if ratio <= 1.03 else "ABOVE TARGET"
        result(
            f"steptime {label}: gsync {ours * 1e3:.2f} ms/step (median), plain loop {baseline * 1e3:.2f} ms "
            f"(loss.item() every step, as gsync records losses; runs {plain_first * 1e3:.2f} / {plain_second * 1e3:.2f}), "
            f"ratio {ratio:.3f} (target <= 1.03: {status}); plain without per-step sync {pipelined * 1e3:.2f} ms "
            f"(ratio {ours / pipelined:.3f})"
        )

    guarded("steptime fp32", lambda: run("fp32", 1024, autocast=False))
    torch.cuda.empty_cache()
    guarded("steptime bf16-autocast", lambda: run("bf16 autocast", 4096, autocast=True))


def part_bandwidth() -> None:
    import torch
    import torch.cuda.nccl

    from gsync._core.transports.nccl import NcclCollective
    from gsync._core.streams import CudaStreamSync

    count = torch.cuda.device_count()
    devices = [torch.device("cuda", i) for i in range(count)]

    def synchronize() -> None:
        # torch.cuda.synchronize() waits for the current device only: another device's last bare all-reduce
        # could still run when gsync's starts on the same communicator, which NCCL leaves undefined.
        for device in devices:
            torch.cuda.synchronize(device)

    def host_cost() -> None:
        # Per-bucket host time of the stream protocol plus the collective, nothing waited on.
        sync = CudaStreamSync(devices, 1)
        collective = NcclCollective(devices, sync)
        tensors = [torch.ones(1 << 18, device=d) for d in devices]
        weights = [1.0 / count] * count
        synchronize()
        iterations = 2000
        started = time.perf_counter()
        for _ in range(iterations):
            for device in range(count):
                sync.mark_ready(device, 0)
            sync.before_reduce(0)
            with sync.comm_streams():
                collective.all_reduce(tensors, weights)
            sync.after_reduce(0)
            for device in range(count):
                sync.before_apply(device)
        host = (time.perf_counter() - started) / iterations
        synchronize()
        sync.close()
        result(f"bandwidth host cost: {host * 1e6:.1f} us per bucket on {count} GPU(s) (marks, waits, scale, collective launch)")

    guarded("bandwidth host cost", host_cost)
    if count < 2:
        result("bandwidth NcclCollective vs bare NCCL: SKIPPED (needs >= 2 GPUs)")
        return

    def compare(mib: int, dtype: torch.dtype) -> None:
        numel = mib * 2**20 // torch.empty((), dtype=dtype).element_size()
        tensors = [torch.ones(numel, dtype=dtype, device=d) for d in devices]
        streams = [torch.cuda.Stream(device=d) for d in devices]
        sync = CudaStreamSync(devices, 1)
        collective = NcclCollective(devices, sync)
        weights = [1.0 / count] * count
        synchronize()

        def timed(step: Callable[[], None], iterations: int = 20) -> float:
            for _ in range(3):
                step()
            synchronize()
            started = time.perf_counter()
            for _ in range(iterations):
                step()
            synchronize()
            return (time.perf_counter() - started) / iterations

        def bare() -> None:
            torch.cuda.nccl.all_reduce(tensors, streams=streams)

        def ours() -> None:
            with sync.comm_streams():
                collective.all_reduce(tensors, weights)

        bare_s, ours_s = timed(bare), timed(ours)
        sync.close()
        bus = 2 * (count - 1) / count * mib * 2**20
        result(
            f"bandwidth {mib} MiB {str(dtype).removeprefix('torch.')} x {count} GPUs: bare NCCL {bare_s * 1e3:.3f} ms "
            f"({bus / bare_s / 1e9:.0f} GB/s bus), NcclCollective {ours_s * 1e3:.3f} ms ({bus / ours_s / 1e9:.0f} GB/s bus), "
            f"ratio {ours_s / bare_s:.3f}"
        )

    for mib, dtype in ((1, torch.float32), (25, torch.float32), (100, torch.float32), (25, torch.bfloat16)):
        guarded(f"bandwidth {mib} MiB {dtype}", lambda m=mib, d=dtype: compare(m, d))  # type: ignore[misc]


PART_FUNCTIONS: dict[str, Callable[[], None]] = {
    "versions": part_versions,
    "tests": part_tests,
    "exactness": part_exactness,
    "steptime": part_steptime,
    "bandwidth": part_bandwidth,
}


if __name__ == "__main__":
    sys.exit(main())
