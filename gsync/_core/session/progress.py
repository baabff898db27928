"""``fit``'s progress display: a tqdm bar (a widget in Jupyter when ipywidgets is installed), or plain lines.

tqdm is one of gsync's dependencies, so the bar is what users see. Where it
cannot be imported the display falls back to one line every few seconds:
logged at INFO on the ``gsync`` logger when the application lets such a
record through, else written to stderr, since progress the user asked for
must show whether or not logging is configured.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from typing import Any

__all__ = ("Progress", "progress_wanted")

_LOG_EVERY_S = 5.0
logger = logging.getLogger("gsync")


def progress_wanted(progress: bool | None, rank: int = 0) -> bool:
    """``progress=None`` means on for rank 0 (every rank runs the same steps: under torchrun, eight bars would fight
    over one terminal), except in tests and under CI (``CI`` or ``PYTEST_CURRENT_TEST`` set); ``True`` is on for
    every rank."""
    if progress is not None:
        return bool(progress)
    return rank == 0 and not (os.environ.get("CI") or os.environ.get("PYTEST_CURRENT_TEST"))


def _in_a_kernel_without_widgets() -> bool:
    # tqdm.auto picks its notebook bar whenever ipykernel runs the code, and when ipywidgets is missing it warns
    # ("IProgress not found") and falls back to the text bar: choose the text bar ourselves, and say nothing.
    if "ipykernel.zmqshell" not in sys.modules:
        return False
    try:
        return importlib.util.find_spec("ipywidgets") is None
    except (ImportError, ValueError):  # ValueError: a module entry of None, as an import blocker leaves
        return True


def _tqdm_class() -> Any:
    """The bar class to use, or ``None`` where tqdm cannot be imported."""
    try:
        if _in_a_kernel_without_widgets():
            from tqdm.std import tqdm  # type: ignore[import-untyped, unused-ignore]  # tqdm ships no stubs
        else:
            from tqdm.auto import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    return tqdm


def _emit_line(message: str, *args: object) -> None:
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(message, *args)
    else:
        # Without a handler that takes INFO, logging would drop the line (its last-resort handler shows
        # warnings only), and the user who asked for progress would see nothing.
        print("gsync: " + message % args, file=sys.stderr, flush=True)


class Progress:
    """One ``fit`` call's display: the bar counts this call's steps against this call's total, and names the
    global step in its figures.

    ``total_steps``: the steps of the call's epochs (``None`` where ``data`` has no length); ``first_step``: the
    global index of the call's first step; ``replayed``: the steps of those epochs a resumed run already
    trained (its checkpoint's), which the bar starts at, as the run's own progress. A ``session.fit`` after
    earlier steps replays nothing, so its bar starts at 0 whatever the global step.
    """

    def __init__(self, total_steps: int | None, first_step: int, replayed: int = 0) -> None:
        self._bar: Any = None
        self._last_log = time.monotonic()
        self._first_step = first_step
        self._unshown: dict[str, Any] | None = None
        self._last_line: tuple[int, int, float, float, float] | None = None
        tqdm = _tqdm_class()
        if tqdm is not None:
            self._bar = tqdm(total=total_steps, initial=replayed, unit="step", dynamic_ncols=True)

    def update(self, step: int, epoch: int, loss: float, lr: float, rows: int, seconds: float) -> None:
        samples = rows / seconds if seconds > 0 else float("nan")
        bar = self._bar
        if bar is not None:
            self._unshown = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "samples": samples}
            # Formatted only when this update may redraw the bar (tqdm redraws at most every ``mininterval``
            # seconds, by its own clock): most steps' figures would never be seen.
            if not bar.disable and time.time() - bar.last_print_t >= bar.mininterval:
                self._show_postfix()
            bar.update(1)
            return
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S or step == self._first_step:
            self._last_log = now
            self._line(step, epoch, loss, lr, samples)
            self._last_line = None
        else:
            self._last_line = (step, epoch, loss, lr, samples)

    def _line(self, step: int, epoch: int, loss: float, lr: float, samples: float) -> None:
        _emit_line("step %d (epoch %d): loss %.4g, lr %.3g, %.0f samples/s", step, epoch, loss, lr, samples)

    def _show_postfix(self) -> None:
        values = self._unshown
        if values is None:
            return
        self._unshown = None
        # In this order (keyword figures tqdm would sort): the global step first, as a plain loop prints it.
        figures = {
            "step": values["step"], "epoch": values["epoch"], "loss": f"{values['loss']:.4g}",
            "lr": f"{values['lr']:.3g}", "samples_s": f"{values['samples']:.0f}",
        }
        self._bar.set_postfix(figures, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            if not self._bar.disable:
                # The last step's figures are what the finished bar shows.
                self._show_postfix()
            self._bar.close()
        elif self._last_line is not None:
            # The last step's figures, as the finished bar would show them.
            self._line(*self._last_line)
            self._last_line = None
