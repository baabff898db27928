"""What a new user runs into in their first hour, each tried as they would: a gsync answer that says what to change."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
import math
import os
import re
import subprocess
import sys
import tomllib
import traceback
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
from tests.support.models import TiedNet, adamw, classification_loss, make_batches, momentum, sgd
from tests.support.reference import assert_same_state, plain_loop, train_reference
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


# -- the optimizer from the model (issue 57) ----------------------------------------------------------------------


def _nanogpt_example() -> types.ModuleType:
    path = ROOT / "examples" / "nanogpt_char.py"
    spec = importlib.util.spec_from_file_location("nanogpt_char_example", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_NANOGPT = _nanogpt_example()


def NanoGPT() -> nn.Module:
    """nanoGPT's model as ``examples/nanogpt_char.py`` writes it (tied embedding and head, ``forward(idx, targets) ->
    (logits, loss)``, its ``configure_optimizers`` verbatim, prints included): one definition for the example and
    these tests, small here."""
    return _NANOGPT.GPT(vocab_size=16, block_size=8, n_embd=16, n_head=2)


def _token_batches(steps: int, rows: int = 8, block_size: int = 8, vocab_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab_size, (rows, block_size + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0], batch[1])[1]


def _configure(model: nn.Module) -> torch.optim.Optimizer:
    return model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")  # type: ignore[operator]


@pytest.mark.asyncio
@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "sharded"])
async def test_nanogpts_configure_optimizers_is_the_optimizer_in_one_line(
    shard_optimizer: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    reference = copy.deepcopy(model)
    plain = _configure(reference)
    expected_losses = []
    for batch in _token_batches(3):
        plain.zero_grad(set_to_none=True)
        loss = _gpt_loss(reference, batch)
        loss.backward()
        plain.step()
        expected_losses.append(loss.item())
    capsys.readouterr()

    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=shard_optimizer)
    async with engine.session(
        copy.deepcopy(model), optimizer=lambda model: model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu"), loss_fn=_gpt_loss
    ) as session:
        groups = session.optimizers[0].param_groups
        assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
        # nanoGPT's grouping: decay on every matrix (the tied embedding once), none on norms (sharded too: the
        # groups hold each parameter's slice then).
        matrices = sum(p.dim() >= 2 for p in model.parameters())
        assert [len(group["params"]) for group in groups] == [matrices, len(list(model.parameters())) - matrices]
        losses = [(await session.step(batch)).loss for batch in _token_batches(3)]
        trained = session.model
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    assert_same_state(trained, reference, atol=1e-5)
    printed = capsys.readouterr().out
    assert printed.count("num decayed parameter tensors") == 1, printed  # once, as a plain loop prints it
    assert printed.count("using fused AdamW: False") == 1, printed


@pytest.mark.asyncio
async def test_a_factory_named_for_named_parameters_gets_the_trainable_pairs() -> None:
    given: list[list[str]] = []

    def by_name(named_parameters: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        given.append([name for name, _ in named_parameters])
        heads = [p for name, p in named_parameters if name.startswith("head.")]
        rest = [p for name, p in named_parameters if not name.startswith("head.")]
        groups: list[dict[str, Any]] = [{"params": rest}, {"params": heads, "lr": 0.01}]
        return torch.optim.SGD(groups, lr=0.1)

    model = TiedNet()
    async with gsync.Engine(["cpu:0", "cpu:1"]).session(model, optimizer=by_name, loss_fn=classification_loss) as session:
        assert [group["lr"] for group in session.optimizers[0].param_groups] == [0.1, 0.01]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert given == [trainable, trainable]  # one call per replica; TiedNet's frozen layer left out, as params= does
    assert "frozen.weight" not in trainable


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "factory", [torch.optim.SGD, lambda params: torch.optim.SGD(params, lr=0.1)], ids=["optimizer-class", "params-lambda"]
)
async def test_a_factory_of_params_still_gets_the_flat_list(factory: Any) -> None:
    async with gsync.Engine(["cpu:0"]).session(TiedNet(), optimizer=factory, loss_fn=classification_loss) as session:
        assert isinstance(session.optimizers[0], torch.optim.SGD)
        await session.step(make_batches(1, 8)[0])


@pytest.mark.asyncio
async def test_a_factory_that_wanted_the_model_under_another_name_is_told_the_name() -> None:
    with pytest.raises(gsync.InputTypeError, match=r"first parameter is named model or module.*lambda model: model"):
        async with gsync.Engine(["cpu:0"]).session(
            NanoGPT(), optimizer=lambda m: _configure(m), loss_fn=_gpt_loss
        ):
            pass
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_the_models_own_configure_optimizers_passed_bound_is_told_to_take_the_replica() -> None:
    model = NanoGPT()
    with pytest.raises(gsync.ConfigError, match=re.escape("optimizer=lambda model: model.configure_optimizers(...)")):
        async with gsync.Engine(["cpu:0"]).session(
            model, optimizer=lambda params: _configure(model), loss_fn=_gpt_loss
        ):
            pass


@pytest.mark.asyncio
async def test_a_frozen_parameter_the_model_factory_put_in_the_optimizer_is_refused_by_name() -> None:
    with pytest.raises(gsync.ConfigError, match=r"parameter frozen.weight, which does not require grad"):
        async with gsync.Engine(["cpu:0"]).session(
            TiedNet(), optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=classification_loss
        ):
            pass


@pytest.mark.asyncio
async def test_a_factory_that_takes_two_arguments_is_refused_before_anything_starts() -> None:
    with pytest.raises(gsync.InputTypeError, match=r"optimizer cannot be called with one argument"):
        await gsync.Engine(["cpu:0"]).fit(
            TiedNet(), make_batches(1, 8), optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),  # type: ignore[arg-type]
            loss_fn=classification_loss,
        )
    assert gsync_threads() == []


# -- a dropped session, a resume into another optimizer, a closure, a missing await (issue 57) -------------------


def test_a_dropped_held_session_warns_under_pythons_default_warning_filters() -> None:
    """A plain `python script.py`: no -W, no PYTHONWARNINGS, so only what the default filters show is seen."""
    script = """
