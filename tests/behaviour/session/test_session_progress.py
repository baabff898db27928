"""fit's progress display: rank 0's bar outside tests and CI, a log without tqdm, tqdm's own switch."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch

import gsync
import gsync.testing
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

pytestmark = pytest.mark.asyncio


async def test_the_default_progress_display_is_rank_0s_outside_tests_and_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    from gsync._core.session.progress import progress_wanted

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    # Under torchrun every rank runs the same steps: one bar, not one per rank fighting over the terminal.
    assert [progress_wanted(None, rank) for rank in range(3)] == [True, False, False]
    assert [progress_wanted(True, rank) for rank in range(3)] == [True, True, True]
    monkeypatch.setenv("CI", "true")
    assert progress_wanted(None, 0) is False


async def test_fit_progress_logs_without_tqdm(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed: importing it fails
    caplog.set_level("INFO", logger="gsync")
    await gsync.Engine(TWO).fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss, progress=True)
    assert any("step 0 (epoch 0): loss" in record.getMessage() for record in caplog.records)


async def test_fit_progress_bar_formats_figures_only_to_redraw_and_ends_on_the_last_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tqdm = pytest.importorskip("tqdm")
    formatted: list[object] = []
    set_postfix = tqdm.std.tqdm.set_postfix
    monkeypatch.setattr(tqdm.std.tqdm, "set_postfix", lambda bar, *a, **k: formatted.append(k) or set_postfix(bar, *a, **k))
    # No redraw during the run, so no figures are formatted for one. (Not TQDM_MININTERVAL: tqdm reads its
    # environment once, as it is imported, and without it a slow step redraws after tqdm's default 0.1 s.)
    monkeypatch.setattr(tqdm.std.tqdm, "__init__", functools.partialmethod(tqdm.std.tqdm.__init__, mininterval=1000))
    result = await gsync.Engine(TWO).fit(
        TiedNet(), make_batches(6, 8), optimizer=sgd, loss_fn=classification_loss, progress=True
    )
    final = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert "6/6" in final and f"loss={result.losses[-1]:.4g}" in final, final
    assert len(formatted) == 1  # at the end


async def test_fit_progress_bar_disabled_by_tqdms_environment_still_trains(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tqdm = pytest.importorskip("tqdm")
    torch.manual_seed(0)
    model = TiedNet()
    expected, expected_losses = train_reference(model, make_batches(3, 8))
    # What TQDM_DISABLE=1 does to every bar (set so: tqdm reads its environment only as it is imported).
    monkeypatch.setattr(tqdm.std.tqdm, "__init__", functools.partialmethod(tqdm.std.tqdm.__init__, disable=True))
    result = await gsync.Engine(TWO).fit(
        copy.deepcopy(model), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, progress=True
    )
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert_same_state(result.model, expected)
    assert capsys.readouterr().err == ""  # the disabled bar drew nothing, and nothing fell back to lines


def bar_lines(err: str) -> list[str]:
    """The bar's states as tqdm drew them (each redraw starts with a carriage return)."""
    return [line for line in err.replace("\n", "\r").split("\r") if "step" in line]


async def test_a_session_fits_bar_counts_its_own_steps_after_earlier_steps(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    batches = make_batches(6, 8)
    async with gsync.Engine(TWO).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        for batch in batches[:2]:
            await session.step(batch)
        capsys.readouterr()
        first = await session.fit(batches, progress=True)
        first_bar = bar_lines(capsys.readouterr().err)
        second = await session.fit(batches, progress=True)
        second_bar = bar_lines(capsys.readouterr().err)
    assert (first.first_step, second.first_step) == (2, 8)
    # The call's progress against the call's total, from 0; the global step among the figures.
    for bar, last_step in ((first_bar, 7), (second_bar, 13)):
        assert bar[0].startswith("  0%") and "0/6" in bar[0], bar
        assert bar[-1].startswith("100%") and "6/6" in bar[-1] and f"step={last_step}," in bar[-1], bar


async def test_a_resumed_fits_bar_starts_where_its_checkpoint_is(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    engine = gsync.Engine(TWO)
    batches = make_batches(6, 8)
    with gsync.testing.inject(engine, gsync.testing.fail(0, 3, "forward")), pytest.raises(gsync.WorkerFailed) as caught:
        await engine.fit(TiedNet(), batches, optimizer=sgd, loss_fn=classification_loss, progress=False)
    capsys.readouterr()
    await engine.fit(
        TiedNet(), batches, optimizer=sgd, loss_fn=classification_loss, resume=caught.value.checkpoint, progress=True
    )
    bar = bar_lines(capsys.readouterr().err)
    # Replaying the data skips steps 0..2, which the checkpoint holds: the run is half done as it resumes.
    assert "3/6" in bar[0] and bar[-1].startswith("100%") and "6/6" in bar[-1], bar
