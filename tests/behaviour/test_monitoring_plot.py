"""Pictures: ``FitResult.plot`` and ``python -m gsync.report`` write a PNG that shows the run (not a blank canvas),
from a successful fit and from a failed run's trace file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from tests.support.models import Deep, classification_loss, make_batches, sgd

import gsync
import gsync.report
import gsync.testing
from gsync.loggers import CSVLogger


def assert_a_real_picture(path: Path, panels: int) -> None:
    """A PNG of the expected height, with ink on a good share of it, in several colours (lines, bars, legends)."""
    assert path.stat().st_size > 20_000
    pixels = imread(str(path))[..., :3]
    height, width = pixels.shape[:2]
    assert width == 1100 and height == pytest.approx((2.6 * panels + 0.6) * 110, abs=2)
    ink = (pixels < 0.9).any(axis=2)
    assert 0.03 < ink.mean() < 0.6
    colours = {tuple(c) for c in (pixels[ink] * 8).astype(int)}
    assert len(colours) > 20
    # Every panel has something drawn in it: each horizontal band of the picture has ink.
    for band in np.array_split(ink, panels, axis=0):
        assert band.mean() > 0.01


@pytest.mark.asyncio
async def test_a_fits_plot_is_written_to_a_png(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], first_bucket_mb=0.005, bucket_cap_mb=0.01, trace=True)
    result = await engine.fit(
        Deep(depth=3), make_batches(12, 16), optimizer=sgd, loss_fn=classification_loss,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5),
    )
    figure = result.plot(tmp_path / "fit.png")
    # Loss, learning rate, step time, phases; outside a notebook the figure is returned.
    assert [ax.get_ylabel() for ax in figure.axes][:3] == ["loss", "learning rate", "step time (ms)"]
    assert list(figure.axes[0].lines[0].get_ydata()) == result.losses
    assert_a_real_picture(tmp_path / "fit.png", panels=4)
    assert type(result.plot()).__name__ == "Figure"


@pytest.mark.timeout(120)  # the command line starts a Python that imports torch and matplotlib
@pytest.mark.asyncio
async def test_the_report_draws_a_failed_runs_trace_with_its_logged_losses(tmp_path: Path) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], trace=tmp_path / "run.json")
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=6, site="backward")):
        with pytest.raises(gsync.WorkerFailed):
            await engine.fit(
                Deep(depth=3), make_batches(10, 16), optimizer=sgd, loss_fn=classification_loss,
                loggers=[CSVLogger(tmp_path)],
            )
    figure = gsync.report.plot_trace(tmp_path / "run.json", tmp_path / "report.png", metrics=tmp_path / "metrics.csv")
    assert figure.get_suptitle() == "gsync run, rank 0 of 1: failed"
    assert figure.axes[0].get_ylabel() == "loss" and len(figure.axes[0].lines[0].get_ydata()) == 6
    # The failure is a line at step 6 on the panels over steps.
    assert [line.get_xdata()[0] for line in figure.axes[0].lines[1:]] == [6]
    assert_a_real_picture(tmp_path / "report.png", panels=4)

    # The command line, as a user runs it: the trace alone (no losses: step time and phases).
    done = subprocess.run(
        [sys.executable, "-m", "gsync.report", str(tmp_path / "run.json"), "-o", str(tmp_path / "cli.png")],
        capture_output=True, text=True, timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gsync.report: wrote {tmp_path / 'cli.png'}"
    assert_a_real_picture(tmp_path / "cli.png", panels=2)


def test_the_report_refuses_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"not": "a trace"}')
    with pytest.raises(gsync.ConfigError, match="not a trace gsync wrote"):
        gsync.report.plot_trace(tmp_path / "x.json")
    assert gsync.report.main([str(tmp_path / "missing.json"), "-o", str(tmp_path / "r.png")]) == 2
    assert not (tmp_path / "r.png").exists()
