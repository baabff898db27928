"""The SyncBatchNorm rendezvous of one process's devices, alone: sums, empty shards, and how a wait ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gsync._core.batchnorm import BatchStatsExchange
from gsync._core.threads import FitAborted
from gsync.errors import SyncTimeout


def _in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run each job in a thread of its own; each one's result, or the exception it raised."""
    results: list[Any] = [None] * len(jobs)

    def run(index: int) -> None:
        try:
            results[index] = jobs[index]()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_every_device_with_rows_gets_the_sum_and_an_empty_shard_is_not_waited_for() -> None:
    exchange = BatchStatsExchange(["cpu:0", "cpu:1", "cpu:2"], threading.Event(), 10.0, 4)
    local_rows = [3, 2, 0]  # cpu:2 has no rows in this batch: it never calls

    def device(index: int) -> Callable[[], list[torch.Tensor]]:
        def job() -> list[torch.Tensor]:
            exchange.begin_batch(index, 0, 0, local_rows, False, local_rows[index] / 5)
            out = [exchange.reduce(index, torch.full((3,), float(index + 1) * call, dtype=torch.float64)) for call in (1, 10)]
            exchange.end_batch(index)
            return out

        return job

    results = _in_threads([device(0), device(1)])
    for result in results:
        assert not isinstance(result, BaseException), result
        torch.testing.assert_close(result[0], torch.full((3,), 3.0, dtype=torch.float64))
        torch.testing.assert_close(result[1], torch.full((3,), 30.0, dtype=torch.float64))


def test_a_device_waiting_for_one_that_failed_leaves_when_the_session_aborts() -> None:
    abort = threading.Event()
    exchange = BatchStatsExchange(["cpu:0", "cpu:1"], abort, 60.0, 4)
    exchange.begin_batch(0, 5, 0, [1, 1], False, 0.5)
    waiting = threading.Event()

    def first() -> torch.Tensor:
        waiting.set()
        return exchange.reduce(0, torch.ones(2, dtype=torch.float64))

    def failing_peer() -> None:
        waiting.wait()
        abort.set()  # what a device's failure does (DeviceJobs): cpu:1 never calls

    (raised, _) = _in_threads([first, failing_peer])
    assert isinstance(raised, FitAborted)


def test_a_device_that_never_arrives_is_named_by_the_timeout() -> None:
    abort = threading.Event()
    exchange = BatchStatsExchange(["cpu:0", "cpu:1"], abort, 0.2, 4)
    exchange.begin_batch(0, 7, 0, [1, 1], False, 0.5)
    with pytest.raises(SyncTimeout) as raised:
        exchange.reduce(0, torch.ones(2, dtype=torch.float64))
    assert raised.value.step == 7 and list(raised.value.stalled_devices) == ["cpu:1"]
    assert abort.is_set()  # the session ends: its other waits leave too


def test_outside_a_batch_a_layer_keeps_its_shards_own_statistics() -> None:
    exchange = BatchStatsExchange(["cpu:0", "cpu:1"], threading.Event(), 10.0, 4)
    values = torch.arange(3, dtype=torch.float64)
    assert not exchange.active(0)
    assert exchange.reduce(0, values) is values
