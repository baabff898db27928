"""``fit``'s progress display: a tqdm bar when tqdm is installed, ``logging`` lines otherwise.

``tqdm.auto`` picks a widget in Jupyter and text in a terminal. Without tqdm
gsync prints nothing itself: it logs an INFO line on the ``gsync`` logger
every few seconds, which shows once the application configures logging.
"""

from __future__ import annotations

import logging
import os
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


class Progress:
    def __init__(self, total_steps: int | None, first_step: int) -> None:
        self._bar: Any = None
        self._last_log = time.monotonic()
        self._first_step = first_step
        self._unshown: dict[str, Any] | None = None
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped, import-not-found, unused-ignore]  # optional
        except ImportError:
            return
        self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def update(self, step: int, epoch: int, loss: float, lr: float, rows: int, seconds: float) -> None:
        samples = rows / seconds if seconds > 0 else float("nan")
        bar = self._bar
        if bar is not None:
            self._unshown = {"epoch": epoch, "loss": loss, "lr": lr, "samples": samples}
            # Formatted only when this update may redraw the bar (tqdm redraws at most every ``mininterval``
            # seconds, by its own clock): most steps' figures would never be seen.
            if not bar.disable and time.time() - bar.last_print_t >= bar.mininterval:
                self._show_postfix()
            bar.update(1)
            return
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S or step == self._first_step:
            self._last_log = now
            logger.info("step %d (epoch %d): loss %.4g, lr %.3g, %.0f samples/s", step, epoch, loss, lr, samples)

    def _show_postfix(self) -> None:
        values = self._unshown
        if values is None:
            return
        self._unshown = None
        self._bar.set_postfix(
            epoch=values["epoch"], loss=f"{values['loss']:.4g}", lr=f"{values['lr']:.3g}",
            samples_s=f"{values['samples']:.0f}", refresh=False,
        )

    def close(self) -> None:
        if self._bar is not None:
            if not self._bar.disable:
                # The last step's figures are what the finished bar shows.
                self._show_postfix()
            self._bar.close()
