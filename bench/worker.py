"""Entry point of one isolated measurement process.

    python -m bench.worker TASK 'JSON-KWARGS' RESULT_PATH

Runs ``TASK(**kwargs)`` (a coroutine function is run with asyncio), adds the
process's peak RSS, and writes the result as JSON to RESULT_PATH. Started by
``isolate.py`` from the repository root; never imports anything heavy before it is
told what to run. :func:`run_rank` is the same for one rank of a multi-process
measurement, started by the tests' harness (``tests/support/harness.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.common import peak_rss_mib, quiet_warnings


def _tasks() -> dict[str, Callable[..., Any]]:
    from bench import baselines, measure_gsync

    return {
        "plain": baselines.plain,
        "floor": baselines.floor,
        "ddp_rank": baselines.ddp_rank,
        "gsync_rank": measure_gsync.gsync_rank,
        "sequential": baselines.sequential,
        "gsync": measure_gsync.gsync_steps,
        "gsync_control_plane": measure_gsync.gsync_control_plane,
        "idle": measure_gsync.idle,
    }


def run(task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``TASK(**kwargs)`` with ``ok`` (or ``error``), peak RSS and the process's age added."""
    quiet_warnings()
    started = time.perf_counter()
    try:
        fn = _tasks()[task]
        result = asyncio.run(fn(**kwargs)) if inspect.iscoroutinefunction(fn) else fn(**kwargs)
        result = dict(result)
        result["ok"] = True
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    result["peak_rss_mib"] = peak_rss_mib()
    result["process_s"] = time.perf_counter() - started
    return result


def run_rank(task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank: ``TASK(rank=RANK, world_size=WORLD_SIZE, port=MASTER_PORT, **kwargs)`` from torchrun's
    variables, which the harness sets. Raises if the task did, so the harness stops the other ranks at once.
    """
    env = os.environ
    ranked = {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]), "port": int(env["MASTER_PORT"]), **kwargs}
    result = run(task, ranked)
    if not result["ok"]:
        raise RuntimeError(f"{task} failed on rank {ranked['rank']}: {result['error']}")
    return result


def main(argv: list[str]) -> int:
    task, kwargs, result_path = argv[0], json.loads(argv[1]), argv[2]
    result = run(task, kwargs)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
