"""One picture of a run, from a result or a trace file: what ``FitResult.plot`` and ``python -m gsync.report`` draw.

Panels, those the run has data for: loss over steps (skipped steps marked),
learning rate, step time split into its exposed communication and the rest,
and each device's time per phase. Membership changes and a failure are
vertical lines across every panel over steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .extras import require

__all__ = ("RunSeries", "draw")

_PHASES = ("data", "forward", "backward", "optimizer", "evaluate")


@dataclass
class RunSeries:
    """What a picture shows, each list indexed alike by ``steps`` (empty where the source does not have it)."""

    title: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    comm_seconds: list[float] = field(default_factory=list)
    """Each step's exposed communication, when traced."""
    skipped: list[int] = field(default_factory=list)
    membership: list[tuple[int, str]] = field(default_factory=list)
    """(step, what changed) per membership change."""
    failure: tuple[int, str] | None = None
    """(step, error) when the run failed, or was cancelled."""
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    """Seconds per phase, by device name."""


def draw(series: RunSeries, path: str | os.PathLike[str] | None = None) -> Any:
    """The figure (a ``matplotlib.figure.Figure``), written to ``path`` (PNG, SVG, PDF: by its suffix) if given."""
    figure_module = require("matplotlib.figure", "plotting a run")
    panels: list[str] = []
    if series.losses:
        panels.append("loss")
    if series.lrs:
        panels.append("lr")
    if series.step_seconds:
        panels.append("time")
    if series.phases:
        panels.append("phases")
    if not panels:
        panels.append("empty")
    figure = figure_module.Figure(figsize=(10, 2.6 * len(panels) + 0.6), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    figure.suptitle(series.title, fontsize=11)
    over_steps = []
    for ax, panel in zip(axes, panels):
        if panel == "loss":
            _loss(ax, series)
            over_steps.append(ax)
        elif panel == "lr":
            ax.plot(series.steps, series.lrs, color="tab:green", linewidth=1.4)
            ax.set_ylabel("learning rate")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
            over_steps.append(ax)
        elif panel == "time":
            _time(ax, series)
            over_steps.append(ax)
        elif panel == "phases":
            _phases(ax, series)
        else:
            ax.text(0.5, 0.5, "no step ran", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    for ax in over_steps:
        _marks(ax, series)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def _loss(ax: Any, series: RunSeries) -> None:
    ax.plot(series.steps, series.losses, color="tab:blue", linewidth=1.4, label="loss")
    if series.skipped:
        by_step = dict(zip(series.steps, series.losses))
        skipped = [s for s in series.skipped if s in by_step]
        ax.scatter(skipped, [by_step[s] for s in skipped], marker="x", color="tab:red", zorder=3, label="skipped step")
    ax.set_ylabel("loss")


def _time(ax: Any, series: RunSeries) -> None:
    milliseconds = [s * 1e3 for s in series.step_seconds]
    if series.comm_seconds:
        comm = [c * 1e3 for c in series.comm_seconds]
        rest = [max(total - c, 0.0) for total, c in zip(milliseconds, comm)]
        ax.bar(series.steps, rest, width=1.0, color="tab:blue", alpha=0.7, label="compute and the rest")
        ax.bar(series.steps, comm, width=1.0, bottom=rest, color="tab:orange", alpha=0.9, label="exposed communication")
    else:
        ax.bar(series.steps, milliseconds, width=1.0, color="tab:blue", alpha=0.7, label="step")
    ax.set_ylabel("step time (ms)")


def _phases(ax: Any, series: RunSeries) -> None:
    devices = list(series.phases)
    names = [p for p in _PHASES if any(p in phases for phases in series.phases.values())]
    names += sorted({p for phases in series.phases.values() for p in phases} - set(names))
    left = [0.0] * len(devices)
    for name in names:
        widths = [series.phases[d].get(name, 0.0) for d in devices]
        ax.barh(devices, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds in each phase, whole run")
    ax.invert_yaxis()
    # Above the bars, not over them.
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncols=len(names), frameon=False)
    ax.grid(True, axis="x", alpha=0.3)


def _marks(ax: Any, series: RunSeries) -> None:
    for number, (step, what) in enumerate(series.membership):
        ax.axvline(step, color="tab:purple", linestyle="--", linewidth=1.2,
                   label="membership change" if number == 0 else None)
    if series.failure is not None:
        step, error = series.failure
        ax.axvline(step, color="tab:red", linewidth=1.6, label=f"ended: {error}")
