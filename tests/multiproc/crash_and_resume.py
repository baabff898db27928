"""A training script that checkpoints, dies once on purpose (SIGKILL), and resumes when started again.

    python crash_and_resume.py --dir CKPT --out FINAL.pt [--kill-at STEP --kill-rank R --marker FILE]

Run it twice with the same arguments, or once under ``torchrun --max-restarts 1``:
the first attempt SIGKILLs rank ``R`` right after step ``STEP`` (and leaves
``FILE`` behind so the next attempt does not); the next attempt resumes from
the newest checkpoint in ``CKPT``. Rank 0 saves the final parameters to ``FINAL.pt``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import torch

# Run as a script: the repository root on the path, so that it imports the tests' helpers as the tests do.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gsync  # noqa: E402
from tests.support.models import TiedNet, classification_loss, make_batches, sgd  # noqa: E402

STEPS = 12
EVERY = 2


def step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)


class KillOnce:
    def __init__(self, step: int | None, rank: int, marker: Path | None) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        if result.step == self.step and session.rank == self.rank and self.marker and not self.marker.exists():
            self.marker.write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--marker", type=Path, default=None)
    parser.add_argument("--devices", nargs="+", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TiedNet()
    engine = gsync.Engine(args.devices, sync_timeout=30)
    result = await engine.fit(
        model,
        make_batches(STEPS, 16),
        optimizer=sgd,
        loss_fn=classification_loss,
        scheduler=step_lr,
        checkpoint_dir=args.dir,
        checkpoint_every=EVERY,
        resume=args.dir,
        callbacks=[KillOnce(args.kill_at, args.kill_rank, args.marker)],
        progress=False,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": model.state_dict(), "first_step": result.first_step}, args.out)


if __name__ == "__main__":
    asyncio.run(main())
