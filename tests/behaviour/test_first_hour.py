"""What a new user runs into in their first hour, each tried as they would: a gsync answer that says what to change."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import tomllib
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gsync
import gsync.testing
from gsync_pytest import gsync_threads
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference
from tests.support.paths import ROOT

pytest_plugins = ("pytester",)


def test_one_string_of_several_devices_gets_the_list_to_write() -> None:
    with pytest.raises(gsync.ConfigError, match=re.escape("write devices=['cpu:0', 'cpu:1']")):
        gsync.Engine("cpu:0,cpu:1")  # type: ignore[arg-type]


def test_a_device_count_gets_the_device_names_to_write() -> None:
    with pytest.raises(gsync.InputTypeError, match=re.escape("virtual CPU devices write devices=['cpu:0', 'cpu:1']")):
        gsync.Engine(2)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_model_on_the_meta_device_is_refused_before_anything_starts() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with pytest.raises(gsync.ConfigError, match=r"parameter 0.weight is on the meta device.*to_empty"):
        await engine.fit(model, make_batches(2, 8), optimizer=sgd, loss_fn=classification_loss)
    with pytest.raises(gsync.ConfigError, match="meta device"):
        async with engine.session(model, optimizer=sgd, loss_fn=classification_loss):
            pass
    assert gsync_threads() == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("loss_fn", "named"),
    [
        (nn.CrossEntropyLoss(), "a CrossEntropyLoss module, which takes (input, target)"),
        (nn.CrossEntropyLoss, "the class CrossEntropyLoss"),
        (F.cross_entropy, "torch.nn.functional.cross_entropy, which takes (input, target)"),
        (lambda batch: batch[0].sum(), "cannot be called as loss_fn(model, batch)"),
    ],
    ids=["loss-module", "loss-class", "functional", "one-argument"],
)
async def test_a_loss_that_is_not_loss_fn_model_batch_says_what_gsync_calls(loss_fn: Any, named: str) -> None:
    with pytest.raises(gsync.InputTypeError, match=re.escape(named)) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(TiedNet(), make_batches(2, 8), optimizer=sgd, loss_fn=loss_fn)
    assert "gsync calls loss_fn(model, batch)" in str(caught.value)
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_module_whose_forward_takes_model_and_batch_is_a_loss_fn_still() -> None:
    class Criterion(nn.Module):
        def forward(self, model: nn.Module, batch: Any) -> torch.Tensor:
            return F.cross_entropy(model(batch[0]), batch[1])

    model = TiedNet()
    expected, expected_losses = train_reference(model, make_batches(2, 8))  # loss_fn: the same cross-entropy
    result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        copy.deepcopy(model), make_batches(2, 8), optimizer=sgd, loss_fn=Criterion()
    )
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert_same_state(result.model, expected)


def test_the_progress_bar_comes_with_gsync_and_the_widget_with_the_notebook_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=\[ ;]", requirement)[0] for requirement in requirements}

    assert "tqdm" in names(project["dependencies"])
    assert "ipywidgets" in names(project["optional-dependencies"]["notebook"])


@pytest.mark.asyncio
async def test_progress_without_tqdm_shows_though_logging_is_not_configured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed: importing it fails
    assert not logging.getLogger("gsync").isEnabledFor(logging.INFO)  # as in a script that never configured logging
    await gsync.Engine(["cpu:0", "cpu:1"]).fit(
        TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, progress=True
    )
    err = capsys.readouterr().err
    assert "gsync: step 0 (epoch 0): loss" in err, err
    assert "gsync: step 2 (epoch 0): loss" in err, err  # the last step's figures, as a finished bar shows them


def test_in_a_jupyter_kernel_without_ipywidgets_the_bar_is_text_and_warns_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gsync._core.session.progress import Progress

    # What tqdm.auto sees in an ipykernel without ipywidgets; it decides as it is imported, so import it afresh.
    for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    for name in [name for name in os.environ if name == "QT_API" or name.startswith("SPYDER")]:
        monkeypatch.delenv(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = Progress(total_steps=3, first_step=0)
        for step in range(3):
            progress.update(step, 0, loss=1.0, lr=0.1, rows=8, seconds=0.01)
        progress.close()
    assert [str(w.message) for w in caught] == []
    assert "3/3" in capsys.readouterr().err


def _readme_testing_section() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8").split("## Testing your training code\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.timeout(60)
def test_the_readme_testing_setup_gets_no_pytest_asyncio_warning(pytester: pytest.Pytester) -> None:
    from test_pytest_plugin import TRAINING

    section = _readme_testing_section()
    config = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert config is not None and "asyncio_default_fixture_loop_scope" in config.group(1), section
    assert example is not None
    pytester.makepyprojecttoml(config.group(1))
    pytester.makepyfile(my_project=TRAINING, test_readme=example.group(1))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    output = result.stdout.str() + result.stderr.str()
    assert "is unset" not in output and "Warning" not in output, output  # pytest-asyncio's words when it is not set


def test_the_quick_start_script_prints_each_epoch_as_it_ends() -> None:
    """The epoch line comes as the epoch ends, not when fit returns: a fit that fails in epoch 1 has shown epoch 0."""
    steps_per_epoch = 8192 // 256
    fail_in_epoch_1 = f"""
import runpy, sys
import gsync, gsync.testing

class FailingInEpoch1(gsync.Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = gsync.testing.inject(self, gsync.testing.fail(device=0, step={steps_per_epoch}, site="forward"))
        self.armed.__enter__()  # kept: a context manager dropped unexited disarms its faults as it is collected

gsync.Engine = FailingInEpoch1
sys.argv = ["train_mlp.py", "--epochs", "2"]
runpy.run_path({str(ROOT / "examples" / "train_mlp.py")!r}, run_name="__main__")
"""
    completed = subprocess.run(
        [sys.executable, "-c", fail_in_epoch_1], capture_output=True, text=True, timeout=50, cwd=ROOT
    )
    assert completed.returncode != 0 and "WorkerFailed" in completed.stderr, completed.stderr
    epochs = [line for line in completed.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 1 and epochs[0].startswith("epoch 0: mean loss "), completed.stdout


@pytest.mark.asyncio
async def test_an_error_fit_raises_is_raised_not_also_logged(caplog: pytest.LogCaptureFixture) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    caplog.set_level(logging.DEBUG, logger="gsync")
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=1, site="backward")):
        with pytest.raises(gsync.WorkerFailed):
            await engine.fit(TiedNet(), make_batches(3, 8), optimizer=sgd, loss_fn=classification_loss, progress=False)
    logged = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert logged == []  # the caller has the error: a WARNING of the same would say it twice
