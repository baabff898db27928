"""The examples a user starts from must run as written."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_notebook_runs_with_top_level_await(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each code cell is compiled as Jupyter does (top-level await) and awaited in the running loop."""
    monkeypatch.chdir(tmp_path)
    notebook = json.loads((ROOT / "examples" / "notebook.ipynb").read_text())
    namespace: dict[str, object] = {"__name__": "__main__"}
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        code = compile("".join(cell["source"]), "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = types.FunctionType(code, namespace)()
        if result is not None:
            await result
    assert namespace["result"].losses[-1] < namespace["result"].losses[0]  # type: ignore[attr-defined]
    assert namespace["resumed"].first_step == 5  # failed at step 5, so it restarts there  # type: ignore[attr-defined]
    assert (tmp_path / "gsync-trace.json").stat().st_size > 0


@pytest.mark.timeout(120)
def test_quick_start_script_trains() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    )
    epochs = [line for line in completed.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2
    first, last = (float(line.split("mean loss ")[1].split()[0]) for line in epochs)
    assert last < first