import asyncio, gc
import torch
from torch import nn
import gsync

async def main():
    engine = gsync.Engine(["cpu:0"])
    session = await engine.session(nn.Linear(2, 1), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                   loss_fn=lambda model, batch: model(batch).sum())
    await session.step(torch.ones(4, 2))
    del session
    gc.collect()
    await engine.aclose()

asyncio.run(main())
"""
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONWARNINGS", "PYTHONDEVMODE")}
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, cwd=ROOT, env=env
    )
    assert completed.returncode == 0, completed.stderr
    assert "SessionLeftOpenWarning" in completed.stderr and "was dropped while open" in completed.stderr, completed.stderr
    assert "await session.aclose()" in completed.stderr


@pytest.mark.asyncio
@pytest.mark.parametrize("recorded", [True, False], ids=["class-recorded", "older-file"])
async def test_resuming_another_optimizers_state_is_refused_as_the_session_opens(recorded: bool, tmp_path: Any) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    model = TiedNet()
    result = await engine.fit(model, make_batches(2, 8), optimizer=momentum, loss_fn=classification_loss, progress=False)
    assert result.checkpoint is not None
    checkpoint = gsync.Checkpoint.load(result.checkpoint.save(tmp_path / "run.ckpt"))
    assert checkpoint.optimizer_class == "torch.optim.sgd.SGD"
    if not recorded:  # written before checkpoints named their optimizer: told by what its groups hold
        checkpoint = dataclasses.replace(checkpoint, optimizer_class=None)
    named = r"state of optimizer SGD, and the optimizer factory built AdamW" if recorded else r"than the AdamW .* no .*betas.*momentum"
    opened = False
    with pytest.raises(gsync.ConfigError, match=named) as caught:
        async with engine.session(model, optimizer=adamw, loss_fn=classification_loss, resume=checkpoint):
            opened = True  # never: refused as the session opens, not at the first step inside a worker
    assert not opened and "start without resume=" in str(caught.value)
    assert gsync_threads() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "sharded"])
async def test_an_optimizer_that_needs_a_closure_is_refused_as_the_session_opens(shard_optimizer: bool) -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=shard_optimizer)
    with pytest.raises(gsync.ConfigError, match=r"LBFGS.step\(\) needs a closure.*use an optimizer that steps from the gradient"):
        async with engine.session(TiedNet(), optimizer=lambda params: torch.optim.LBFGS(params), loss_fn=classification_loss):
            pass
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_a_session_opener_used_as_the_session_says_to_await_it() -> None:
    opener = gsync.Engine(["cpu:0"]).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
    with pytest.raises(AttributeError, match=r"no attribute 'step'.*`session = await engine.session\(...\)`, or `async with"):
        opener.step(make_batches(1, 8)[0])  # type: ignore[attr-defined]
    assert not hasattr(opener, "step")  # still an AttributeError: hasattr and getattr(..., default) work
    with pytest.raises(AttributeError, match=r"^'SessionOpener' object has no attribute 'no_such_thing'$"):
        opener.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


# -- the smaller ones (issue 57, item 7) ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_tensor_dataset_as_data_is_told_to_take_a_dataloader() -> None:
    x, y = make_batches(1, 8)[0]
    with pytest.raises(gsync.InputTypeError, match=r"data is a TensorDataset.*DataLoader\(dataset, batch_size="):
        await gsync.Engine(["cpu:0"]).fit(
            TiedNet(), torch.utils.data.TensorDataset(x, y), optimizer=sgd, loss_fn=classification_loss  # type: ignore[arg-type]
        )
    assert gsync_threads() == []


@pytest.mark.asyncio
async def test_elastic_under_plain_python_names_elastic_and_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(gsync.ConfigError, match=r"Engine\(elastic=...\).*RANK is not set.*torchrun.*or drop elastic="):
        await gsync.Engine(["cpu:0"], elastic=True).fit(TiedNet(), make_batches(1, 8), optimizer=sgd, loss_fn=classification_loss)
    assert gsync_threads() == []


def test_a_device_prints_as_the_name_it_was_given() -> None:
    devices = gsync.Engine(["cpu:0", "cpu:1"]).devices
    assert [str(device) for device in devices] == ["cpu:0", "cpu:1"]
    assert f"training on {devices[1]}" == "training on cpu:1"
    assert repr(devices[0]) == "DeviceSpec('cpu:0')"


@pytest.mark.timeout(120)
def test_the_nanogpt_example_trains_as_the_plain_loop_does() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "nanogpt_char.py"), "--steps", "10"],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    difference = re.search(r"max \|gsync - plain\| over 10 steps: (\S+)", out)
    assert difference is not None and float(difference.group(1)) < 1e-5, out
    losses = [float(loss) for loss in re.findall(r"gsync loss (\S+),", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    gsync_part = out.split("gsync on ", 1)[1]
    assert gsync_part.count("num decayed parameter tensors") == 1, out  # once for its 2 devices


@pytest.mark.asyncio
@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "sharded"])
async def test_clip_grad_norm_inf_reports_the_norm_and_clips_nothing(shard_optimizer: bool) -> None:
    model = TiedNet()
    steps = [[batch] for batch in make_batches(3, 8)]
    _, _, _, expected_norms = plain_loop(model, steps, clip=math.inf)
    engine = gsync.Engine(["cpu:0", "cpu:1"], shard_optimizer=shard_optimizer)
    results: dict[str, list[Any]] = {}
    models: dict[str, nn.Module] = {}
    for name, clip in (("measured", math.inf), ("unclipped", None)):
        async with engine.session(copy.deepcopy(model), optimizer=sgd, loss_fn=classification_loss, clip_grad_norm=clip) as session:
            results[name] = [await session.step(*batches) for batches in steps]
            models[name] = session.model
    assert [r.grad_norm for r in results["measured"]] == pytest.approx(expected_norms, rel=1e-5)
    assert [r.grad_norm for r in results["unclipped"]] == [None, None, None]
    assert [r.loss for r in results["measured"]] == [r.loss for r in results["unclipped"]]
    assert_same_state(models["measured"], models["unclipped"], atol=0)  # multiplied by exactly 1.0


# -- tracebacks (issue 57, item 6) ------------------------------------------------------------------------------

_GSYNC_DIR = os.path.dirname(os.path.abspath(gsync.__file__)) + os.sep


def _gsync_frames(error: BaseException) -> list[str]:
    return [f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_tb(error.__traceback__) if frame.filename.startswith(_GSYNC_DIR)]


@pytest.mark.asyncio
async def test_a_mistake_found_as_the_session_starts_is_raised_from_the_users_line() -> None:
    lbfgs = lambda params: torch.optim.LBFGS(params)  # noqa: E731
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with pytest.raises(gsync.ConfigError, match="LBFGS") as in_fit:
        await engine.fit(TiedNet(), make_batches(1, 8), optimizer=lbfgs, loss_fn=classification_loss)
    with pytest.raises(gsync.ConfigError, match="LBFGS") as held:
        await engine.session(TiedNet(), optimizer=lbfgs, loss_fn=classification_loss)
    with pytest.raises(gsync.ConfigError, match="LBFGS") as scoped:
        async with engine.session(TiedNet(), optimizer=lbfgs, loss_fn=classification_loss):
            pass
    with pytest.raises(gsync.InputTypeError, match="loss_fn") as checked:
        engine.session(TiedNet(), optimizer=sgd, loss_fn=nn.CrossEntropyLoss())
    for caught in (in_fit, held, scoped, checked):
        assert _gsync_frames(caught.value) == []
        assert traceback.extract_tb(caught.value.__traceback__)[-1].name.startswith("test_")


@pytest.mark.asyncio
async def test_a_mistake_in_a_session_call_is_raised_from_the_users_line() -> None:
    async with gsync.Engine(["cpu:0"]).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        with pytest.raises(gsync.GsyncError) as caught:
            await session.step()
    assert isinstance(caught.value, (gsync.ConfigError, gsync.InputTypeError)), caught.value
    assert _gsync_frames(caught.value) == []


@pytest.mark.asyncio
async def test_gsync_full_tracebacks_keeps_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GSYNC_FULL_TRACEBACKS", "1")
    with pytest.raises(gsync.ConfigError, match="LBFGS") as caught:
        await gsync.Engine(["cpu:0"]).fit(
            TiedNet(), make_batches(1, 8), optimizer=lambda params: torch.optim.LBFGS(params), loss_fn=classification_loss
        )
    assert any("replicas.py" in frame for frame in _gsync_frames(caught.value))


@pytest.mark.asyncio
async def test_the_recipes_nanogpt_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    page = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    section = page.split("## Optimizers, and grouping parameters by name\n", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert snippet is not None and "lambda model: model.configure_optimizers(" in snippet.group(1)
    body = "".join(f"    {line}\n" for line in snippet.group(1).splitlines())
    namespace: dict[str, Any] = {"torch": torch}
    exec(f"async def snippet(engine, model, loader, warmup_then_cosine, device_type):\n{body}    return result\n", namespace)
    result = await namespace["snippet"](
        gsync.Engine(["cpu:0", "cpu:1"]), NanoGPT(), _token_batches(4), lambda step: min(1.0, (step + 1) / 2), "cpu"
    )
    assert len(result.losses) == 2  # 4 batches, accumulate=2
    assert capsys.readouterr().out.count("num decayed parameter tensors") == 1


@pytest.mark.timeout(90)
def test_under_torchrun_each_rank_prints_its_mistake_once_from_its_own_line(tmp_path: Any) -> None:
    from tests.support.harness import free_port

    script = tmp_path / "train.py"
    script.write_text(
        "import asyncio, torch, gsync\n"
        "from torch import nn\n"
        "async def main():\n"
        "    await gsync.Engine(['cpu']).fit(\n"
        "        nn.Linear(4, 2), [(torch.randn(8, 4), torch.randint(0, 2, (8,)))],\n"
        "        optimizer=lambda params: torch.optim.LBFGS(params),\n"
        "        loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]), progress=False)\n"
        "asyncio.run(main())\n",
        encoding="utf-8",
    )
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {name: value for name, value in os.environ.items() if name not in launcher}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    completed = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, timeout=80, env=env, cwd=tmp_path)
    assert completed.returncode != 0
    output = completed.stdout + completed.stderr
    for rank in (0, 1):
        lines = [line for line in output.splitlines() if line.startswith(f"[rank{rank}]:")]
        assert sum("gsync.errors.ConfigError: LBFGS.step() needs a closure" in line for line in lines) == 1, output
        assert not any("CancelledError" in line or _GSYNC_DIR in line for line in lines), output
        assert len(lines) < 20, output  # the traceback from the user's line, and the message
