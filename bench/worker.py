"""Entry point of one isolated measurement process.

    python -m bench.worker TASK 'JSON-KWARGS' RESULT_PATH

Runs ``TASK(**kwargs)`` (a coroutine function is run with asyncio), adds the
process's peak RSS, and writes the result as JSON to RESULT_PATH. Started by
``isolate.py``; never imports anything heavy before it is told what to run.
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

if __package__ in (None, ""):  # python bench/worker.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import peak_rss_mib, quiet_warnings  # noqa: E402


def _tasks() -> dict[str, Callable[..., Any]]:
    from bench import baselines, measure_gsync, multiprocess

    return {
        "plain": baselines.plain,
        "floor": baselines.floor,
        "ddp_rank": baselines.ddp_rank,
        "gsync_rank": multiprocess.gsync_rank,
        "sequential_pair": baselines.sequential_pair,
        "gsync": measure_gsync.gsync_steps,
        "gsync_control_plane": measure_gsync.gsync_control_plane,
        "idle": measure_gsync.idle,
    }


def main(argv: list[str]) -> int:
    quiet_warnings()
    task, kwargs, result_path = argv[0], json.loads(argv[1]), argv[2]
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
    tmp = result_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
