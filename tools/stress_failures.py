"""Repeat every multi-process failure scenario many times and count the clean runs.

    .venv/bin/python -m tools.stress_failures [--repeats 30] [--hog] [--only NAME ...]
    .venv/bin/python -m tools.stress_failures --only elastic --repeats 10 --hog   # the elastic scenarios only

(from the repository root; ``python tools/stress_failures.py`` works too).

A run is clean when every rank that is meant to survive returns the expected
gsync error *and* its process exits with status 0: a native abort during
shutdown (SIGABRT, ``terminate called without an active exception``) or a
hang counts as a failure even if the error was right. ``--hog`` keeps one
busy-looping process per core running beside the ranks, as a loaded CI
machine would. The scenarios are the multi-process tests' own rank functions, run by
file path through the tests' harness (``tests/support/harness.py``): the ranks import
the test module, this process never does.

The elastic scenarios (``elastic: ...``) run the elastic tests' rank job
(``tests/multiproc/elastic_job.py``) through their harness
(``elastic_ranks.ElasticRanks``, which hosts the store in this process, so any
rank is losable): a run is clean when every survivor (and a restarted rank)
ends its fit with exactly the parameters of the uninterrupted run, records the
membership change(s) expected, and exits with status 0, and the killed rank
died of its SIGKILL.

Not a test: it takes minutes. CI runs each scenario once through pytest.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from dataclasses import dataclass

_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: the repository root on the path, as ``-m`` from the root puts it
    sys.path.insert(0, str(_ROOT))

from tests.support.harness import RankResult, run_file_ranks  # noqa: E402

_MULTIPROC = _ROOT / "tests" / "multiproc"


@dataclass(frozen=True)
class Ranks:
    """A multi-process test's rank function, by file and name, and how the tests run it."""

    file: str
    function: str
    args: tuple[Any, ...] = ()
    world_size: int = 2
    grace: float = 5.0
    """How long the survivors may take to exit once a rank failed (a killed, frozen or stuck peer's survivor may
    take seconds to exit under load: the tests give it 20 s too)."""

    def run(self) -> list[RankResult]:
        return run_file_ranks(_MULTIPROC / self.file, self.function, self.world_size, args=self.args, timeout=80,
                              failure_grace=self.grace)


def engine(function: str, *args: Any, grace: float = 5.0) -> Ranks:
    return Ranks("test_engine_multiprocess.py", function, args, grace=grace)


def heartbeat(function: str, *args: Any, world_size: int = 2) -> Ranks:
    return Ranks("test_heartbeat_multiprocess.py", function, args, world_size, grace=20.0)


def session(function: str, *args: Any) -> Ranks:
    return Ranks("test_session_multiprocess.py", function, args)


Check = Callable[[list[RankResult]], str | None]


def _expect(rank: int, *error_types: str | None) -> Check:
    def check(results: list[RankResult]) -> str | None:
        result = results[rank]
        if not result.returned or result.returncode != 0:
            return result.describe()
        if not isinstance(result.value, dict) or result.value.get("type") not in error_types:
            return f"rank {rank} returned {result.value!r}, expected one of {error_types}"
        return None

    return check


def _all(*checks: Check) -> Check:
    def check(results: list[RankResult]) -> str | None:
        for one in checks:
            problem = one(results)
            if problem is not None:
                return problem
        return None

    return check


def _killed_rank_1(results: list[RankResult]) -> str | None:
    if results[1].returncode != -signal.SIGKILL:
        return f"rank 1 should have been SIGKILLed: {results[1].describe()}"
    return _expect(0, "PeerLost")(results)


def _killed_rank_0(results: list[RankResult]) -> str | None:
    if results[0].returncode != -signal.SIGKILL:
        return f"rank 0 should have been SIGKILLed: {results[0].describe()}"
    return _expect(1, "PeerLost")(results)


def _config_error_everywhere(results: list[RankResult]) -> str | None:
    for result in results:
        if not result.returned or result.returncode != 0:
            return result.describe()
        if "embed.weight" not in str(result.value):
            return f"rank {result.rank} returned {result.value!r}"
    return None


# Where a frozen or stuck rank 1 leaves its pid, for rank 0 to end it once named.
_PID_FILE = Path(tempfile.mkdtemp(prefix="gsync-stress-")) / "pid"

