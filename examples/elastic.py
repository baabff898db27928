"""An elastic run that survives a ``kill -9`` of one of its ranks, and takes it back when it is started again.

    python examples/elastic.py                 # 3 ranks on this machine; rank 1 is killed, then started again

Run this way, the script is its own launcher: it hosts the store (as torchrun's
agent or a scheduler would, so any rank may be lost), starts three ranks of
itself, sends one ``SIGKILL`` mid-run, starts it again with the same
environment, and prints what each rank saw. Each rank is the part below
``train``: an ordinary ``engine.fit`` with ``elastic=True``. To run the ranks
yourself, start ``python examples/elastic.py --rank`` once per rank with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE=True`` set, against a store you host; and
``kill -9`` any of them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gsync

STEPS = 1500  # long enough that the rank started again is back before the others finish
KILLED, KILLED_AFTER = 1, 100  # rank 1 is killed once it has applied step 100


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 1, generator=generator)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(48, 16, generator=generator)
        batches.append((x, x @ teacher))
    return batches


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class Progress:
    """Tells the launcher how far this rank is (a store key per step), so it knows when to kill and restart."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        self.store.set(f"example/rank{self.rank}/step{result.step}", "applied")

    def on_membership_change(self, session: gsync.Session, change: gsync.MembershipChange) -> None:
        sys.stdout.write(f"rank {self.rank}: {change}; this rank is now {session.rank} of {session.world_size}\n")
        sys.stdout.flush()


async def train() -> None:
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    engine = gsync.Engine(["cpu"], elastic=True)
    result = await engine.fit(
        model,
        global_batches(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        loss_fn=loss_fn,
        callbacks=[Progress(store, rank)],
        progress=False,
    )
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    # One write per line: the three ranks share the launcher's stdout.
    sys.stdout.write(
        f"rank {rank}: trained steps {result.first_step}-{result.history[-1].step}, final loss {result.losses[-1]:.5f}, "
        f"parameter checksum {checksum:.6f}, membership changes: {len(result.membership)}\n"
    )
    sys.stdout.flush()


def launch() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), WORLD_SIZE="3",
               TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    def start(rank: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, __file__, "--rank"], env=dict(env, RANK=str(rank)))

    ranks = {rank: start(rank) for rank in range(3)}
    try:
        server.wait([f"example/rank{KILLED}/step{KILLED_AFTER}"])
        print(f"launcher: kill -9 rank {KILLED}", flush=True)
        ranks[KILLED].send_signal(signal.SIGKILL)
        ranks[KILLED].wait()
        print(f"launcher: starting rank {KILLED} again with the same environment", flush=True)
        ranks[KILLED] = start(KILLED)
        codes = {rank: process.wait(timeout=120) for rank, process in ranks.items()}
    finally:
        for process in ranks.values():
            if process.poll() is None:
                process.kill()
    if any(codes.values()):
        sys.exit(f"launcher: ranks exited with {codes}")
    print("launcher: every rank finished; equal checksums mean equal parameters", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", action="store_true", help="run one rank (the environment says which)")
    if parser.parse_args().rank:
        asyncio.run(train())
    else:
        launch()
