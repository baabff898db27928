"""The multi-process harness itself: environment, results, errors, and no process left behind.

These use the harness's own torch-free functions, so each spawn costs well under a second.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.harness import (
    RanksTimedOut,
    run_ranks,
    selftest_echo,
    selftest_fail_on,
    selftest_fail_one_hang_others,
    selftest_hang,
    selftest_import_path,
    selftest_return_then_abort,
)

pytestmark = pytest.mark.timeout(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_each_rank_gets_torchrun_like_environment_and_returns_a_value() -> None:
    results = run_ranks(selftest_echo, 3, args=("hi",), timeout=20, check=True)
    values = [r.value for r in results]
    assert [v["RANK"] for v in values] == ["0", "1", "2"]
    assert {v["WORLD_SIZE"] for v in values} == {"3"}
    assert [v["LOCAL_RANK"] for v in values] == ["0", "1", "2"]
    assert {v["MASTER_ADDR"] for v in values} == {"127.0.0.1"}
    assert len({v["MASTER_PORT"] for v in values}) == 1
    assert {v["tag"] for v in values} == {"hi"}


def test_a_rank_imports_from_the_parents_path_first_and_keeps_its_own_extras(tmp_path: os.PathLike[str]) -> None:
    extra = str(tmp_path)
    (rank,) = run_ranks(selftest_import_path, 1, timeout=20, env={"PYTHONPATH": extra}, check=True)
    path = rank.value
    # What the test modules import (tests.support, from the repository root) resolves in the rank as in the parent...
    assert path[: len(sys.path)] == sys.path
    # ... and what the rank's own environment adds is still there, after it.
    assert extra in path[len(sys.path) :]


def test_an_exception_in_one_rank_is_collected_with_its_traceback() -> None:
    ok, failed = run_ranks(selftest_fail_on, 2, args=(1,), timeout=20)
    assert ok.ok and ok.value == "fine"
    assert not failed.ok
    assert failed.error_type == "builtins.ValueError"
    assert failed.error == "boom on rank 1"
    assert "selftest_fail_on" in (failed.traceback or "")
    with pytest.raises(AssertionError, match="boom on rank 1"):
        failed.unwrap()


def test_hung_ranks_are_killed_at_the_hard_timeout() -> None:
    with pytest.raises(RanksTimedOut) as caught:
        run_ranks(selftest_hang, 2, timeout=2)
    assert all(r.killed and r.returncode is not None for r in caught.value.results)
    # The stacks were dumped before the kill, so a hang says where it hung.
    assert all("selftest_hang" in r.stderr for r in caught.value.results)


def test_after_one_rank_fails_the_others_are_killed_after_the_grace() -> None:
    failed, stuck = run_ranks(selftest_fail_one_hang_others, 2, args=(0,), timeout=20, failure_grace=0.5)
    assert failed.error == "first failure"
    assert stuck.killed


def test_no_child_outlives_the_call() -> None:
    results = run_ranks(selftest_echo, 2, args=("pid",), timeout=20, check=True)
    pids = [int(r.value["pid"]) for r in results]
    assert not any(_alive(pid) for pid in pids)


def test_a_rank_that_returned_and_then_crashed_says_both() -> None:
    (result,) = run_ranks(selftest_return_then_abort, 1, timeout=20)
    assert result.returned and result.value == "done" and not result.ok
    assert "returned its result 'done', then exited with -6 (SIGABRT)" in result.describe()