SCENARIOS: dict[str, tuple[Ranks, Check]] = {
    "worker failure on rank 1": (engine("fail_on_rank_1"), _all(_expect(0, "PeerFailed"), _expect(1, "WorkerFailed"))),
    "data failure on rank 1": (engine("data_fails_on_rank_1"), _all(_expect(0, "PeerFailed"), _expect(1, "DataFailed"))),
    "rank 1 SIGKILLed": (engine("killed_at_step_2", grace=20.0), _killed_rank_1),
    "rank 1 frozen (SIGSTOP)": (heartbeat("stopped_at_step_2", _PID_FILE), _expect(0, "PeerLost")),
    "rank 1 stuck in its data": (heartbeat("data_stuck_on_rank_1", _PID_FILE), _expect(0, "PeerLost")),
    "rank 1 stuck in its loss": (
        heartbeat("loss_stuck_on_rank_1", _PID_FILE),
        _expect(0, "PeerLost", "PeerFailed"),
    ),
    "rank 0 (store host) SIGKILLed": (heartbeat("store_host_killed_at_step_2"), _killed_rank_0),
    "3 ranks, rank 2 stuck in its data": (
        heartbeat("data_stuck_on_rank_2_of_3", _PID_FILE, world_size=3),
        _all(_expect(0, "PeerLost", "PeerFailed"), _expect(1, "PeerLost", "PeerFailed")),
    ),
    "data ends at different steps": (
        engine("uneven_data_lengths"),
        _all(_expect(0, "ConfigError"), _expect(1, "ConfigError")),
    ),
    "parameter mismatch": (engine("mismatched_model"), _config_error_everywhere),
    "session: rank 1 leaves early": (
        session("rank_1_leaves_early"),
        _all(_expect(0, "PeerFailed"), _expect(1, None)),
    ),
    "session: peer fails between steps": (
        session("failure_while_rank_0_waits_between_steps"),
        _all(_expect(0, "PeerFailed"), _expect(1, "WorkerFailed")),
    ),
    "session: peer fails in evaluate": (
        session("failures_outside_steps", "evaluate"),
        _all(_expect(0, "PeerFailed"), _expect(1, "WorkerFailed")),
    ),
    "session: peer's own exception": (
        session("failures_outside_steps", "user_exception"),
        _all(_expect(0, "PeerFailed"), _expect(1, "KeyError")),
    ),
}


# -- elastic scenarios: a run each, with the store hosted here; the problem seen, or None ---------------------------

_ELASTIC_STEPS = 10


def _elastic_problem(names: list[str], expected: dict[str, Any], outcomes: dict[str, Any],
                     codes: dict[str, int | None]) -> str | None:
    import torch

    for name in names:
        outcome = outcomes.get(name)
        if outcome is None or not outcome.get("ok"):
            return f"rank {name} (exit status {codes.get(name)}) ended with {outcome and {k: outcome.get(k) for k in ('type', 'message', 'traceback')}}"
        if codes.get(name) != 0:
            return f"rank {name} ended its fit, then exited with status {codes.get(name)}"
        for key, tensor in expected.items():
            try:
                torch.testing.assert_close(outcome["state"][key], tensor, rtol=1e-5, atol=1e-5)
            except AssertionError as error:
                return f"rank {name}: {key} differs from the uninterrupted run: {error}"
    return None


def _exit_codes(ranks: Any, names: list[str]) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for name in names:
        try:
            codes[name] = ranks.wait(name, 20)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: still running, killed when the block ends
            codes[name] = None
    return codes


def elastic_killed(victim: int, how: str = "kill") -> str | None:
    """3 ranks, elastic; ``victim`` SIGKILLs itself mid-step (in loss_fn at step 4), or SIGTERMs itself there and
    departs (``how="term"``), or SIGKILLs itself as the first session opens (``how="opening"``): the others end
    exact, having recorded the one change."""
    from tests.multiproc.elastic_job import uninterrupted
    from tests.multiproc.elastic_ranks import ElasticRanks

    config: dict[str, Any] = {"steps": _ELASTIC_STEPS}
    if how == "opening":
        config["dies_opening"] = victim
    else:
        config["die"] = {"rank": victim, "step": 4, "how": how}
    kept = [str(rank) for rank in range(3) if rank != victim]
    with ElasticRanks(3, config) as ranks:
        try:
            outcomes = ranks.results(90)
        except AssertionError as error:  # a rank did not finish in time: every process was killed
            return f"{error}\n{ranks.logs()}"
        codes = _exit_codes(ranks, [str(rank) for rank in range(3)])
        logs = ranks.logs()
    if how == "term":
        departed = outcomes.get(str(victim)) or {}
        if departed.get("type") != "Departed" or codes[str(victim)] != 0:
            return f"rank {victim} should have departed (Departed, exit status 0): {departed.get('type')}, exit status {codes[str(victim)]}\n{logs}"
    elif codes[str(victim)] != -signal.SIGKILL:
        return f"rank {victim} should have died of its SIGKILL, exit status {codes[str(victim)]}\n{logs}"
    problem = _elastic_problem(kept, uninterrupted(_ELASTIC_STEPS), outcomes, codes)
    reason = "left" if how == "term" else "lost"
    if problem is None:
        for name in kept:
            changes = outcomes[name]["membership"]
            if len(changes) != 1 or changes[0][1:4] != ((victim,), (), 2) or changes[0][5] != reason:
                problem = f"rank {name} recorded the membership changes {changes}, expected one: rank {victim} {reason}"
                break
            if how == "opening" and changes[0][0] != 0:
                problem = f"rank {name} recorded the change at step {changes[0][0]}, not before step 0"
                break
    return None if problem is None else f"{problem}\n{logs}"


