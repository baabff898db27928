"""The engine's ``trace=`` setting, and the trace file a session writes as it ends (one per rank across processes)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import anyio

from ..errors import ConfigError, GsyncError
from ..trace import Trace
from .base.outcome import is_cancellation
from .threads import LoopHandle, WorkerThread

__all__ = ("finish_trace", "rank_file", "trace_setting")

logger = logging.getLogger("gsync")

# How long the write of a trace file may take before teardown stops waiting for it.
_WRITE_TIMEOUT_S = 60.0


def trace_setting(value: object) -> Path | None:
    """Check ``Engine(trace=...)``; the file to write (absolute), when it is a path.

    :raises ~gsync.ConfigError: for anything but a bool, a :class:`Trace` or a file path.
    """
    if isinstance(value, (bool, Trace)):
        return None
    if isinstance(value, (str, os.PathLike)):
        raw = os.fspath(value)
        if not isinstance(raw, str) or not raw.strip():
            raise ConfigError(f"trace must be a file path such as 'run.json', got {value!r}")
        path = Path(raw).absolute()
        if raw.endswith(("/", os.sep)) or path.is_dir():
            raise ConfigError(
                f"trace={raw!r} is a directory; give a file in it, e.g. trace={os.path.join(raw, 'run.json')!r}"
            )
        return path
    raise ConfigError(
        "trace must be True (record a timeline in memory), False, a gsync.Trace to record into, or a file path "
        f"such as 'run.json' to write a Chrome/Perfetto trace to; got {type(value).__name__} {value!r}"
    )


def rank_file(path: Path, rank: int, world_size: int, *, per_rank: bool = False) -> Path:
    """The file this rank writes: ``path`` itself in one process, ``run.rank1.json`` for ``run.json`` across several
    (and always when ``per_rank``: an elastic run, whose world may shrink to one process or grow from one)."""
    if world_size <= 1 and not per_rank:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


async def finish_trace(
    trace: Trace | None,
    path: Path | None,
    raised: BaseException | None,
    failure: BaseException | None,
    *,
    per_rank: bool = False,
) -> None:
    """At the end of a session: mark how it ended in ``trace`` and, given a ``path``, write the file.

    ``raised`` is what the session raises (``None`` when it ends normally);
    ``failure`` the failure that closed it, which a call raised or will raise.
    The file is written in a thread of its own, shielded from
    cancellation; a gsync error ``raised`` (else ``failure``) then ends its message with
    ``(trace: PATH)``, another exception gets a note. A write that fails is
    logged as a warning and never replaces ``raised``.
    """
    if trace is None:
        return
    trace._mark_end(raised if raised is not None else failure)
    if path is None:
        return
    target = rank_file(path, trace.rank, trace.world_size, per_rank=per_rank)

    def write() -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        trace.save_chrome(target)

    worker = WorkerThread("gsync-trace", LoopHandle())
    written = False
    with anyio.CancelScope(shield=True):
        try:
            with anyio.move_on_after(_WRITE_TIMEOUT_S):
                await worker.run(write)
                written = True
            if not written:
                logger.warning("gsync: writing the trace file %s took over %g s; left it", target, _WRITE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the session's own outcome matters more than its trace
            logger.warning("gsync: could not write the trace file %s: %r", target, error)
        finally:
            worker.stop()
            await worker.join(1.0)
    if not written:
        return
    trace.path = target
    logger.info("gsync: trace written to %s", target)
    ended_by = raised if raised is not None else failure
    if ended_by is not None:
        # The failure a call raised (a held session closes after its call has it) names the file as well.
        _name_file(ended_by, target)


def _name_file(error: BaseException, path: Path) -> None:
    """End a gsync error's message with the trace file (pickling keeps it)."""
    if isinstance(error, GsyncError):
        error._name_trace_file(path)
    elif not is_cancellation(error):
        # Not gsync's to reword (your own exception propagates unchanged): a note shows in the traceback.
        error.add_note(f"gsync trace: {path}")
