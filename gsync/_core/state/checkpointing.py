"""Checkpoints in a directory: ``fit(checkpoint_dir=..., checkpoint_every=N, keep=K)`` and ``resume=directory``.

Files are named ``step-00000041.pt`` after the last step they include, so
the newest is the one with the highest step. Writing happens in a thread of
its own, off the event loop and off the training path: between two steps the
state is copied (that copy is the only cost the step pays), and the file is
written while training goes on. One write is in flight at a time.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import anyio

from ..threads import LoopHandle, Outcome, WorkerThread
from ...checkpoint import Checkpoint
from ...errors import CheckpointError, ConfigError
from .rng import restore_rng

__all__ = ("CheckpointSettings", "CheckpointWriter", "checkpoint_path", "newest_checkpoint", "resolve_resume", "restore_checkpoint_rng")

_NAME = re.compile(r"^step-(\d{8,})\.pt$")
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
        await self.flush()
        done = anyio.Event()
        outcomes: list[Outcome[Path]] = []

        def finished(outcome: Outcome[Path]) -> None:
            outcomes.append(outcome)
            done.set()

        self._worker.submit(lambda: self._save(checkpoint), finished)
        self._pending = (done, outcomes)

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
