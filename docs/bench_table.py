"""Print the performance page's table from a benchmark run's JSON: ``python docs/bench_table.py [results.json]``.

The step section of ``bench/run.py`` (``--only step``, or a full run) writes what this reads; the default is the
runner's own default output, ``bench/results/latest.json``. Paste the printed table into ``docs/performance.md``
with the date, the machine and the commit the header names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# bench/report.py's step labels, shortened for a table a user reads, in the order the runner measures them.
LABELS = {
    "plain": "one plain process (torch's default threads)",
    "gsync_1": "**gsync, 1 CPU device**",
    "floor_t1": "2-replica floor (2 threads x 1 intra-op thread, no sync)",
    "floor_inherit": "2-replica floor (2 threads, inherited threads, no sync)",
    "gsync": "**gsync, 2 CPU devices, `fit`** (default: a thread and a core per device)",
    "gsync_session": "gsync, 2 devices, a `for` loop over `session.step`",
    "gsync_shared": 'gsync, 2 devices on one shared thread (`device_threads="shared"`)',
    "ddp": "torch DDP, gloo, 2 processes x 1 thread",
}


def table(step: dict[str, Any]) -> str:
    configs = step["configs"]
    ms = {key: config["median_ms"] for key, config in configs.items()}
    floors = [ms[key] for key in ("floor_t1", "floor_inherit") if key in ms]
    floor = min(floors) if floors else None

    def ratio(key: str) -> str:
        parts = []
        if key in ("gsync", "gsync_session", "gsync_shared") and floor:
            parts.append(f"{ms[key] / floor:.2f} x floor")
        if key == "gsync" and "ddp" in ms:
            parts.append(f"{ms[key] / ms['ddp']:.2f} x DDP")
        if key in ("gsync_1", "ddp") and "plain" in ms:
            parts.append(f"{ms[key] / ms['plain']:.2f} x one process")
        return ", ".join(parts)

    lines = ["| configuration | ms/step | CPU ms/step | ratio |", "| --- | --- | --- | --- |"]
    for key, label in LABELS.items():
        if key in configs:
            cpu = configs[key].get("cpu_ms_per_step")
            noisy = " (disturbed)" if configs[key].get("noisy") else ""
            lines.append(f"| {label} | {ms[key]:.1f}{noisy} | {'-' if cpu is None else f'{cpu:.0f}'} | {ratio(key)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    path = Path(argv[1]) if len(argv) > 1 else ROOT / "bench" / "results" / "latest.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    if "step" not in results:
        raise SystemExit(f"{path} has no step section: run bench/run.py --only step (or a full run)")
    env = results.get("env", {})
    print(f"<!-- {path.name}: {results.get('mode')} mode, torch {env.get('torch')}, {env.get('cpus')} CPUs, "
          f"git {str(env.get('git_commit', ''))[:12]} -->")
    print(table(results["step"]))


if __name__ == "__main__":
    main(sys.argv)
