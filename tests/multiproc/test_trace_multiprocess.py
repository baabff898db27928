"""Trace files across 2 real processes (gloo on loopback): one file per rank, named and labelled with the rank."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.harness import run_ranks


def traced_fits(directory: str) -> dict[str, Any]:
    """Each rank: a fit that succeeds, then one where rank 1's device fails at step 2; both traced to ``run.json``."""
    import gsync
    import gsync.testing

    rank = int(os.environ["RANK"])
    engine = gsync.Engine(["cpu"], sync_timeout=20, trace=Path(directory) / "run.json")
    out: dict[str, Any] = {}
    result = asyncio.run(engine.fit(TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss))
    assert result.trace is not None and result.trace.path is not None
    first = json.loads(result.trace.path.read_text())
    out["first"] = {"path": str(result.trace.path), "outcome": first["otherData"]["outcome"]}
    faults = [gsync.testing.fail(0, 2, "backward", error=RuntimeError("boom on rank 1"))] if rank == 1 else []
    try:
        with gsync.testing.inject(engine, *faults):
            asyncio.run(engine.fit(TiedNet(), make_batches(5, 8), optimizer=sgd, loss_fn=classification_loss))
    except gsync.GsyncError as error:
        out["error"] = {"type": type(error).__name__, "message": str(error)}
    return out


def _read(path: Path) -> tuple[dict[str, Any], dict[str, int], list[dict[str, Any]]]:
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return doc, tracks, events


@pytest.mark.timeout(90)
def test_every_rank_writes_its_own_file_named_and_labelled_with_its_rank(tmp_path: Path) -> None:
    results = run_ranks(traced_fits, 2, args=(str(tmp_path),), timeout=80, check=True)
    files = {rank: tmp_path / f"run.rank{rank}.json" for rank in (0, 1)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.rank0.json", "run.rank1.json"]
    for result in results:
        assert result.value["first"] == {"path": str(files[result.rank]), "outcome": "ok"}
        # The error message ends with this rank's own file.
        assert result.value["error"]["message"].endswith(f" (trace: {files[result.rank]})"), result.value
    assert results[1].value["error"]["type"] == "WorkerFailed"
    assert results[0].value["error"]["type"] in ("PeerFailed", "PeerLost"), results[0].value

    pids = set()
    for rank, path in files.items():
        doc, tracks, events = _read(path)
        assert doc["otherData"]["rank"] == rank and doc["otherData"]["world_size"] == 2
        assert doc["otherData"]["outcome"] == "failed"
        names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
        assert names == [f"gsync rank {rank} of 2: cpu:0"]
        assert set(tracks) == {"steps", "device 0 (cpu:0)", "sync server / communication"}
        assert any(e["name"].startswith("all_reduce") and e["args"]["bytes"] > 0 for e in events if e["ph"] == "X")
        pids |= {e["pid"] for e in events}
        # The error this rank raised is marked once (failures it carries in `.others` would add their own marks).
        raised = results[rank].value["error"]["type"]
        marks = [e for e in events if e["ph"] == "i" and e["name"] == f"failed: {raised}"]
        assert len(marks) == 1, [e for e in events if e["ph"] == "i"]
        if rank == 1:
            assert marks[0]["tid"] == tracks["device 0 (cpu:0)"] and marks[0]["args"]["step"] == 2
        else:
            # The failure happened on another rank: marked on this rank's steps track, naming that rank.
            assert marks[0]["tid"] == tracks["steps"] and "rank 1" in marks[0]["args"]["message"]
    assert len(pids) == 2
