"""One rank of an elastic run over process-local data of unequal length (uneven="join"), run by ElasticRanks.

    python uneven_elastic_job.py '<config json>' <outcome file>

``config``: ``counts`` (each launch rank's number of batches) and ``kill``
(``{"rank": r, "after_step": s}``: that rank SIGKILLs itself once step
``s`` is applied, between steps). With ``"mode": "syncbn"`` the ranks
train a SyncBatchNorm model on ``steps`` global batches instead, and
``kill`` (``{"rank": r, "in_step": s}``) kills that rank in its forward
of step ``s``, while the others wait in its first statistics collective.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

import anyio
import torch

import gsync
from tests.multiproc.test_uneven_join_multiprocess import norm_model, rank_batches, tied_loss, tied_model
from tests.support.batchnorm import norm_batches, norm_loss, norm_sgd, synced
from tests.support.models import sgd


async def train_synced(config: dict[str, Any]) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    kill = config["kill"]
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if rank == kill["rank"] and calls[0] == kill["in_step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        return norm_loss(model, batch)

    engine = gsync.Engine(["cpu"], elastic=gsync.Elastic(min_world_size=1, answer_within=1.0), sync_timeout=30)
    model = synced(norm_model())
    result = await engine.fit(
        model, norm_batches(config["steps"], 12), optimizer=norm_sgd, loss_fn=loss_fn, progress=False,
    )
    return {
        "state": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "membership": [(c.step, c.lost, c.world_size, c.reason) for c in result.membership],
        "steps": [record.step for record in result.history],
    }


async def train(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("mode") == "syncbn":
        return await train_synced(config)
    rank = int(os.environ["RANK"])
    kill = config["kill"]

    class KillAfter:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            if rank == kill["rank"] and result.step == kill["after_step"]:
                os.kill(os.getpid(), signal.SIGKILL)

    engine = gsync.Engine(["cpu"], elastic=gsync.Elastic(min_world_size=1, answer_within=1.0), sync_timeout=30)
    model = tied_model()
    result = await engine.fit(
        model, rank_batches(rank, config["counts"][rank]), optimizer=sgd, loss_fn=tied_loss, callbacks=[KillAfter()],
        progress=False, process_local_data=True, uneven="join",
    )
    return {
        "state": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "membership": [(c.step, c.lost, c.world_size, c.reason) for c in result.membership],
        "steps": [record.step for record in result.history],
    }


def main() -> None:
    config, out = json.loads(sys.argv[1]), sys.argv[2]
    logging.basicConfig(format=f"%(asctime)s rank {os.environ['RANK']}: %(message)s", level=logging.INFO)
    try:
        outcome: dict[str, Any] = {"ok": True, **anyio.run(train, config)}
    except BaseException as error:  # noqa: BLE001 - the test reads what this rank raised
        outcome = {"ok": False, "type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    torch.save(outcome, out)


if __name__ == "__main__":
    main()
