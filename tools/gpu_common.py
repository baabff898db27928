"""What the GPU check's parts share: the RESULT lines, guarded sub-checks, the checks that need several GPUs, the
rehearsal switch, step timing and the small exactness model.

Imports nothing heavy at module level: ``gpu_check.py --help`` and ``--plan`` run without torch.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
REHEARSAL_ENV = "GSYNC_GPU_CHECK_REHEARSAL"
"""Set by ``gpu_check.py --rehearse`` for its parts: they run on the CPU at toy sizes, to check the script itself."""


def result(line: str) -> None:
    print(RESULT + line, flush=True)


def note(line: str) -> None:
    """Context for the RESULT line above it (where something was seen, what a figure includes); not repeated in the summary."""
    print(f"   note: {line}", flush=True)


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


def rehearsal() -> bool:
    """Whether this part runs as a rehearsal on the CPU (``--rehearse``): toy sizes, CPU devices, no CUDA calls."""
    return os.environ.get(REHEARSAL_ENV) == "1"


def main_device() -> str:
    return "cpu" if rehearsal() else "cuda:0"


def gpu_count() -> int:
    """CUDA devices visible to this process; none in a rehearsal."""
    if rehearsal():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Gate:
    """A check of ``part`` that needs ``gpus`` GPUs: printed as ``label: SKIPPED (...)`` on a machine with fewer."""

    part: str
    label: str
    gpus: int


GATES: dict[str, Gate] = {
    gate.label: gate
    for gate in (
        Gate("exactness", "exactness ['cuda:0', 'cuda:1']", 2),
        Gate("exactness", "exactness recipes on 2 GPUs (NCCL: complex on the wire, BatchNorm buffers broadcast)", 2),
        Gate("bandwidth", "bandwidth NcclCollective vs bare NCCL", 2),
        Gate("loop", "loop held session on every GPU (several GPUs in one process)", 2),
        Gate("launch", "launch torchrun --nproc-per-node 2 (multi-process NCCL)", 2),
        Gate("multiproc", "multiproc NCCL, two processes on two GPUs", 2),
        Gate("multiproc", "multiproc elastic NCCL, a rank SIGKILLed mid-run", 2),
    )
}
"""Every check that needs more than one GPU, by the label of its RESULT line: ``--plan`` lists them."""


def skip_reason(needed: int, gpus: int) -> str | None:
    if gpus >= needed:
        return None
    machine = "the CPU rehearsal has none" if rehearsal() else f"this machine has {gpus}"
    return f"needs {needed} GPUs, {machine}"


def gate(label: str, gpus: int) -> bool:
    """Whether the check ``label`` (one of :data:`GATES`) can run with ``gpus`` GPUs; prints its SKIPPED line if not.

    A rehearsal runs every gated check whose part has a CPU stand-in for it (CPU devices, gloo for NCCL).
    """
    gated = GATES[label]
    if rehearsal():
        return True
    reason = skip_reason(gated.gpus, gpus)
    if reason is not None:
        result(f"{label}: SKIPPED ({reason})")
    return reason is None


def on_path() -> None:
    """The repository root on ``sys.path`` (a script run as ``python tools/x.py`` has ``tools/`` there instead)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class Timed:
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


def exactness_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def exactness_batches(steps: int = 6, rows: int = 64) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 32, generator=generator), torch.randint(0, 10, (rows,), generator=generator)) for _ in range(steps)]


def sgd(params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def ce_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(batch[0]), batch[1])


def max_param_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two modules' parameters (or two state dicts), on the CPU."""
    first = a if isinstance(a, dict) else dict(a.named_parameters())
    second = b if isinstance(b, dict) else dict(b.named_parameters())
    return max(((value.detach().cpu() - second[name].detach().cpu()).abs().max().item() for name, value in first.items()), default=0.0)
