"""``python -m gsync.report run.json -o report.png``: a picture of a run from its trace file, failed runs' too.

It draws what :meth:`gsync.FitResult.plot` draws, from the Chrome trace
gsync wrote (``Engine(trace="run.json")``): step time with its exposed
communication, membership changes and the failure marked, and each device's
time per phase. A trace holds the timeline, not the losses: pass the
``metrics.csv`` of a :class:`gsync.loggers.CSVLogger` with ``--metrics`` to add
the loss and learning rate. Needs matplotlib (``pip install 'gsync[monitoring]'``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._core.monitoring.plotting import draw
from ._core.monitoring.series import series_of_chrome
from .errors import ConfigError

__all__ = ("main", "plot_trace")


def plot_trace(
    trace_file: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
    metrics: str | os.PathLike[str] | None = None,
) -> Any:
    """The picture of the run in ``trace_file`` (a ``matplotlib.figure.Figure``), written to ``path`` if given.

    :param metrics: a ``metrics.csv`` from :class:`gsync.loggers.CSVLogger`, for the loss and learning rate.
    :raises ~gsync.ConfigError: for a file that is missing or is not a trace gsync wrote, before drawing.
    """
    doc = _read_trace(Path(trace_file))
    rows: list[dict[str, str]] = []
    if metrics is not None:
        try:
            with open(metrics, newline="", encoding="utf-8") as handle:
                rows = list(csv.DictReader(handle))
        except OSError as error:
            raise ConfigError(f"cannot read the metrics file {str(metrics)!r}: {error}") from error
    return draw(series_of_chrome(doc, rows), path)


def _read_trace(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read the trace file {str(path)!r}: {error}") from error
    except ValueError as error:
        raise ConfigError(f"{str(path)!r} is not JSON, so not a trace gsync wrote: {error}") from error
    if not isinstance(doc, dict) or "traceEvents" not in doc or "otherData" not in doc:
        raise ConfigError(f"{str(path)!r} is not a trace gsync wrote (Engine(trace='run.json') writes one)")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2 for bad arguments or a file that is not a trace)."""
    parser = argparse.ArgumentParser(prog="python -m gsync.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace file gsync wrote (run.json, or one rank's run.rank0.json)")
    parser.add_argument("-o", "--output", default="report.png", help="the picture to write (.png, .svg, .pdf)")
    parser.add_argument("--metrics", help="a metrics.csv from gsync.loggers.CSVLogger, for loss and learning rate")
    args = parser.parse_args(argv)
    try:
        plot_trace(args.trace, args.output, args.metrics)
    except (ConfigError, ModuleNotFoundError) as error:
        print(f"gsync.report: {error}", file=sys.stderr)
        return 2
    print(f"gsync.report: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
