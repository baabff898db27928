"""One rank of an elastic run, as the elastic tests start it: ``python elastic_job.py CONFIG_JSON RESULT_PATH``.

The environment is torchrun's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``: the test process hosts
the store, as torchrun's agent would). The rank trains :func:`model` on
:func:`global_batches` and saves what it ended with (or the error it raised).

CONFIG: ``steps``; ``mode`` (``"fit"`` or ``"loop"``: the user's own
``session.step`` loop); ``die`` (``{"rank", "step", "how"}``: that rank, in the
forward pass of that step, kills itself with ``SIGKILL``, stops with
``SIGSTOP``, or raises); ``wait_for_knock`` (``{"step"}``: after that step
every rank waits until a process has knocked, so a restarted rank is taken
in before the run ends); ``dies_opening`` (a rank that kills itself with
``SIGKILL`` as its first session opens, when the ranks exchange their
initial parameters); ``min_world_size``; ``answer_within``;
``evaluate_each_step`` (after every step, ``session.evaluate`` on
:func:`evaluation_batches`: a ``die`` at step k then strikes in the
evaluation after step k-1); ``idle_after`` (``{"step", "rank"}``, loop mode:
after that step, that rank kills itself outside any gsync call while the
others wait, idle, until the test sets :data:`IDLE_RELEASE_KEY`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from datetime import timedelta

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

import gsync
from gsync._core.elastic.quorum import run_scope
from gsync_pytest import gsync_threads
from tests.support.inside import replace_initial_broadcast

FEATURES = 6
ROWS = 12  # a global batch: 4 rows per rank on 3 ranks, 6 on 2, 3 on 4


class ForwardCount(nn.Module):
    """The identity, counting its training forwards in a buffer (as BatchNorm's ``num_batches_tracked`` does).

    A step interrupted after its forward moved the count on: a survivor that goes on with its own replica must
    put its buffers back as the last whole step left them, or it ends a step ahead of the uninterrupted run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.forwards.add_(1)
        return x


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1), ForwardCount())


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, FEATURES, generator=generator), torch.randn(ROWS, 1, generator=generator)) for _ in range(steps)]


LOCAL_ROWS = 36  # process-local data: a DistributedSampler over these, batches of 3 rows
LOCAL_BATCH = 3


def local_dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(
        torch.randn(LOCAL_ROWS, FEATURES, generator=generator), torch.randn(LOCAL_ROWS, 1, generator=generator)
    )


def reshard(sampler: DistributedSampler, world_size: int, rank: int) -> None:
    """Point a DistributedSampler (drop_last=True) at a new membership; it takes effect from the next epoch."""
    sampler.num_replicas, sampler.rank = world_size, rank
    sampler.num_samples = len(sampler.dataset) // world_size  # type: ignore[arg-type]
    sampler.total_size = sampler.num_samples * world_size


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def evaluation_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(ROWS, FEATURES, generator=generator), torch.randn(ROWS, 1, generator=generator)) for _ in range(2)]


IDLE_RELEASE_KEY = "test/idle-release"


def uninterrupted_evaluations(steps: int) -> list[float]:
    """A plain loop's mean loss on :func:`evaluation_batches` after each step: what every evaluation must give."""
    reference = model()
    optim = optimizer(reference.parameters())
    evaluations = []
    for batch in global_batches(steps):
        optim.zero_grad()
        loss(reference, batch).backward()
        optim.step()
        with torch.no_grad():
            batches = evaluation_batches()
            evaluations.append(sum(float(loss(reference, b)) * len(b[0]) for b in batches) / sum(len(b[0]) for b in batches))
    return evaluations


def uninterrupted(steps: int) -> dict[str, torch.Tensor]:
    """The parameters of one plain PyTorch loop over the same global batches: what every elastic run must end with."""
    reference = model()
    optim = optimizer(reference.parameters())
    for batch in global_batches(steps):
        optim.zero_grad()
        loss(reference, batch).backward()
        optim.step()
    return reference.state_dict()


