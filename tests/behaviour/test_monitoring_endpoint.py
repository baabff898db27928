"""``gsync.metrics.serve``: this process's sessions as a Prometheus endpoint, scraped over HTTP on the loopback and
read with prometheus_client's own parser, during a fit and after it."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import anyio.to_thread
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.models import Deep, classification_loss, make_batches, sgd

import gsync
import gsync.metrics
import gsync.testing


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


RANK = (("rank", "0"),)


def value(samples: dict[Any, float], name: str, labels: tuple[tuple[str, str], ...] = RANK) -> float:
    return samples.get((name, labels), 0.0)


class ScrapeAt:
    """A callback that scrapes the endpoint as step ``step`` ends, from a thread (the loop stays free)."""

    def __init__(self, url: str, step: int) -> None:
        self.url, self.step = url, step
        self.samples: dict[Any, float] = {}

    async def on_step_end(self, session: gsync.Session, result: gsync.StepResult) -> None:
        if result.step == self.step:
            self.samples = await anyio.to_thread.run_sync(scrape, self.url)


@pytest.mark.asyncio
async def test_the_endpoint_counts_steps_during_a_fit_and_after_it() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.metrics.serve(0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        before = await anyio.to_thread.run_sync(scrape, server.url)
        during = ScrapeAt(server.url, 2)
        result = await engine.fit(
            Deep(depth=3), make_batches(5, 16), optimizer=sgd, loss_fn=classification_loss, callbacks=[during]
        )
        after = await anyio.to_thread.run_sync(scrape, server.url)

    def delta(samples: dict[Any, float], name: str, labels: tuple[tuple[str, str], ...] = RANK) -> float:
        return value(samples, name, labels) - value(before, name, labels)

    # The monitor is the fit's first callback: step 2 is counted before the scrape at its end.
    assert delta(during.samples, "gsync_steps_total") == 3
    assert value(during.samples, "gsync_loss") == result.losses[2]
    assert delta(after, "gsync_steps_total") == 5
    assert delta(after, "gsync_step_duration_seconds_count") == 5
    assert delta(after, "gsync_step_duration_seconds_sum") == pytest.approx(sum(r.seconds for r in result.history))
    assert delta(after, "gsync_step_duration_seconds_bucket", (("le", "+Inf"),) + RANK) == 5
    assert delta(after, "gsync_reduced_bytes_total") == result.stats.reduced_bytes > 0
    assert value(after, "gsync_loss") == result.losses[-1]
    assert value(after, "gsync_world_size") == 1
    assert ("gsync_membership_changes_total", RANK) in after
    # Closed: nothing listens there any more.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


@pytest.mark.asyncio
async def test_a_failed_fit_is_counted_by_its_kind() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    kind = (("kind", "WorkerFailed"),) + RANK
    with gsync.metrics.serve(0) as server:
        before = await anyio.to_thread.run_sync(scrape, server.url)
        with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=1, site="backward")):
            with pytest.raises(gsync.WorkerFailed):
                await engine.fit(Deep(depth=3), make_batches(3, 16), optimizer=sgd, loss_fn=classification_loss)
        after = await anyio.to_thread.run_sync(scrape, server.url)
    assert value(after, "gsync_failures_total", kind) - value(before, "gsync_failures_total", kind) == 1
    assert value(after, "gsync_steps_total") - value(before, "gsync_steps_total") == 1


def test_bad_arguments_are_refused_before_anything_listens() -> None:
    with pytest.raises(gsync.ConfigError, match="port must be"):
        gsync.metrics.serve(70000)
    with pytest.raises(gsync.ConfigError, match="port must be"):
        gsync.metrics.serve("9100")  # type: ignore[arg-type]
    with pytest.raises(gsync.ConfigError, match="host must be"):
        gsync.metrics.serve(0, host="")
