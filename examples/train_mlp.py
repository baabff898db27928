"""Train a small MLP classifier with gsync: the quick-start job.

    python examples/train_mlp.py                   # 2 virtual CPU devices (or every GPU)
    python examples/train_mlp.py --devices cpu:0 cpu:1 cpu:2
    torchrun --nproc-per-node 2 examples/train_mlp.py   # one device per process

The data is a synthetic, learnable task (labels from a fixed random teacher
network), made here so the example needs no download.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import gsync


def make_dataset(rows: int, features: int, classes: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=generator)
    x = torch.randn(rows, features, generator=generator)
    y = (x @ teacher + 0.5 * torch.randn(rows, classes, generator=generator)).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class EpochLines:
    """A fit callback: one line per epoch, printed as the epoch ends, from the losses of its steps."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.losses: list[float] = []

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        self.losses.append(result.loss)

    def on_epoch_end(self, session: gsync.Session, epoch: int) -> None:
        losses, self.losses = self.losses, []
        if self.show and losses:
            # tqdm.write keeps the progress bar (on stderr) below the lines instead of writing through it.
            tqdm.write(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.4f} (first {losses[0]:.4f}, last {losses[-1]:.4f})")
            sys.stdout.flush()  # seen as it happens when stdout is a pipe (| tee, a CI log) too


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=None, help="default: every GPU, else cpu:0 cpu:1")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    dataset = make_dataset(rows=8192, features=64, classes=10)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    devices = args.devices
    if devices is None and not torch.cuda.is_available() and not under_torchrun:
        devices = ["cpu:0", "cpu:1"]
    engine = gsync.Engine(devices)  # under torchrun: this process's device, synchronized with the others
    main_process = int(os.environ.get("RANK", "0")) == 0
    say = print if main_process else (lambda *_: None)
    say(f"training on {[d.name for d in engine.devices]} per process, {sum(p.numel() for p in model.parameters()):,} parameters")

    started = time.perf_counter()
    result = await engine.fit(
        model,
        loader,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        loss_fn=loss_fn,
        epochs=args.epochs,
        callbacks=[EpochLines(show=main_process)],
    )
    elapsed = time.perf_counter() - started

    with torch.no_grad():
        x, y = dataset.tensors
        accuracy = (result.model(x).argmax(dim=1) == y).float().mean().item()
    say(f"{len(result.losses)} steps in {elapsed:.2f} s; training accuracy {accuracy:.1%}")


if __name__ == "__main__":
    asyncio.run(main())