def assert_equal_to(expected: dict[str, torch.Tensor], outcome: dict) -> None:
    """A rank's saved outcome ended its fit with ``expected``'s parameters (to 1e-5)."""
    assert outcome["ok"], outcome.get("traceback")
    for name, tensor in expected.items():
        torch.testing.assert_close(outcome["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def first_knock_key() -> str:
    # The elastic run's own key (gsync/_core/elastic/quorum.py): who knocked first on run 0, set as it knocks.
    return f"{run_scope()}/run0/knock1"


def die_as_the_session_opens() -> None:
    # The first collective that needs every rank's data (rank 0's initial parameters, sent to all): this rank
    # dies in it, as a process killed while the launch's ranks meet would.
    def killed(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    replace_initial_broadcast(killed)


async def train(config: dict) -> dict:
    rank = int(os.environ["RANK"])
    last_applied = {"step": -1}
    world_sizes: list[int] = []
    # Which optimizer object stepped: a survivor goes on with its own across a change (nothing rebuilt).
    optimizer_ids: list[int] = []
    changes_seen: list[str] = []
    signals = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
    dies = config.get("die_each") or ([config["die"]] if config.get("die") else [])
    # This rank's deaths, each once: at its step, in the forward pass.
    mine = [die for die in dies if rank in (die["rank"] if isinstance(die["rank"], list) else [die["rank"]])]

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        for die in list(mine):
            if last_applied["step"] == die["step"] - 1:
                mine.remove(die)
                if die["how"] == "raise":
                    raise ValueError(f"rank {rank} fails at step {die['step']}")
                os.kill(os.getpid(), signals[die["how"]])
        return loss(module, batch)

    if config.get("dies_opening") == rank:
        die_as_the_session_opens()
    wait = config.get("wait_for_knock")
    idle = config.get("idle_after")
    evaluations: list[float] = []
    store = None
    if wait is not None or idle is not None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))

    class Probe:
        async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            last_applied["step"] = result.step
            world_sizes.append(result.world_size)
            optimizer_ids.append(id(session.optimizers[0]))
            if wait is not None and result.step == wait["step"] and store is not None:
                await anyio.to_thread.run_sync(store.wait, [first_knock_key()])
            if config.get("evaluate_each_step"):
                evaluations.append((await session.evaluate(evaluation_batches()))["loss"])
            if idle is not None and result.step == idle["step"] and store is not None:
                if rank == idle["rank"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                # Idle, in the user's code: the loss is heard meanwhile, and met by the next step.
                await anyio.to_thread.run_sync(store.wait, [IDLE_RELEASE_KEY])

        def on_membership_change(self, session: gsync.Session, change: gsync.MembershipChange) -> None:
            changes_seen.append(str(change))
            if sampler is not None:
                reshard(sampler, session.world_size, session.rank)

    elastic = gsync.Elastic(min_world_size=config.get("min_world_size", 1), answer_within=config.get("answer_within", 1.0))
    engine = gsync.Engine(["cpu"], elastic=elastic, sync_timeout=30, trace=config.get("trace", True))
    mode = config.get("mode", "fit")
    sampler = None
    data: object = global_batches(config["steps"])
    if mode == "local":
        dataset = local_dataset()
        sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=rank, shuffle=False, drop_last=True)
        data = torch.utils.data.DataLoader(dataset, batch_size=LOCAL_BATCH, sampler=sampler, drop_last=True)
    trained = model()
    if mode in ("fit", "local"):
        result = await engine.fit(
            trained, data, optimizer=optimizer, loss_fn=loss_fn, callbacks=[Probe()], progress=False,
            epochs=config.get("epochs", 1), process_local_data=mode == "local",
        )
        membership = [change for change in result.membership]
        marks = [event.message for event in result.trace.select("membership")] if result.trace is not None else []
        # The steps whose update this rank applied, on its one trace of the whole run.
        traced = sorted({event.step for event in result.trace.select("optimizer")}) if result.trace is not None else []
        stats_steps = result.stats.steps
        losses = result.losses
        first_step = result.first_step
    else:
        probe = Probe()
        losses = []
        async with engine.session(trained, optimizer=optimizer, loss_fn=loss_fn) as session:
            first_step = session.next_step
            for batch in global_batches(config["steps"])[session.next_step :]:
                step = await session.step(batch)
                losses.append(step.loss)
                await probe.on_step_end(session, step)
        membership = []
        marks = []
        traced = []
        stats_steps = None
    return {
        "traced_steps": traced,
        "stats_steps": stats_steps,
        "marks": marks,
        "state": {name: tensor.detach().clone() for name, tensor in trained.state_dict().items()},
        "membership": [(c.step, c.lost, c.joined, c.world_size, c.seconds, c.reason) for c in membership],
        "losses": losses,
        "first_step": first_step,
        "world_sizes": world_sizes,
        "optimizer_ids": optimizer_ids,
        "changes_seen": changes_seen,
        "evaluations": evaluations,
    }


def main() -> None:
    config, out = json.loads(sys.argv[1]), sys.argv[2]
    # gsync logs each membership change at WARNING: timestamped in the rank's log the test prints on failure.
    logging.basicConfig(format=f"%(asctime)s rank {os.environ['RANK']} pid {os.getpid()}: %(message)s", level=logging.INFO)
    try:
        outcome: dict = {"ok": True, **anyio.run(train, config)}
    except BaseException as error:  # noqa: BLE001 - the test reads what this rank raised
        outcome = {
            "ok": False,
            "type": type(error).__name__,
            "message": str(error),
            "traceback": traceback.format_exc(),
            "last_step": getattr(error, "last_step", None),
        }
    # Once the run has ended, however it ended: every thread gsync started for any of its generations has stopped.
    outcome["threads_left"] = gsync_threads()
    torch.save(outcome, out)
    if config.get("announce_done"):
        # A survivor of a frozen peer exits only once gloo's threads stop waiting on it: the test kills the frozen
        # process once every survivor has saved its outcome.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))
        store.set(f"test/done/{os.environ['RANK']}", "1")


if __name__ == "__main__":
    main()
