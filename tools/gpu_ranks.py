"""One rank of the GPU check's multi-process runs: ``python -m tools.gpu_ranks CONFIG_JSON RESULT_PATH``.

The environment is torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), set by
``tools/gpu_parts.py``'s ``multiproc`` part. CONFIG: ``mode``, ``device``, ``steps``, and for ``"elastic"`` the
``die`` step at which rank 1 SIGKILLs itself. Modes:

- ``"gloo"``: the rank builds a gloo default group itself and gives it to gsync (``process_group=``), on a CUDA
  device another rank may share: gsync's process-group path with CUDA tensors and comm streams, on one GPU;
- ``"env"``: gsync joins from the environment, as under torchrun (NCCL for CUDA devices, gloo for the CPU);
- ``"elastic"``: ``Engine(elastic=True)`` on the store the part hosts (``TORCHELASTIC_USE_AGENT_STORE=True``).

The rank trains the GPU check's exactness model on its global batches and saves its parameters, losses and
membership changes, or the error it raised.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gsync  # noqa: E402
from tools.gpu_common import ce_loss, exactness_batches, exactness_model, sgd  # noqa: E402


def train(config: dict[str, Any]) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    mode = config["mode"]
    built_group = False
    if mode == "gloo":
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        built_group = True
        engine = gsync.Engine([config["device"]], process_group=dist.group.WORLD, sync_timeout=60)
    elif mode == "env":
        engine = gsync.Engine([config["device"]], sync_timeout=60)
    elif mode == "elastic":
        engine = gsync.Engine([config["device"]], elastic=gsync.Elastic(min_world_size=1, answer_within=1.0), sync_timeout=60)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    forward_passes = [0]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        forward_passes[0] += 1
        if mode == "elastic" and rank == 1 and forward_passes[0] == config["die"] + 1:
            # Dies in the forward pass of step `die`, as a process killed mid-step would.
            os.kill(os.getpid(), signal.SIGKILL)
        loss: torch.Tensor = ce_loss(model, batch)
        return loss

    try:
        model = exactness_model()
        fitted = asyncio.run(
            engine.fit(model, exactness_batches(config["steps"]), optimizer=sgd, loss_fn=loss_fn, progress=False)
        )
    finally:
        if built_group:
            dist.destroy_process_group()
    return {
        "state": {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()},
        "losses": list(fitted.losses),
        "membership": [(change.step, change.lost, change.world_size) for change in fitted.membership],
    }


def main() -> None:
    config, out = json.loads(sys.argv[1]), sys.argv[2]
    try:
        outcome: dict[str, Any] = {"ok": True, **train(config)}
    except BaseException as error:  # noqa: BLE001 - the part reads what this rank raised
        outcome = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    torch.save(outcome, out)


if __name__ == "__main__":
    main()
