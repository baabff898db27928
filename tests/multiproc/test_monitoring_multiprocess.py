"""Loggers across 2 real processes (gloo on loopback): rank 0 logs by default, every rank with log_all_ranks=True;
each process's metrics endpoint labels its samples with its rank."""

from __future__ import annotations

import asyncio
import csv
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import run_ranks
from tests.support.models import TiedNet, classification_loss, make_batches, sgd


def logged_fits(directory: str) -> dict[str, Any]:
    """Each rank: a fit logging to ``rank<N>/`` by default, then one with ``log_all_ranks=True`` to ``all<N>/``."""
    import gsync
    import gsync.metrics
    from gsync.loggers import CSVLogger
    from prometheus_client.parser import text_string_to_metric_families

    rank = int(os.environ["RANK"])
    engine = gsync.Engine(["cpu"], sync_timeout=20)
    batches = make_batches(3, 8)
    with gsync.metrics.serve(0) as server:
        first = asyncio.run(engine.fit(
            TiedNet(), batches, optimizer=sgd, loss_fn=classification_loss, loggers=[CSVLogger(Path(directory) / f"rank{rank}")]
        ))
        second = asyncio.run(engine.fit(
            TiedNet(), batches, optimizer=sgd, loss_fn=classification_loss,
            loggers=[CSVLogger(Path(directory) / f"all{rank}")], log_all_ranks=True,
        ))
        with urllib.request.urlopen(server.url, timeout=10) as response:
            scraped = response.read().decode()
    steps = {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(scraped) if family.name == "gsync_steps"
        for sample in family.samples if sample.name == "gsync_steps_total"
    }
    return {"losses": first.losses, "all_losses": second.losses, "steps": steps}


def _losses(path: Path) -> list[float]:
    with open(path / "metrics.csv", newline="") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


@pytest.mark.timeout(90)
def test_only_rank_0_logs_unless_every_rank_is_asked_to(tmp_path: Path) -> None:
    results = run_ranks(logged_fits, 2, args=(str(tmp_path),), timeout=80, check=True)
    # Rank 1's logger was never called: it wrote nothing, not even its directory.
    assert not (tmp_path / "rank1").exists()
    assert _losses(tmp_path / "rank0") == results[0].value["losses"]
    for rank in (0, 1):
        assert _losses(tmp_path / f"all{rank}") == results[rank].value["all_losses"]
        # Each process counts its own steps under its own rank.
        assert results[rank].value["steps"] == {str(rank): 6.0}
