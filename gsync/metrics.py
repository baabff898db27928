"""A Prometheus endpoint for this process's training: ``server = gsync.metrics.serve(9100)``.

Every session of the process (a fit's, a held one's) counts its steps into
one set of numbers, kept whether or not anything serves them; :func:`serve`
exposes them over HTTP through ``prometheus_client`` (in the
``gsync[monitoring]`` extra), in Prometheus' text format:

========================================  =========  =======================================================
``gsync_steps_total``                     counter    optimizer steps applied
``gsync_step_duration_seconds``           histogram  wall time of each step
``gsync_reduced_bytes_total``             counter    gradient bytes all-reduced per device
``gsync_loss``                            gauge      the last step's global mean loss
``gsync_membership_changes_total``        counter    an elastic run's membership changes
``gsync_failures_total{kind}``            counter    sessions ended by a failure, by error type (``WorkerFailed``)
``gsync_world_size``                      gauge      processes in the run, as of the last step
========================================  =========  =======================================================

Each sample has a ``rank`` label: across processes each rank serves its own
endpoint (on its own port: ``serve(9100 + rank)``), and a scrape of all of
them tells the ranks apart. To add these to a registry of your own instead
(beside your service's metrics), register :func:`collector`.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any

from ._core.monitoring.extras import require
from ._core.monitoring.process_metrics import DURATION_BUCKETS, PROCESS
from .errors import ConfigError

__all__ = ("MetricsServer", "collector", "serve")


def collector() -> Any:
    """A ``prometheus_client`` collector of gsync's metrics: ``REGISTRY.register(gsync.metrics.collector())``.

    :raises ModuleNotFoundError: without ``prometheus_client``: ``pip install 'gsync[monitoring]'``.
    """
    core = require("prometheus_client.core", "gsync.metrics")
    registry = require("prometheus_client.registry", "gsync.metrics")

    class GsyncCollector(registry.Collector):  # type: ignore[misc,name-defined]
        def collect(self) -> Iterator[Any]:
            yield from _families(core)

        def describe(self) -> Iterator[Any]:
            yield from _families(core)

    return GsyncCollector()


def _families(core: Any) -> Iterator[Any]:
    """One scrape: a consistent snapshot of every rank's counters, as metric families."""
    ranks = sorted(PROCESS.snapshot().items())
    steps = core.CounterMetricFamily("gsync_steps", "Optimizer steps applied.", labels=["rank"])
    durations = core.HistogramMetricFamily(
        "gsync_step_duration_seconds", "Wall time of each optimizer step.", labels=["rank"]
    )
    reduced = core.CounterMetricFamily(
        "gsync_reduced_bytes", "Gradient bytes all-reduced, per device.", labels=["rank"], unit="bytes"
    )
    loss = core.GaugeMetricFamily("gsync_loss", "The last step's global mean loss.", labels=["rank"])
    changes = core.CounterMetricFamily(
        "gsync_membership_changes", "Membership changes of an elastic run.", labels=["rank"]
    )
    failures = core.CounterMetricFamily(
        "gsync_failures", "Sessions ended by a failure, by the error's type.", labels=["rank", "kind"]
    )
    world = core.GaugeMetricFamily("gsync_world_size", "Processes in the run, as of the last step.", labels=["rank"])
    for rank, counters in ranks:
        label = [str(rank)]
        steps.add_metric(label, counters.steps)
        cumulative, buckets = 0, []
        for bound, count in zip((*(str(b) for b in DURATION_BUCKETS), "+Inf"), counters.duration_counts):
            cumulative += count
            buckets.append((bound, cumulative))
        durations.add_metric(label, buckets, counters.duration_sum)
        reduced.add_metric(label, counters.reduced_bytes)
        if counters.loss is not None:
            loss.add_metric(label, counters.loss)
        changes.add_metric(label, counters.membership_changes)
        for kind, count in sorted(counters.failures.items()):
            failures.add_metric([*label, kind], count)
        world.add_metric(label, counters.world_size)
    yield from (steps, durations, reduced, loss, changes, failures, world)


class MetricsServer:
    """A running endpoint (what :func:`serve` returns); ``close()`` it, or use it as a context manager."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server, self._thread = server, thread
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]
        """The port it listens on (the one chosen when ``serve`` was given 0)."""

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and wait for the server's thread to end. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gsync.metrics.MetricsServer {self.url}>"


def serve(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve this process's gsync metrics at ``http://host:port/metrics``, from a thread of its own.

    :param port: 0 for any free port (see :attr:`MetricsServer.port`).
    :param host: the address to listen on; the loopback by default, ``"0.0.0.0"`` for a scraper on another host.
    :raises ~gsync.ConfigError: for a port outside 0-65535 or a host that is not a string, before anything starts.
    :raises ModuleNotFoundError: without ``prometheus_client``: ``pip install 'gsync[monitoring]'``.
    :raises OSError: when the port cannot be bound (already in use).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int from 0 (any free port) to 65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be an address to listen on, such as '127.0.0.1', got {host!r}")
    client = require("prometheus_client", "gsync.metrics.serve")
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(collector())
    server, thread = client.start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
