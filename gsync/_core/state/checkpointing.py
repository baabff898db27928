"""Checkpoints in a directory: ``fit(checkpoint_dir=..., checkpoint_every=N, keep=K)`` and ``resume=directory``.

Files are named ``step-00000041.pt`` after the last step they include, so
the newest is the one with the highest step. With ``keep_best=``, the best
evaluation's checkpoint is ``best.pt`` beside them, described by
``best.json`` (its step and metrics): outside the ``step-*.pt`` names, so
neither rotation nor ``resume=directory`` ever takes it. Writing happens in a thread of
its own, off the event loop and off the training path: between two steps the
state is copied (that copy is the only cost the step pays), and the file is
written while training goes on. One write is in flight at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from ..threads import LoopHandle, Outcome, WorkerThread
from ...checkpoint import Checkpoint
from ...errors import CheckpointError, ConfigError
from .rng import restore_rng

__all__ = (
    "BEST_FILE", "BEST_RECORD", "BestSoFar", "CheckpointSettings", "CheckpointWriter", "checkpoint_path", "newest_checkpoint",
    "read_best", "resolve_resume", "restore_checkpoint_rng",
)

_NAME = re.compile(r"^step-(\d{8,})\.pt$")
BEST_FILE = "best.pt"
BEST_RECORD = "best.json"
# How long closing waits for the last write before leaving its thread.
_CLOSE_GRACE_S = 60.0


@dataclass(frozen=True)
class CheckpointSettings:
    """``fit``'s checkpoint arguments, checked: where, how often (``None``: at the end only), how many to keep."""

    directory: Path
    every: int | None
    keep: int

    @classmethod
    def of(cls, directory: object, every: object, keep: object) -> CheckpointSettings | None:
        """:raises ~gsync.ConfigError: for a setting gsync cannot use, naming it."""
        if directory is None:
            if every is not None:
                raise ConfigError("checkpoint_every needs checkpoint_dir: the directory to write the checkpoints into")
            return None
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(f"checkpoint_dir must be a path, got {type(directory).__name__}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError(f"checkpoint_every must be a positive number of steps or None (at the end only), got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be a positive number of checkpoints, got {keep!r}")
        return cls(Path(directory), every, keep)


@dataclass(frozen=True)
class BestSoFar:
    """The best evaluation by ``metric`` so far: its step, value and every metric it had."""

    metric: str
    mode: str
    step: int
    value: float
    metrics: dict[str, float]

    def beaten_by(self, value: float) -> bool:
        # Ties keep the earlier file: a plateau does not rewrite best.pt at every evaluation.
        if math.isnan(value):
            return False
        if math.isnan(self.value):
            return True
        return value < self.value if self.mode == "min" else value > self.value


def read_best(directory: Path, metric: str, mode: str, before_step: int) -> BestSoFar | None:
    """The best so far recorded in ``directory`` for this metric and mode, from a step before ``before_step``.

    A resumed run goes on comparing against the best of the run it continues, not starting over (which would
    replace ``best.pt`` with its first evaluation, however bad). A record of a step at or past ``before_step``
    is another timeline's (a run resumed from an older file), and one of another metric or mode is another
    setting's: neither is taken. An unreadable record is left out with a warning.
    """
    path = directory / BEST_RECORD
    if before_step <= 0 or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        best = BestSoFar(
            str(record["metric"]), str(record["mode"]), int(record["step"]), float(record["value"]),
            {str(name): float(value) for name, value in record["metrics"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"ignoring an unreadable {path}: {error!r}; best.pt will be replaced at the next evaluation", UserWarning, stacklevel=3)
        return None
    if best.metric != metric or best.mode != mode or best.step >= before_step or not (directory / BEST_FILE).is_file():
        return None
    return best


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def _by_step(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` that loads; ``None`` when it has none (or does not exist).

    A file that does not load (a crash while something else wrote it, a
    damaged disk) is skipped with a warning, and the next newest is tried.
    """
    if not directory.exists():
        return None
    for _, path in reversed(_by_step(directory)):
        try:
            return Checkpoint.load(path)
        except CheckpointError as error:
            warnings.warn(f"skipping an unreadable checkpoint: {error}", UserWarning, stacklevel=3)
    return None


def resolve_resume(
    resume: Checkpoint | str | os.PathLike[str] | None, checkpoint_dir: str | os.PathLike[str] | None = None
) -> Checkpoint | None:
    """A checkpoint as given, a file loaded, or the newest checkpoint of a directory (``None`` if it has none).

    A path that does not exist yet is an empty directory when it is
    ``checkpoint_dir`` (the same command line for the first run and every
    restart, ``exp_lr0.01`` included). Any other missing path is refused when
    there is a ``checkpoint_dir`` (``resume="runs"`` beside
    ``checkpoint_dir="run"`` is a typo that would start afresh and write over
    the run's own files); without one (a session), a missing path with no
    suffix starts from scratch with a warning, and any other is a missing file.

    :raises ~gsync.CheckpointError: for a file that cannot be loaded, or a missing path beside a ``checkpoint_dir``.
    """
    if resume is None or isinstance(resume, Checkpoint):
        return resume
    path = Path(resume)
    if path.is_dir():
        return newest_checkpoint(path)
    if not path.exists():
        if checkpoint_dir is not None:
            if path.resolve() == Path(checkpoint_dir).resolve():
                return None  # the first run: nothing saved yet
            raise CheckpointError(
                f"resume={str(resume)!r} does not exist, and it is not checkpoint_dir ({str(checkpoint_dir)!r}); "
                "pass resume=checkpoint_dir to start afresh while nothing is saved yet, and resume from there later"
            )
        if not path.suffix:
            warnings.warn(
                f"resume={str(resume)!r}: no such directory yet, so training starts from scratch", UserWarning, stacklevel=3
            )
            return None
    return Checkpoint.load(path)


class CheckpointWriter:
    """Writes a session's checkpoints into ``directory`` every ``every`` steps, keeping the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike[str], every: int | None, keep: int, loop: LoopHandle) -> None:
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.written: list[Path] = []
        self._worker = WorkerThread("gsync-checkpoint", loop)
        self._pending: tuple[anyio.Event, list[Outcome[Path]]] | None = None
        self._last_step: int | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"checkpoint_dir {self.directory} cannot be created: {error}") from error

    def due(self, step: int) -> bool:
        return self.every is not None and (step + 1) % self.every == 0

    async def write(self, checkpoint: Checkpoint) -> None:
        """Start writing ``checkpoint`` (already copied) in the writer's thread, after the write in flight.

        :raises ~gsync.CheckpointError: when the previous write failed.
        """
        if checkpoint.step == self._last_step:
            return
        self._last_step = checkpoint.step
        await self._submit(lambda: self._save(checkpoint))

    async def write_best(self, checkpoint: Checkpoint, best: BestSoFar) -> None:
        """Start writing ``checkpoint`` as ``best.pt``, with ``best.json`` saying what it is, after the write in flight.

        :raises ~gsync.CheckpointError: when the previous write failed.
        """
        await self._submit(lambda: self._save_best(checkpoint, best))

    async def _submit(self, save: Callable[[], Path]) -> None:
        await self.flush()
        done = anyio.Event()
        outcomes: list[Outcome[Path]] = []

        def finished(outcome: Outcome[Path]) -> None:
            outcomes.append(outcome)
            done.set()

        self._worker.submit(save, finished)
        self._pending = (done, outcomes)

    def _save_best(self, checkpoint: Checkpoint, best: BestSoFar) -> Path:
        # The file first, then its record: a crash between them leaves a record of the previous best, which a
        # resumed run compares against; the file it describes may only have been replaced by a better one.
        path = checkpoint.save(self.directory / BEST_FILE)
        record = {"metric": best.metric, "mode": best.mode, "step": best.step, "value": best.value, "metrics": best.metrics}
        temporary = self.directory / f".{BEST_RECORD}.tmp"
        temporary.write_text(json.dumps(record, indent=1))
        os.replace(temporary, self.directory / BEST_RECORD)
        return path

    def _save(self, checkpoint: Checkpoint) -> Path:
        path = checkpoint.save(checkpoint_path(self.directory, checkpoint.step))
        # keep counts the files up to this one: a file numbered past it is not of this run's timeline (an
        # unreadable newer file that resume skipped, a run resumed from an older file), and counting it could
        # delete what was just written.
        this_timeline = [old for step, old in _by_step(self.directory) if step <= checkpoint.step]
        for old in this_timeline[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    async def flush(self) -> None:
        """Wait for the write in flight, if any.

        :raises ~gsync.CheckpointError: naming the directory, when that write failed.
        """
        if self._pending is None:
            return
        done, outcomes = self._pending
        self._pending = None
        await done.wait()
        try:
            self.written.append(outcomes[0].unwrap())
        except Exception as error:  # noqa: BLE001 - reported as the checkpoint error it is
            raise CheckpointError(f"writing a checkpoint into {self.directory} failed: {error!r}") from error

    async def close(self) -> None:
        """Wait for the last write and stop the thread.

        :raises ~gsync.CheckpointError: when the last write failed.
        """
        try:
            await self.flush()
        finally:
            self._worker.stop()
            await self._worker.join(_CLOSE_GRACE_S)

    async def abandon(self) -> None:
        """Finish the write in flight, if any, without raising, and stop the thread (the run already failed)."""
        try:
            await self.flush()
        except CheckpointError:
            pass
        finally:
            self._worker.stop()
            await self._worker.join(_CLOSE_GRACE_S)


def restore_checkpoint_rng(checkpoint: Checkpoint) -> None:
    """Set the global random generators to ``checkpoint``'s (nothing when it has none).

    :raises ~gsync.CheckpointError: when its generator state is damaged.
    """
    if checkpoint.rng_state is None:
        return
    try:
        restore_rng(checkpoint.rng_state)
    except ValueError as error:
        raise CheckpointError(f"the checkpoint of step {checkpoint.step} has a damaged random generator state: {error}") from error