def elastic_killed_and_restarted() -> str | None:
    """3 ranks, elastic; rank 1 SIGKILLed at step 3, started again at once: it rejoins, and all three end exact."""
    from tests.multiproc.elastic_job import uninterrupted
    from tests.multiproc.elastic_ranks import ElasticRanks

    steps = 14
    # Every rank waits after step 7 until the restarted process has knocked, so it is taken in before the end.
    config = {"steps": steps, "die": {"rank": 1, "step": 3, "how": "kill"}, "wait_for_knock": {"step": 7}}
    with ElasticRanks(3, config) as ranks:
        try:
            killed = ranks.wait("1", 60)
        except Exception as error:  # noqa: BLE001 - subprocess.TimeoutExpired
            return f"rank 1 did not die at step 3 within 60 s ({error})\n{ranks.logs()}"
        if killed != -signal.SIGKILL:
            return f"rank 1 should have died of its SIGKILL, exit status {killed}\n{ranks.logs()}"
        again = ranks.start(1, {"steps": steps})
        names = ["0", "2", again]
        try:
            outcomes = ranks.results(90, names)
        except AssertionError as error:
            return f"{error}\n{ranks.logs()}"
        codes = _exit_codes(ranks, names)
        logs = ranks.logs()
    problem = _elastic_problem(names, uninterrupted(steps), outcomes, codes)
    if problem is None:
        for name in ("0", "2"):
            changes = [(c[1], c[2], c[3]) for c in outcomes[name]["membership"]]
            if changes != [((1,), (), 2), ((), (1,), 3)]:
                problem = f"rank {name} recorded the membership changes {outcomes[name]['membership']}"
                break
    if problem is None:
        joiner = outcomes[again]
        if not joiner["membership"] or joiner["first_step"] != joiner["membership"][0][0]:
            problem = f"the restarted rank started at step {joiner['first_step']} with membership {joiner['membership']}"
    return None if problem is None else f"{problem}\n{logs}"


ELASTIC_SCENARIOS: dict[str, Callable[[], str | None]] = {
    "elastic: rank 1 SIGKILLed mid-step": partial(elastic_killed, 1),
    "elastic: rank 0 SIGKILLed mid-step": partial(elastic_killed, 0),
    "elastic: killed rank 1 restarted, rejoins": elastic_killed_and_restarted,
    "elastic: rank 1 SIGTERMed, departs": partial(elastic_killed, 1, "term"),
    "elastic: rank 1 killed as the session opens": partial(elastic_killed, 1, "opening"),
}


def _hog() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--hog", action="store_true", help="run one busy-looping process per core beside the ranks")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names (substrings) to run")
    args = parser.parse_args()

    hogs = []
    if args.hog:
        hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(os.cpu_count() or 1)]
        for hog in hogs:
            hog.start()
    chosen: dict[str, Any] = {
        name: scenario
        for name, scenario in {**SCENARIOS, **ELASTIC_SCENARIOS}.items()
        if args.only is None or any(part in name for part in args.only)
    }
    failures = 0
    try:
        for name, scenario in chosen.items():
            clean = 0
            started = time.monotonic()
            for attempt in range(args.repeats):
                if name in ELASTIC_SCENARIOS:
                    problem = scenario()
                else:
                    ranks, check = scenario
                    problem = check(ranks.run())
                if problem is None:
                    clean += 1
                else:
                    print(f"  {name}, run {attempt + 1}: {problem}", flush=True)
            failures += args.repeats - clean
            per_run = (time.monotonic() - started) / max(args.repeats, 1)
            print(f"{name:41s} {clean}/{args.repeats} clean   ({per_run:.1f} s per run)", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"{'hog' if args.hog else 'no hog'}: {'all clean' if failures == 0 else f'{failures} unclean runs'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
