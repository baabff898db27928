"""One worker of an elastic run under torchrun: ``torchrun ... torchrun_elastic_job.py CONFIG_JSON OUT_DIR``.

torchrun sets the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_USE_AGENT_STORE``);
gsync finds its store from it as ``env://`` would, or, with ``config["store"]``
(``"host:port"``), uses a store hosted outside torchrun (``Engine(store=...)``).
The worker trains :func:`~tests.multiproc.elastic_job.model` on the same global
batches as ``elastic_job.py`` and saves, in ``OUT_DIR``:

- ``start-<pid>.json`` as it starts: its pid and torchrun's environment;
- ``result-<pid>.pt`` as it ends: what it ended with, or the error it raised.

CONFIG: ``steps``; ``store`` (optional, see above); ``answer_within``;
``dump_after`` (seconds: every thread's stack to the output then, if still
running); ``die_with_parent`` (the worker dies with its agent: ``PR_SET_PDEATHSIG``;
torchrun's own workers outlive an agent killed outright); ``coord`` (optional
``"host:port"`` of a TCPStore the test hosts, to pace the run without
sleeping): after each step ``s`` listed in ``hold`` the worker sets
``ready/<s>/<RANK>`` there (its pid, its agent's pid and its torchrun
environment, as JSON) and waits until the test sets ``go/<s>``; after step
``wait_for_join`` every rank waits until a process has knocked on the elastic
run, so a rank started again is taken in before the end; and, its result
saved, it sets ``done/<pid>``.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

import gsync
from gsync._core.elastic.quorum import run_scope
from tests.multiproc.elastic_job import global_batches, loss, model, optimizer

ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
)


def client(address: str) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))


def knock_key(run: int = 0) -> str:
    # The elastic run's own key (gsync/_core/elastic/quorum.py): who knocked first on run 0, set as it knocks.
    return f"{run_scope()}/run{run}/knock1"


async def train(config: dict) -> dict:
    rank = os.environ["RANK"]
    coord = client(config["coord"]) if config.get("coord") else None
    store = client(config["store"]) if config.get("store") else None
    knock_store = store
    if knock_store is None and config.get("wait_for_join") is not None:
        knock_store = client(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    hold = set(config.get("hold", ()))
    wait_for_join = config.get("wait_for_join")
    world_sizes: list[int] = []
    step_times: list[float] = []

    class Probe:
        async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            world_sizes.append(result.world_size)
            step_times.append(time.time())
            if coord is not None and result.step in hold:
                mine = {"pid": os.getpid(), "agent": os.getppid(), "env": {name: os.environ.get(name) for name in ENV}}
                coord.set(f"ready/{result.step}/{rank}", json.dumps(mine))
                await anyio.to_thread.run_sync(coord.wait, [f"go/{result.step}"])
            if wait_for_join is not None and result.step == wait_for_join and knock_store is not None:
                await anyio.to_thread.run_sync(knock_store.wait, [knock_key()])

    elastic = gsync.Elastic(min_world_size=config.get("min_world_size", 1), answer_within=config.get("answer_within", 1.0))
    engine = gsync.Engine(["cpu"], elastic=elastic, sync_timeout=config.get("sync_timeout", 30), store=store)
    trained = model()
    result = await engine.fit(trained, global_batches(config["steps"]), optimizer=optimizer, loss_fn=loss, callbacks=[Probe()], progress=False)
    return {
        "state": {name: tensor.detach().clone() for name, tensor in trained.state_dict().items()},
        "membership": [(c.step, c.lost, c.joined, c.world_size, c.seconds, c.reason) for c in result.membership],
        "first_step": result.first_step,
        "world_sizes": world_sizes,
        "step_times": step_times,
    }


def main() -> None:
    config, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    pid = os.getpid()
    if config.get("die_with_parent") and sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with its agent (or test)
    if config.get("dump_after"):
        # Every thread's stack in the log if this worker is still running then: a hang says where it hung.
        faulthandler.dump_traceback_later(config["dump_after"], exit=False)
    env = {name: os.environ.get(name) for name in ENV}
    (out / f"start-{pid}.json").write_text(json.dumps({"pid": pid, "time": time.time(), "env": env}))
    logging.basicConfig(format=f"%(asctime)s rank {env['RANK']} pid {pid}: %(message)s", level=logging.INFO)
    try:
        outcome: dict = {"ok": True, **anyio.run(train, config)}
    except BaseException as error:  # noqa: BLE001 - the test reads what this worker raised
        outcome = {"ok": False, "type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    outcome.update(pid=pid, env=env, end=time.time())
    torch.save(outcome, out / f"result-{pid}.tmp")
    os.replace(out / f"result-{pid}.tmp", out / f"result-{pid}.pt")
    if config.get("coord"):
        try:
            client(config["coord"]).set(f"done/{pid}", "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: the result file is there all the same
            pass
    if not outcome["ok"]:
        sys.exit(1)  # as the error would: torchrun's agent sees this worker fail


if __name__ == "__main__":
    main()
