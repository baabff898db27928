"""Loggers: ``fit(..., loggers=[...])`` and ``engine.session(..., loggers=[...])`` hand every step to objects shaped
like Lightning's ``Logger``: gsync's CSVLogger and TensorBoardLogger, a hand-written duck-typed one, Lightning's own.

(Rank 0 only, across processes: ``tests/multiproc/test_monitoring_multiprocess.py``.)
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tests.support.gates import CancelAfterStep
from tests.support.models import Deep, classification_loss, make_batches, sgd

import gsync
import gsync.testing
from gsync.loggers import CSVLogger, TensorBoardLogger


class Recording:
    """A logger written by hand to the protocol: it keeps every call it gets, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.calls.append(("log_hyperparams", dict(params)))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("log_metrics", (step, dict(metrics))))

    def finalize(self, status: str) -> None:
        self.calls.append(("finalize", status))

    def named(self, hook: str) -> list[Any]:
        return [args for name, args in self.calls if name == hook]

    def steps(self) -> list[int]:
        return [step for step, metrics in self.named("log_metrics") if "loss" in metrics]


def two_groups(params: Any) -> torch.optim.Optimizer:
    """Two parameter groups at different rates, so ``lr/<group>`` is logged."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.05}], momentum=0.9)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def step_rows(path: Path) -> list[dict[str, str]]:
    return [row for row in read_csv(path) if row["loss"] != ""]


def assert_rows_are_the_history(rows: list[dict[str, str]], history: list[Any]) -> None:
    assert [int(row["step"]) for row in rows] == [record.step for record in history]
    assert [float(row["loss"]) for row in rows] == [record.loss for record in history]
    assert [float(row["lr"]) for row in rows] == [record.lr for record in history]
    assert [float(row["rows"]) for row in rows] == [record.rows for record in history]
    assert [float(row["step_seconds"]) for row in rows] == [record.seconds for record in history]


@pytest.mark.asyncio
async def test_the_csv_rows_are_the_fit_history_with_every_documented_key(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.005, bucket_cap_mb=0.01, trace=True)
    csv_logger = CSVLogger(tmp_path / "csv")
    result = await engine.fit(
        Deep(depth=3), make_batches(6, 16), optimizer=two_groups, loss_fn=classification_loss,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        clip_grad_norm=1.0, loggers=[csv_logger],
    )
    rows = read_csv(tmp_path / "csv" / "metrics.csv")
    assert list(rows[0]) == [
        "step", "loss", "lr", "lr/0", "lr/1", "grad_norm", "rows", "step_seconds", "samples_per_second",
        "reduced_bytes", "comm_exposed_seconds", "skipped", "world_size",
    ]
    assert_rows_are_the_history(rows, result.history)
    assert [(float(row["lr/0"]), float(row["lr/1"])) for row in rows] == [record.lrs for record in result.history]
    assert len({record.lr for record in result.history}) == 3  # the scheduler's steps are in the file
    assert [float(row["grad_norm"]) for row in rows] == [record.grad_norm for record in result.history]
    assert sum(int(float(row["reduced_bytes"])) for row in rows) == result.stats.reduced_bytes > 0
    for row in rows:
        assert float(row["samples_per_second"]) == pytest.approx(float(row["rows"]) / float(row["step_seconds"]))
        assert 0.0 <= float(row["comm_exposed_seconds"]) <= float(row["step_seconds"])
        assert (row["skipped"], row["world_size"]) == ("0.0", "1.0")
    hparams = (tmp_path / "csv" / "hparams.json").read_text()
    for expected in ('"devices": "cpu:0,cpu:1"', '"model": "Deep"', '"optimizer": "SGD"', '"scheduler"',
                     '"clip_grad_norm": 1.0', '"epochs": 1', '"world_size": 1'):
        assert expected in hparams
    assert csv_logger.status == "success"


@pytest.mark.asyncio
async def test_a_held_session_logs_each_step_and_its_evaluations_in_the_step_row(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    batches = make_batches(4, 16)
    csv_logger, recording = CSVLogger(tmp_path), Recording()
    session = await engine.session(Deep(depth=3), optimizer=sgd, loss_fn=classification_loss, loggers=[csv_logger, recording])
    results = [await session.step(batch) for batch in batches[:2]]
    evaluated = await session.evaluate(batches[2:])
    results.append(await session.step(batches[3]))
    # The file is read while the session is open: each row is there as its step ends.
    rows = read_csv(tmp_path / "metrics.csv")
    await session.aclose()

    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    assert [float(row["loss"]) for row in rows] == [result.loss for result in results]
    assert [row["eval/loss"] for row in rows] == ["", repr(evaluated["loss"]), ""]
    assert recording.named("log_metrics")[2] == (1, {"eval/loss": evaluated["loss"]})
    assert recording.steps() == [0, 1, 2]
    assert len(recording.named("log_hyperparams")) == 1 and recording.calls[0][0] == "log_hyperparams"
    assert recording.named("finalize") == ["success"] and recording.calls[-1] == ("finalize", "success")


@pytest.mark.asyncio
async def test_a_resumed_fit_continues_the_steps_in_its_rows(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    batches = make_batches(6, 16)
    first = await engine.fit(
        Deep(depth=3), batches[:3], optimizer=sgd, loss_fn=classification_loss, loggers=[CSVLogger(tmp_path / "a")]
    )
    assert first.checkpoint is not None and first.checkpoint.step == 2
    resumed = await engine.fit(
        Deep(depth=3), batches, optimizer=sgd, loss_fn=classification_loss, resume=first.checkpoint,
        loggers=[CSVLogger(tmp_path / "b")],
    )
    rows = read_csv(tmp_path / "b" / "metrics.csv")
    assert [int(row["step"]) for row in rows] == [3, 4, 5]
    assert_rows_are_the_history(rows, resumed.history)
    assert '"resume_step": 2' in (tmp_path / "b" / "hparams.json").read_text()


@pytest.mark.asyncio
async def test_a_duck_typed_logger_gets_hyperparameters_once_each_step_once_and_success() -> None:
    recording = Recording()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    result = await engine.fit(
        Deep(depth=3), make_batches(4, 16), optimizer=sgd, loss_fn=classification_loss, epochs=2, loggers=[recording]
    )
    assert [name for name, _ in recording.calls] == ["log_hyperparams"] + ["log_metrics"] * 8 + ["finalize"]
    assert recording.steps() == [record.step for record in result.history] == list(range(8))
    assert [metrics["loss"] for _, metrics in recording.named("log_metrics")] == result.losses
    params = recording.named("log_hyperparams")[0]
    assert params["epochs"] == 2 and params["optimizer/lr"] == 0.1 and params["optimizer/momentum"] == 0.9
    assert recording.named("finalize") == ["success"]


@pytest.mark.asyncio
async def test_a_failed_fit_finalizes_its_loggers_with_failed() -> None:
    recording = Recording()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=2, site="backward")):
        with pytest.raises(gsync.WorkerFailed):
            await engine.fit(Deep(depth=3), make_batches(4, 16), optimizer=sgd, loss_fn=classification_loss, loggers=recording)
    assert recording.steps() == [0, 1]
    assert recording.calls[-1] == ("finalize", "failed") and len(recording.named("finalize")) == 1


@pytest.mark.asyncio
async def test_a_cancelled_fit_finalizes_its_loggers_with_cancelled() -> None:
    recording = Recording()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with anyio.CancelScope() as scope:
        await engine.fit(
            Deep(depth=3), make_batches(5, 16), optimizer=sgd, loss_fn=classification_loss,
            callbacks=[CancelAfterStep(scope, 1)], loggers=[recording],
        )
    assert scope.cancelled_caught
    assert recording.steps() == [0, 1]
    assert recording.calls[-1] == ("finalize", "cancelled") and len(recording.named("finalize")) == 1


@pytest.mark.asyncio
async def test_a_held_session_that_fails_finalizes_failed_once(tmp_path: Path) -> None:
    recording = Recording()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    batches = make_batches(3, 16)
    session = await engine.session(Deep(depth=3), optimizer=sgd, loss_fn=classification_loss, loggers=[recording])
    await session.step(batches[0])
    with gsync.testing.inject(engine, gsync.testing.fail(device=0, step=1, site="forward")):
        with pytest.raises(gsync.WorkerFailed):
            await session.step(batches[1])
    await session.aclose()
    assert recording.steps() == [0]
    assert recording.named("finalize") == ["failed"]


@pytest.mark.asyncio
async def test_a_logger_that_raises_is_reported_once_and_disabled_and_training_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Recording):
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            super().log_metrics(metrics, step)
            if step == 1:
                raise RuntimeError("the dashboard is down")

    broken, healthy = Broken(), Recording()
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with caplog.at_level(logging.ERROR, logger="gsync"):
        result = await engine.fit(
            Deep(depth=3), make_batches(4, 16), optimizer=sgd, loss_fn=classification_loss, loggers=[broken, healthy]
        )
    assert len(result.history) == 4
    reports = [record for record in caplog.records if record.name == "gsync" and "disabled" in record.getMessage()]
    assert len(reports) == 1
    assert "Broken" in reports[0].getMessage() and "log_metrics" in reports[0].getMessage()
    assert reports[0].exc_info is not None and "the dashboard is down" in str(reports[0].exc_info[1])
    assert broken.steps() == [0, 1] and broken.named("finalize") == []  # disabled: not called again, not even at the end
    assert healthy.steps() == [0, 1, 2, 3] and healthy.named("finalize") == ["success"]


@pytest.mark.asyncio
async def test_bad_loggers_are_refused_before_any_work() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    model, batches = Deep(depth=3), make_batches(2, 16)

    class Async:
        async def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    with pytest.raises(gsync.InputTypeError, match="no log_metrics"):
        await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, loggers=[object()])
    with pytest.raises(gsync.InputTypeError, match="loggers must be a list"):
        await engine.fit(model, batches, optimizer=sgd, loss_fn=classification_loss, loggers="csv")
    with pytest.raises(gsync.InputTypeError, match="async log_metrics"):
        engine.session(model, optimizer=sgd, loss_fn=classification_loss, loggers=[Async()])
    with pytest.raises(gsync.InputTypeError, match="log_all_ranks"):
        engine.session(model, optimizer=sgd, loss_fn=classification_loss, loggers=[Recording()], log_all_ranks="yes")  # type: ignore[arg-type]
    # Nothing ran: the engine opens a session at once.
    async with engine.session(model, optimizer=sgd, loss_fn=classification_loss) as session:
        assert session.next_step == 0


@pytest.mark.asyncio
async def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = gsync.Engine(["cpu:0", "cpu:1"])
    board = TensorBoardLogger(tmp_path)
    result = await engine.fit(
        Deep(depth=3), make_batches(5, 16), optimizer=sgd, loss_fn=classification_loss, loggers=[board]
    )
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()
    assert {"loss", "lr", "rows", "step_seconds", "samples_per_second", "reduced_bytes"} <= set(tags["scalars"])
    losses = events.Scalars("loss")
    assert [event.step for event in losses] == [record.step for record in result.history]
    # Scalars are stored as float32.
    assert [event.value for event in losses] == pytest.approx(result.losses, rel=1e-6)
    assert [event.value for event in events.Scalars("lr")] == pytest.approx([0.1] * 5)
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(events.PluginTagToContent("hparams"))
    assert board.status == "success"


def test_tensorboard_logger_without_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed: its import fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'gsync\[monitoring\]'"):
        TensorBoardLogger(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_lightnings_own_loggers_work_unchanged(tmp_path: Path) -> None:
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lightning_csv = loggers.CSVLogger(str(tmp_path), name="csv", version=0)
    lightning_tb = loggers.TensorBoardLogger(str(tmp_path), name="tb", version=0, default_hp_metric=False)
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    result = await engine.fit(
        Deep(depth=3), make_batches(4, 16), optimizer=sgd, loss_fn=classification_loss,
        loggers=[lightning_csv, lightning_tb],
    )
    rows = [row for row in read_csv(Path(lightning_csv.log_dir) / "metrics.csv") if row.get("loss")]
    assert [int(row["step"]) for row in rows] == [record.step for record in result.history]
    assert [float(row["loss"]) for row in rows] == pytest.approx(result.losses, rel=1e-12)
    assert "optimizer: SGD" in (Path(lightning_csv.log_dir) / "hparams.yaml").read_text()
    events = EventAccumulator(lightning_tb.log_dir)
    events.Reload()
    assert [event.step for event in events.Scalars("loss")] == [record.step for record in result.history]
