"""The example notebook, executed as Jupyter executes it: nbclient driving a real IPython kernel (ipykernel)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from tests.support.paths import ROOT

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
KERNEL = "gsync-test-python"
CELL_TIMEOUT_S = 30
# The kernel sees the environment a user's would: gsync picks its progress default from these.
NOT_IN_A_USERS_KERNEL = ("PYTEST_CURRENT_TEST", "CI", "PYTEST_ADDOPTS")


@asynccontextmanager
async def kernel_client(notebook: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """An nbclient client on a fresh kernel running *this* Python (so this environment's gsync), in ``tmp_path``.

    The kernel spec is written to ``tmp_path``: whatever kernels the machine or the user has installed
    (a ``python3`` spec of another interpreter) cannot be picked by mistake.
    """
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gsync test kernel",
        "language": "python",
        "interrupt_mode": "signal",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    manager = AsyncKernelManager(
        kernel_name=KERNEL,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
        connection_file=str(tmp_path / "connection.json"),
    )
    env = {name: value for name, value in os.environ.items() if name not in NOT_IN_A_USERS_KERNEL}
    env["IPYTHONDIR"] = str(tmp_path / "ipython")  # history and profile of this kernel only
    client = nbclient.NotebookClient(
        notebook,
        km=manager,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=30,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    # cleanup_kc: shut the kernel down and close its channels at the end, though the client did not make `manager`.
    async with client.async_setup_kernel(env=env, cwd=str(tmp_path), cleanup_kc=True):
        yield client


def text_of(cell: Any, name: str) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.get("name") == name)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_notebook_runs_in_a_real_kernel(tmp_path: Path) -> None:
    """Top-level ``await engine.fit(...)`` with a progress bar, a failure and a resume, and the saved trace."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    async with kernel_client(notebook, tmp_path) as client:
        for index, cell in enumerate(notebook.cells):
            await client.async_execute_cell(cell, index)  # raises CellExecutionError on any error output
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    _, train, failure, trace, resume, held_steps, plot, held_fit, held_close = code

    # Progress: tqdm's bar reaches every step of the 3 epochs (32 batches each).
    assert "96/96" in text_of(train, "stderr"), text_of(train, "stderr")
    epochs = re.findall(r"^epoch (\d): mean loss ([0-9.]+)$", text_of(train, "stdout"), re.MULTILINE)
    assert [int(epoch) for epoch, _ in epochs] == [0, 1, 2], text_of(train, "stdout")
    losses = [float(loss) for _, loss in epochs]
    assert losses[0] > losses[1] > losses[2], losses

    printed = text_of(failure, "stdout")
    assert "WorkerFailed on cpu:1 at step 5, during backward: InjectedFault(" in printed, printed
    assert "last consistent step: 4" in printed, printed
    saved = tmp_path / "gsync-trace.json"
    # Engine(trace=path) wrote it; the message says the cause before naming the file.
    assert "failed at step 5 during backward (its shard: 64 of the batch's 128 rows): InjectedFault: " in printed, printed
    assert f"(trace: {saved})" in printed, printed
    assert "resumed at step 5, trained 27 more steps" in text_of(resume, "stdout")

    # The held session: steps, a plot (or its figures), session.fit going on from step 8, a sample, the close.
    assert re.search(r"^8 steps, loss [0-9.]+ -> [0-9.]+$", text_of(held_steps, "stdout"), re.MULTILINE), held_steps.outputs
    assert plot.outputs, "the plot cell showed nothing"
    assert re.search(r"^steps 8\.\.39, loss now [0-9.]+$", text_of(held_fit, "stdout"), re.MULTILINE), held_fit.outputs
    assert "predicted: [" in text_of(held_fit, "stdout")
    assert "closed: True" in text_of(held_close, "stdout")

    events = json.loads(saved.read_text())["traceEvents"]  # by now, the resumed fit's
    assert {"forward", "backward", "optimizer"} <= {event["name"] for event in events}
    counted = re.search(r"^(\d+) events in gsync-trace.json$", text_of(trace, "stdout"), re.MULTILINE)
    assert counted is not None and int(counted.group(1)) > 0, text_of(trace, "stdout")


SETUP = """
import asyncio, threading
import torch, torch.nn.functional as F
from torch import nn
import gsync
from gsync_pytest import gsync_tasks, gsync_threads

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
before = [p.detach().clone() for p in model.parameters()]
batches = [(torch.randn(64, 32), torch.randint(0, 4, (64,))) for _ in range(16)]
engine = gsync.Engine(["cpu:0", "cpu:1"])
recipe = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


class Running:
    def on_step_end(self, session, result):
        if result.step == 2:
            print("the fit is running", flush=True)
"""
# Long enough that the interrupt always lands inside it (100 000 steps), and it says when it is running.
LONG_FIT = "result = await engine.fit(model, batches, epochs=6250, callbacks=[Running()], progress=False, **recipe)"
AFTER = """
print("threads:", gsync_threads())
print("tasks:", gsync_tasks())
print("model unchanged:", all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
result = await engine.fit(model, batches, epochs=1, progress=False, **recipe)
print("fit again:", len(result.losses), "steps")
print("threads after:", gsync_threads())
"""


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_interrupting_the_kernel_stops_gsync_and_the_next_cell_fits(tmp_path: Path) -> None:
    cells = [nbformat.v4.new_code_cell(source) for source in (SETUP, LONG_FIT, AFTER)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    setup, long_fit, after = notebook.cells
    async with kernel_client(notebook, tmp_path) as client:
        client.allow_errors = True  # the interrupted cell ends in an error: the test reads it
        await client.async_execute_cell(setup, 0)
        running = asyncio.ensure_future(client.async_execute_cell(long_fit, 1))
        # nbclient appends the kernel's outputs to the cell as they arrive: interrupt once the fit said it runs.
        async with asyncio.timeout(CELL_TIMEOUT_S):
            while "the fit is running" not in text_of(long_fit, "stdout"):
                assert not running.done(), long_fit.outputs
                await asyncio.sleep(0.02)
        await client.km.interrupt_kernel()
        async with asyncio.timeout(CELL_TIMEOUT_S):
            await running
        client.allow_errors = False
        await client.async_execute_cell(after, 2)

    errors = [output for output in long_fit.outputs if output.output_type == "error"]
    # What the user sees: ipykernel turns the interrupt of an awaiting cell into cancellation of the cell's task,
    # and gsync lets the cancellation propagate, as it promises, after stopping everything it started.
    assert [error.ename for error in errors] == ["CancelledError"], long_fit.outputs
    assert "engine.fit(" in "\n".join(errors[0].traceback)  # raised from the user's line
    printed = text_of(after, "stdout")
    assert "threads: []\n" in printed, printed
    assert "tasks: []\n" in printed, printed
    assert "model unchanged: True\n" in printed, printed
    assert "fit again: 16 steps\n" in printed, printed
    assert "threads after: []\n" in printed, printed


HELD_SETUP = """
import copy
import torch, torch.nn.functional as F
from torch import nn
import gsync
from gsync_pytest import gsync_tasks, gsync_threads

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
start = copy.deepcopy(model)
batches = [(torch.randn(32, 16), torch.randint(0, 4, (32,))) for _ in range(8)]
engine = gsync.Engine(["cpu:0", "cpu:1"])
recipe = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
"""
HELD_CELLS = (
    "session = await engine.session(model, **recipe)",
    "first = await session.step(batches[0])",
    "second = await session.step(batches[1])",
    "fitted = await session.fit(batches[2:], progress=False)",
    "metrics = await session.evaluate(batches)",
    "await session.aclose()",
    """
plain = copy.deepcopy(start)
optimizer = recipe["optimizer"](list(plain.parameters()))
for batch in batches:
    optimizer.zero_grad()
    recipe["loss_fn"](plain, batch).backward()
    optimizer.step()
gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
print("steps:", first.step, second.step, fitted.first_step, len(fitted.losses))
print("evaluated:", sorted(metrics))
print("equal to a plain loop:", gap < 1e-5, gap)
print("threads:", gsync_threads())
print("tasks:", gsync_tasks())
""",
)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_session_held_across_cells_trains_as_a_plain_loop(tmp_path: Path) -> None:
    cells = [nbformat.v4.new_code_cell(source) for source in (HELD_SETUP, *HELD_CELLS)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    async with kernel_client(notebook, tmp_path) as client:
        for index, cell in enumerate(notebook.cells):
            await client.async_execute_cell(cell, index)  # each cell is its own task in ipykernel
    printed = text_of(notebook.cells[-1], "stdout")
    assert "steps: 0 1 2 6\n" in printed, printed
    assert "evaluated: ['loss']\n" in printed, printed
    assert "equal to a plain loop: True" in printed, printed
    assert "threads: []\n" in printed and "tasks: []\n" in printed, printed


HELD_LONG_FIT = "result = await session.fit(batches, epochs=6250, callbacks=[Running()], progress=False)"
HELD_AFTER = """
print("closed:", session.closed)
print("threads:", gsync_threads())
print("tasks:", gsync_tasks())
try:
    await session.step(batches[0])
except gsync.SessionClosed as error:
    checkpoint = error.checkpoint
    print("later call:", type(error).__name__, "checkpoint step", checkpoint.step)
session = await engine.session(model, resume=checkpoint, **recipe)
epochs = (checkpoint.step + 1) // len(batches) + 1  # the epoch the checkpoint is in, to its end
more = await session.fit(batches, epochs=epochs, progress=False)
print("resumed at", more.first_step, "ran", len(more.losses), "of", epochs * len(batches))
await session.aclose()
print("threads after:", gsync_threads())
"""


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_interrupting_a_held_sessions_fit_closes_it_and_the_next_cell_resumes(tmp_path: Path) -> None:
    setup = SETUP + "\nsession = await engine.session(model, **recipe)\n"
    cells = [nbformat.v4.new_code_cell(source) for source in (setup, HELD_LONG_FIT, HELD_AFTER)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    setup_cell, long_fit, after = notebook.cells
    async with kernel_client(notebook, tmp_path) as client:
        client.allow_errors = True
        await client.async_execute_cell(setup_cell, 0)
        running = asyncio.ensure_future(client.async_execute_cell(long_fit, 1))
        async with asyncio.timeout(CELL_TIMEOUT_S):
            while "the fit is running" not in text_of(long_fit, "stdout"):
                assert not running.done(), long_fit.outputs
                await asyncio.sleep(0.02)
        await client.km.interrupt_kernel()
        async with asyncio.timeout(CELL_TIMEOUT_S):
            await running
        client.allow_errors = False
        await client.async_execute_cell(after, 2)

    errors = [output for output in long_fit.outputs if output.output_type == "error"]
    assert [error.ename for error in errors] == ["CancelledError"], long_fit.outputs
    printed = text_of(after, "stdout")
    # Closed by the time the interrupted cell ends: the cancellation propagates once everything has stopped.
    assert "closed: True\n" in printed and "threads: []\n" in printed and "tasks: []\n" in printed, printed
    match = re.search(r"later call: SessionClosed checkpoint step (\d+)", printed)
    assert match is not None, printed
    done = int(match.group(1)) + 1
    # The resumed session's first fit continues the run: it replays the steps the checkpoint has, and trains the rest.
    resumed = re.search(r"resumed at (\d+) ran (\d+) of (\d+)", printed)
    assert resumed is not None, printed
    assert (int(resumed.group(1)), int(resumed.group(2))) == (done, int(resumed.group(3)) - done), printed
    assert "threads after: []\n" in printed, printed
