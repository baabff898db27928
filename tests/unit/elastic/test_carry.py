"""A process's log of its operations between steps, which a membership change compares across members."""

from __future__ import annotations

import pytest
import torch

import gsync
from gsync._core.elastic.carry import OperationLog


def test_the_position_counts_the_operations_completed_since_the_step_and_starts_over_after_the_next() -> None:
    log = OperationLog()
    assert log.position(-1) == 0
    log.completed(3, "evaluate()", {"loss": 1.0})
    log.completed(3, "all_reduce(op='sum')", 2.0)
    assert log.position(3) == 2 and log.last(3) == ("all_reduce(op='sum')", 2.0)
    assert log.position(2) == 0 and log.position(4) == 0  # another step's: none since it
    log.completed(4, "evaluate()", {"loss": 0.5})
    assert log.position(4) == 1 and log.position(3) == 0


def test_a_handed_result_is_taken_once_by_the_operation_it_answers_and_not_by_another() -> None:
    log = OperationLog()
    log.completed(7, "evaluate()", {"loss": 1.0})
    log.hand(7, 2, "all_reduce(op='sum')", 5.0)
    assert log.take(6, "all_reduce(op='sum')") == (False, None)  # an earlier position: not the one handed over
    assert log.take(7, "all_reduce(op='sum')") == (True, 5.0)
    assert log.take(7, "all_reduce(op='sum')") == (False, None)  # taken once: a later all_reduce runs


def test_a_handed_result_this_process_already_holds_is_ignored() -> None:
    log = OperationLog()
    log.completed(2, "all_reduce(op='sum')", 1.0)
    log.hand(2, 1, "all_reduce(op='sum')", 1.0)
    log.completed(2, "all_reduce(op='sum')", 4.0)
    assert log.take(2, "all_reduce(op='sum')") == (False, None)


def test_a_loop_that_went_past_the_handed_result_drops_it() -> None:
    log = OperationLog()
    log.hand(4, 1, "evaluate()", {"loss": 0.1})
    assert log.take(5, "evaluate()") == (False, None)  # a step came first: this loop is not the other members'
    log.completed(4, "evaluate()", {"loss": 0.1})
    assert log.take(4, "evaluate()") == (False, None)


def test_a_loop_that_calls_another_operation_where_the_others_called_this_one_is_refused() -> None:
    log = OperationLog()
    log.hand(1, 1, "evaluate()", {"loss": 0.1})
    with pytest.raises(gsync.ConfigError, match=r"this rank called all_reduce\(op='sum'\) after step 1 where the other members called evaluate\(\)"):
        log.take(1, "all_reduce(op='sum')")


def test_the_last_result_of_a_step_with_no_operations_is_a_bug_not_a_value() -> None:
    log = OperationLog()
    log.completed(1, "evaluate()", {})
    with pytest.raises(RuntimeError, match="no operation was completed after step 2"):
        log.last(2)


def test_the_result_kept_is_a_copy_the_caller_cannot_change() -> None:
    log = OperationLog()
    metrics = {"loss": 1.0}
    total = torch.ones(3, requires_grad=True) * 2
    log.completed(5, "evaluate()", metrics)
    metrics["epoch"] = 3.0  # the caller's dict, changed after the call returned
    assert log.last(5) == ("evaluate()", {"loss": 1.0})
    log.completed(5, "all_reduce(op='sum')", total)
    with torch.no_grad():
        total.mul_(10)
    kind, kept = log.last(5)
    assert not kept.requires_grad and kept.device.type == "cpu" and torch.equal(kept, torch.full((3,), 2.0))
    sums = torch.tensor([1.0, 4.0], dtype=torch.float64)
    log.completed(5, "evaluate()", (["loss"], sums))
    sums.zero_()
    kind, (names, kept_sums) = log.last(5)
    assert names == ["loss"] and torch.equal(kept_sums, torch.tensor([1.0, 4.0], dtype=torch.float64))
