"""Loggers for ``fit(..., loggers=[...])`` and ``engine.session(..., loggers=[...])``, with no framework needed.

A logger is any object shaped like Lightning's ``Logger`` (:class:`Logger`
says what gsync calls), so Lightning's own ``TensorBoardLogger``,
``CSVLogger``, ``WandbLogger`` and ``MLFlowLogger`` work unchanged. These two
need nothing of Lightning: :class:`CSVLogger` writes a ``metrics.csv`` with one
row per step; :class:`TensorBoardLogger` writes TensorBoard scalars through
``torch.utils.tensorboard`` (the ``tensorboard`` package, in the
``gsync[monitoring]`` extra).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from ._core.monitoring.extras import require

__all__ = ("CSVLogger", "Logger", "TensorBoardLogger")


@runtime_checkable
class Logger(Protocol):
    """What gsync calls on a logger, on rank 0 (every rank with ``log_all_ranks=True``), on the event loop.

    Only ``log_metrics`` is required; gsync calls ``log_hyperparams`` and
    ``finalize`` when the logger has them. A call that raises disables that
    logger for the rest of the run (logged on the ``gsync`` logger).
    """

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics (``step``: the global step, ``StepRecord.step``), or ``eval/<name>`` results."""


class CSVLogger:
    """``metrics.csv`` in ``directory``: a header, then one row per step; ``hparams.json`` beside it.

    Columns are ``step`` and the metric names in the order first seen; a
    metric that appears later (an ``eval/loss``) adds a column and the file is
    rewritten with it (rare: once per new name). Metrics logged at the step of
    the last row (an evaluation after it) go into that row. Each row is flushed
    as it is written, so the file can be read while the run goes on. Numbers
    are written exactly (``repr``), so reading them back gives the same floats.

    :param directory: created at the first write if missing (a rank that does not log writes nothing); an
        existing ``metrics.csv`` there is replaced.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / "metrics.csv"
        """The metrics file."""
        self.status: str | None = None
        """How the run ended, once :meth:`finalize` was called."""
        self._columns: list[str] = ["step"]
        self._row: dict[str, Any] | None = None
        self._row_at = 0  # the file offset where the last row begins, to rewrite it when that step logs again
        self._file: TextIO | None = None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "hparams.json", "w", encoding="utf-8") as handle:
            json.dump(params, handle, indent=2, default=str)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", newline="", encoding="utf-8")
        elif self._file.closed:  # logged to again after a finalize: a later run goes on in the same file
            self._file = open(self.path, "a", newline="", encoding="utf-8")
        if self._row is not None and self._row["step"] == step:
            row = {**self._row, **metrics}
            self._file.seek(self._row_at)
            self._file.truncate()
        else:
            row = {"step": step, **metrics}
            self._row_at = self._file.tell()
        new = [name for name in row if name not in self._columns]
        if new or self._row_at == 0:
            self._columns += new
            self._rewrite(self._file, row)
        else:
            csv.writer(self._file).writerow([row.get(name, "") for name in self._columns])
        self._row = row
        self._file.flush()

    def _rewrite(self, file: TextIO, last: dict[str, Any]) -> None:
        """The whole file again under the widened header (earlier rows leave the new columns empty)."""
        rows: list[dict[str, Any]] = []
        if self._row_at:  # the rows before the last one, as written so far (the last is not in the file)
            with open(self.path, newline="", encoding="utf-8") as handle:
                rows = list(csv.DictReader(handle))
        file.seek(0)
        file.truncate()
        writer = csv.writer(file)
        writer.writerow(self._columns)
        for row in rows:
            writer.writerow([row.get(name, "") for name in self._columns])
        self._row_at = file.tell()
        writer.writerow([last.get(name, "") for name in self._columns])

    def finalize(self, status: str) -> None:
        self.status = status
        if self._file is not None:
            self._file.close()

    def __repr__(self) -> str:
        return f"CSVLogger({str(self.directory)!r})"


class TensorBoardLogger:
    """TensorBoard event files in ``directory``: each metric a scalar at its step; hyperparameters in the HParams tab.

    Written through ``torch.utils.tensorboard.SummaryWriter``, in its own
    thread, flushed at the end of the run. View with ``tensorboard --logdir
    DIRECTORY``.

    :param directory: created if missing.
    :raises ModuleNotFoundError: without the ``tensorboard`` package: ``pip install 'gsync[monitoring]'``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        require("tensorboard", "gsync.loggers.TensorBoardLogger")
        tensorboard = require("torch.utils.tensorboard", "gsync.loggers.TensorBoardLogger")
        self.directory = Path(directory)
        self.writer = tensorboard.SummaryWriter(log_dir=str(self.directory))
        """The ``SummaryWriter``, to add what gsync does not log (images, histograms)."""
        self.status: str | None = None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # As Lightning's logger does: the HParams plugin's summaries in this run's own file, not a run beside it.
        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()}
        experiment, start, end = hparams(values, {})
        file_writer = self.writer._get_file_writer()
        for summary in (experiment, start, end):
            file_writer.add_summary(summary)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def finalize(self, status: str) -> None:
        self.status = status
        self.writer.add_text("status", status)
        self.writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardLogger({str(self.directory)!r})"
