"""Trace files: ``Engine(trace="run.json")`` writes a Chrome/Perfetto trace at the end of every fit and session.

Successful, failed and cancelled runs alike; a failure is marked on the track where it happened, and the error's
message ends with the file's path. (Across processes: ``tests/multiproc/test_trace_multiprocess.py``.)
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from gsync_pytest import gsync_threads
from tests.support.gates import CancelAfterStep
from tests.support.models import Deep, classification_loss, make_batches, sgd

import gsync
import gsync.testing
from gsync._core.trace_files import rank_file

PHASES = ("data", "forward", "backward", "optimizer")


def small_buckets(trace: Any, devices: int = 2) -> gsync.Engine:
    return gsync.Engine([f"cpu:{i}" for i in range(devices)], first_bucket_mb=0.005, bucket_cap_mb=0.01, trace=trace)


class Chrome:
    """A written trace file, read back: its tracks by name and its timed events by track."""

    def __init__(self, path: Path) -> None:
        self.doc = json.loads(path.read_text())
        events = self.doc["traceEvents"]
        self.process_names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
        self.tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        self.timed = [e for e in events if e["ph"] != "M"]

    def on(self, track: str, ph: str | None = None) -> list[dict[str, Any]]:
        tid = self.tracks[track]
        return [e for e in self.timed if e["tid"] == tid and (ph is None or e["ph"] == ph)]

    @property
    def outcome(self) -> str:
        return str(self.doc["otherData"]["outcome"])


def assert_sane_times(chrome: Chrome, wall_us: float) -> None:
    """Microseconds from the trace's start: non-negative, and within the wall time the run took."""
    for event in chrome.timed:
        assert event["ts"] >= 0
        assert event.get("dur", 0) >= 0
        assert event["ts"] + event.get("dur", 0) <= wall_us, event


