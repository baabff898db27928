"""Small helpers shared by every benchmark: statistics, CPU and memory probes.

Everything here is stdlib-only, so the parent process (``run.py``) never has
to import torch.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Sequence


NOISY_CORES = 0.25
"""A measurement during which other processes used more cores than this is 'disturbed'."""


def noisy_mark(result: dict | None) -> str:
    """'*' for a measurement disturbed by other load, else ' '."""
    load = (result or {}).get("other_load_cores")
    return "*" if load is not None and load > NOISY_CORES else " "


def quiet_warnings() -> None:
    """torch warns at import when numpy is absent; benchmarks do not need numpy."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize_ms(seconds: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max of a list of step times given in seconds, in ms."""
    ms = sorted(s * 1e3 for s in seconds)
    if not ms:
        return {"n": 0}
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"n": len(ms), "median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2], "min_ms": ms[0], "max_ms": ms[-1]}


def read_status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmHWM: peak RSS, VmRSS: current RSS); None off Linux."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mib() -> float | None:
    kib = read_status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024


def os_threads() -> int | None:
    """Number of OS threads of this process right now (OpenMP pools included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def system_busy_s() -> float | None:
    """CPU-seconds all cores have spent busy since boot (from /proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def minor_faults() -> int:
    """Minor page faults of this process so far (fresh memory touched for the first time)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Window:
    """Measures one timed section: wall time, this process's CPU time (all threads), its
    minor page faults, and the whole machine's busy CPU time, so a reader can tell how much
    *other* load ran."""

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.cpu0 = time.process_time()
        self.faults0 = minor_faults()
        self.busy0 = system_busy_s()

    def stop(self) -> dict[str, float | None]:
        wall = time.perf_counter() - self.wall0
        cpu = time.process_time() - self.cpu0
        faults = minor_faults() - self.faults0
        busy1 = system_busy_s()
        busy = None if busy1 is None or self.busy0 is None else busy1 - self.busy0
        return {"wall_s": wall, "own_cpu_s": cpu, "minor_faults": faults, "machine_busy_s": busy}


def other_load(windows: Sequence[dict[str, float | None]]) -> float | None:
    """Average number of cores used by processes other than the measured ones during
    the windows (which ran at the same time, e.g. the two DDP ranks)."""
    if not windows or any(w.get("machine_busy_s") is None for w in windows):
        return None
    wall = max(w["wall_s"] for w in windows)  # type: ignore[type-var]
    busy = windows[0]["machine_busy_s"]
    own = sum(w["own_cpu_s"] for w in windows)  # type: ignore[misc]
    return max(0.0, (busy - own) / wall) if wall else None  # type: ignore[operator]