@pytest.mark.asyncio
async def test_a_fit_writes_one_track_per_device_one_for_communication_and_step_markers(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    engine = small_buckets(str(path))
    started = time.perf_counter()
    result = await engine.fit(Deep(depth=4), make_batches(3, 16), optimizer=sgd, loss_fn=classification_loss)
    wall_us = (time.perf_counter() - started) * 1e6

    assert result.trace is not None and result.trace.path == path
    chrome = Chrome(path)
    assert chrome.outcome == "ok"
    assert chrome.doc["otherData"]["devices"] == ["cpu:0", "cpu:1"]
    assert len(chrome.process_names) == 1 and "rank 0 of 1" in chrome.process_names[0]
    assert "cpu:0" in chrome.process_names[0] and "cpu:1" in chrome.process_names[0]
    assert set(chrome.tracks) == {"steps", "device 0 (cpu:0)", "device 1 (cpu:1)", "sync server / communication"}
    assert_sane_times(chrome, wall_us)

    for device in ("device 0 (cpu:0)", "device 1 (cpu:1)"):
        spans = chrome.on(device, "X")
        for phase in PHASES:
            assert sorted(e["args"]["step"] for e in spans if e["name"] == phase) == [0, 1, 2], (device, phase)

    buckets = result.stats.buckets
    assert buckets >= 3
    reductions = [e for e in chrome.on("sync server / communication", "X") if e["name"].startswith("all_reduce")]
    for step in range(3):
        of_step = [e for e in reductions if e["args"]["step"] == step]
        assert [e["args"]["bucket"] for e in of_step] == list(range(buckets))
        assert all(e["name"] == f"all_reduce b{e['args']['bucket']}" for e in of_step)
        assert all(e["args"]["bytes"] > 0 for e in of_step)
    # After the first step's bucket rebuild, the last step reduces exactly the final plan's buckets.
    last = sorted((e for e in reductions if e["args"]["step"] == 2), key=lambda e: e["args"]["bucket"])
    assert [e["args"]["bytes"] for e in last] == list(result.stats.bucket_sizes)

    markers = chrome.on("steps", "X")
    assert [e["name"] for e in markers] == ["step 0", "step 1", "step 2"]
    for before, after in itertools.pairwise(markers):
        assert before["ts"] + before["dur"] <= after["ts"]
    for marker in markers:
        step = marker["args"]["step"]
        inside = [e for e in chrome.timed if e["ph"] == "X" and e["cat"] != "step" and e["args"]["step"] == step]
        end = marker["ts"] + marker["dur"] + 1e-3  # rounded to the nanosecond
        assert inside and all(marker["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end for e in inside)
    assert not [e for e in chrome.timed if e["ph"] == "i"]


@pytest.mark.asyncio
async def test_a_session_writes_its_trace_when_its_block_ends_and_the_next_one_rewrites_it(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "session.json"  # a missing directory is created
    engine = small_buckets(path)
    assert engine.trace_file == path
    batches = make_batches(4, 16)
    async with engine.session(Deep(depth=4), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(batches[0])
        await session.step(batches[1], batches[2])
        await session.evaluate(batches[3:])
        assert not path.exists()
    assert session.trace is not None and session.trace.path == path
    chrome = Chrome(path)
    assert chrome.outcome == "ok"
    assert [e["name"] for e in chrome.on("steps", "X")] == ["step 0", "step 1"]
    assert [e["args"]["step"] for e in chrome.on("device 1 (cpu:1)", "X") if e["name"] == "evaluate"] == [1]

    async with engine.session(Deep(depth=4), optimizer=sgd, loss_fn=classification_loss) as session:
        await session.step(batches[0])
    assert [e["name"] for e in Chrome(path).on("steps", "X")] == ["step 0"]
    assert list(tmp_path.rglob("*.partial")) == []
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_failed_fit_writes_its_trace_with_the_failure_on_the_device_that_failed(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    engine = small_buckets(path)
    fault = gsync.testing.fail(device=1, step=2, site="backward")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(Deep(depth=4), make_batches(4, 16), optimizer=sgd, loss_fn=classification_loss)
    error = caught.value
    # The cause is said before the trace file, which ends the message.
    assert str(error) == (
        "worker on device cpu:1 (index 1) failed at step 2 during backward (its shard: 8 of the batch's 16 rows): "
        f"InjectedFault: injected fault at device 1, step 2, backward (trace: {path})"
    )
    assert (error.device, error.device_index, error.step, error.site) == ("cpu:1", 1, 2, "backward")
    assert error.last_step == 1 and error.checkpoint is not None
    assert isinstance(error.__cause__, gsync.testing.InjectedFault)

    chrome = Chrome(path)
    assert chrome.outcome == "failed"
    assert chrome.doc["otherData"]["error"].startswith("WorkerFailed: worker on device cpu:1")
    marks = [e for e in chrome.timed if e["ph"] == "i"]
    assert len(marks) == 1
    mark = marks[0]
    assert mark["tid"] == chrome.tracks["device 1 (cpu:1)"]
    assert mark["name"] == "failed: WorkerFailed" and mark["s"] == "t"
    assert mark["args"]["step"] == 2 and mark["args"]["error"] == "WorkerFailed"
    assert "during backward" in mark["args"]["message"]
    # The phase that raised is a span on the same track, and the mark sits at its end.
    device_1 = chrome.on("device 1 (cpu:1)", "X")
    failed_backward = [e for e in device_1 if e["name"] == "backward" and e["args"]["step"] == 2]
    assert len(failed_backward) == 1 and failed_backward[0]["ts"] <= mark["ts"]
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_failed_reduction_is_marked_on_the_communication_track(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    engine = small_buckets(path)
    fault = gsync.testing.fail(device=None, step=1, site="all_reduce")
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncFailed) as caught:
        await engine.fit(Deep(depth=4), make_batches(3, 16), optimizer=sgd, loss_fn=classification_loss)
    assert str(caught.value).endswith(f" (trace: {path})")
    chrome = Chrome(path)
    marks = [e for e in chrome.timed if e["ph"] == "i"]
    assert [(m["name"], m["tid"], m["args"]["step"]) for m in marks] == [
        ("failed: SyncFailed", chrome.tracks["sync server / communication"], 1)
    ]


@pytest.mark.asyncio
async def test_a_cancelled_fit_writes_its_trace_with_the_cancellation_marked(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    engine = small_buckets(path)

    with anyio.CancelScope() as scope:
        callbacks = [CancelAfterStep(scope, 1)]
        await engine.fit(Deep(depth=4), make_batches(5, 16), optimizer=sgd, loss_fn=classification_loss, callbacks=callbacks)
    assert scope.cancelled_caught

    chrome = Chrome(path)
    assert chrome.outcome == "cancelled"
    assert [e["name"] for e in chrome.on("steps", "X")] == ["step 0", "step 1"]
    marks = [e for e in chrome.timed if e["ph"] == "i"]
    assert [(m["name"], m["tid"], m["args"]["step"]) for m in marks] == [("cancelled", chrome.tracks["steps"], 1)]
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_your_own_exception_propagates_unchanged_with_a_note_naming_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    engine = small_buckets(path)

    class Raise:
        def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
            raise KeyError("mine")

    with pytest.raises(KeyError) as caught:
        await engine.fit(Deep(depth=4), make_batches(3, 16), optimizer=sgd, loss_fn=classification_loss, callbacks=[Raise()])
    assert caught.value.args == ("mine",)
    assert f"gsync trace: {path}" in caught.value.__notes__
    chrome = Chrome(path)
    assert chrome.outcome == "failed"
    marks = [e for e in chrome.timed if e["ph"] == "i"]
    assert [(m["name"], m["tid"]) for m in marks] == [("failed: KeyError", chrome.tracks["steps"])]


@pytest.mark.asyncio
async def test_a_trace_file_that_cannot_be_written_is_a_warning_never_the_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    path = blocker / "run.json"
    engine = small_buckets(path)
    with caplog.at_level(logging.WARNING, logger="gsync"):
        result = await engine.fit(Deep(depth=4), make_batches(2, 16), optimizer=sgd, loss_fn=classification_loss)
        assert result.losses and result.trace is not None and result.trace.path is None
        fault = gsync.testing.fail(device=0, step=1, site="forward")
        with gsync.testing.inject(engine, fault), pytest.raises(gsync.WorkerFailed) as caught:
            await engine.fit(Deep(depth=4), make_batches(3, 16), optimizer=sgd, loss_fn=classification_loss)
    # No trace file named: none was written.
    assert str(caught.value) == (
        "worker on device cpu:0 (index 0) failed at step 1 during forward (its shard: 8 of the batch's 16 rows): "
        "InjectedFault: injected fault at device 0, step 1, forward"
    )
    assert sum("could not write the trace file" in r.getMessage() for r in caplog.records) == 2
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_trace_true_and_a_trace_of_your_own_write_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    mine = gsync.Trace()
    for setting in (True, mine):
        engine = small_buckets(setting)
        assert engine.trace_file is None
        result = await engine.fit(Deep(depth=4), make_batches(2, 16), optimizer=sgd, loss_fn=classification_loss)
        assert result.trace is not None and result.trace.path is None and result.trace.outcome == "ok"
        assert result.trace.select("all_reduce")[0].nbytes > 0
    assert result.trace is mine
    assert list(tmp_path.iterdir()) == []


def test_bad_trace_values_are_refused_before_any_work(tmp_path: Path) -> None:
    for bad in (1, None, "", "  ", b"run.json", ["run.json"], str(tmp_path), tmp_path, "traces/"):
        with pytest.raises(gsync.ConfigError, match="trace"):
            gsync.Engine(["cpu:0"], trace=bad)  # type: ignore[arg-type]
    assert gsync.Engine(["cpu:0"], trace="run.json").trace_file == Path.cwd() / "run.json"


def test_one_file_per_rank_across_processes_named_with_the_rank() -> None:
    path = Path("/runs/run.json")
    assert rank_file(path, 0, 1) == path
    assert rank_file(path, 0, 2) == Path("/runs/run.rank0.json")
    assert rank_file(path, 1, 2) == Path("/runs/run.rank1.json")
    assert rank_file(Path("/runs/trace"), 3, 4) == Path("/runs/trace.rank3")
    # An elastic run's world may shrink to one process (or grow from one): its files always name their rank.
    assert rank_file(path, 0, 1, per_rank=True) == Path("/runs/run.rank0.json")

    trace = gsync.Trace()
    trace.describe(1, 2, ["cpu:0", "cpu:1"])
    with trace.span("forward", 0, device=1):
        pass
    events = trace.to_chrome()["traceEvents"]
    assert isinstance(events, list)
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == ["gsync rank 1 of 2: cpu:0, cpu:1"]
    # Ranks' files merge into one timeline: their processes and tracks do not collide.
    other = gsync.Trace()
    other.describe(0, 2, ["cpu:0", "cpu:1"])
    others = other.to_chrome()["traceEvents"]
    assert isinstance(others, list)
    assert {e["pid"] for e in events}.isdisjoint(e["pid"] for e in others)
    assert {e["tid"] for e in events if "tid" in e}.isdisjoint(e["tid"] for e in others if "tid" in e)
