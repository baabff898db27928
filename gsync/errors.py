"""Every exception gsync raises on purpose.

Each one says what went wrong and where (device, step, bucket). The ones that
wrap an exception (your code's, your data's, a collective's: WorkerFailed,
DataFailed, SyncFailed) keep it as ``__cause__`` and end their message with
its type and message, so ``str(error)`` in a log says what went wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import anyio

__all__ = (
    "GsyncError",
    "Departed",
    "ConfigError",
    "InputTypeError",
    "MailboxClosed",
    "FitError",
    "WorkerFailed",
    "SyncFailed",
    "SyncTimeout",
    "NonFiniteLoss",
    "ReplicasDiverged",
    "PeerFailed",
    "PeerLost",
    "LostRank",
    "DataFailed",
    "SessionClosed",
    "StopTraining",
    "CheckpointError",
    "SessionLeftOpenWarning",
)


def _restore(cls: type[GsyncError], args: tuple[Any, ...], state: dict[str, Any]) -> GsyncError:
    # Built as the interpreter builds it (an OSError subclass, such as a TimeoutError, by OSError's __new__),
    # without calling an __init__ whose parameters are not the message.
    error = (OSError if issubclass(cls, OSError) else BaseException).__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class GsyncError(Exception):
    """Base class of every error gsync raises on purpose.

    When raised from ``fit``, ``last_step`` is the last step (0-based) whose
    update every device agreed on, or ``None`` when none was, and
    ``checkpoint`` (a :class:`gsync.Checkpoint`) holds the model and optimizer
    state as of that step: pass it to ``fit(..., resume=checkpoint)``.

    Every gsync error pickles with its attributes (to cross a process
    boundary: multiprocessing, a job scheduler), although most take other
    constructor arguments than their message.
    """

    last_step: int | None = None
    checkpoint: Any = None
    _tells_its_cause: ClassVar[bool] = False
    """Whether ``str()`` ends with ``__cause__``'s type and message: the errors that wrap what your code (or a
    collective, or your data) raised, so a log line of ``str(error)`` alone says what went wrong."""

    def __str__(self) -> str:
        message = super().__str__()
        if self._tells_its_cause:
            # A cause does not cross a pickle (``__cause__`` is not pickled); its description does (see __reduce__).
            told = _describe(self.__cause__) if self.__cause__ is not None else self.__dict__.get("_cause_told")
            if told:
                message = f"{message}: {told}"
        trace_file = self.__dict__.get("_trace_file")
        # Last, as Engine(trace=...) says: the message ends with the file.
        return f"{message} (trace: {trace_file})" if trace_file else message

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__dict__
        if self._tells_its_cause and self.__cause__ is not None:
            state = {**state, "_cause_told": _describe(self.__cause__)}
        return (_restore, (type(self), self.args, state))

    def _name_trace_file(self, path: object) -> None:
        """End the message with the trace file of the run this error ended (``Engine(trace=path)``)."""
        self.__dict__["_trace_file"] = str(path)


def _describe(cause: BaseException) -> str:
    """``ValueError: bad shard``, as a traceback's last line says it."""
    message = str(cause)
    return f"{type(cause).__name__}: {message}" if message else type(cause).__name__


class ConfigError(GsyncError, ValueError):
    """A configuration or input value gsync cannot work with.

    Raised before any training work starts; the message says what to change.
    """


class InputTypeError(GsyncError, TypeError):
    """An input of the wrong type (a batch, a loss, an optimizer factory's result)."""


class MailboxClosed(GsyncError, RuntimeError):
    """A message was posted to an actor's mailbox after that actor received ``Close``."""

    def __init__(self, owner: str, message: object) -> None:
        super().__init__(f"mailbox of {owner} is closed; {message!r} was not delivered")
        self.owner = owner
        self.message = message


class FitError(GsyncError, RuntimeError):
    """Base class of the errors that end a ``fit`` midway (see :class:`GsyncError` for what they carry)."""

    others: tuple[FitError, ...] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.at = time.monotonic()
        """When the failure was detected (``time.monotonic()``): ``fit`` reports the earliest."""


class WorkerFailed(FitError):
    """Training code raised on one device; the original exception is ``__cause__``.

    ``site`` is the phase that raised: ``data`` (moving the shard to the
    device), ``forward`` (the model and ``loss_fn``), ``backward`` or
    ``optimizer``; in ``forward`` and ``backward``, ``shard_rows`` and
    ``batch_rows`` say how many rows of how many the device had. ``str()``
    ends with the cause's type and message. ``others`` lists the failures of
    further devices that failed before their peers were cancelled, earliest first.
    """

    _tells_its_cause = True

    shard_rows: int | None = None  # class defaults: an instance pickled before they existed has neither
    batch_rows: int | None = None

    def __init__(
        self,
        device: str,
        device_index: int,
        step: int,
        site: str,
        shard_rows: int | None = None,
        batch_rows: int | None = None,
    ) -> None:
        message = f"worker on device {device} (index {device_index}) failed at step {step} during {site}"
        if shard_rows is not None and batch_rows is not None:
            # What this device was given is often the answer (a BatchNorm's shard of one row): say it.
            message += f" (its shard: {shard_rows} of the batch's {batch_rows} rows)"
        super().__init__(message)
        self.device = device
        self.device_index = device_index
        self.step = step
        self.site = site
        self.shard_rows = shard_rows
        """The rows of this device's shard of the batch it failed on, in ``forward`` and ``backward``."""
        self.batch_rows = batch_rows
        """That batch's rows over every device (of every process)."""


# Sites of the session's calls that run between steps, whose errors name the last step applied.
_BETWEEN_STEPS = ("evaluate", "all_reduce", "checkpoint")
SESSION_START = "session start"
"""The site of a failure while a session starts across processes (after the ranks joined, before the first step)."""


def _after(step: int) -> str:
    return f"after step {step}" if step >= 0 else "before the first step"


class SyncFailed(FitError):
    """A collective raised; the cause is ``__cause__``.

    ``site`` says which: ``"all-reduce of bucket N"`` (``bucket`` is ``N``),
    ``"buffer broadcast"`` for a step's closing collectives (the buffer
    broadcast, or the agreement across processes; ``bucket`` is ``None``), or
    ``"evaluate"`` / ``"all_reduce"`` for those session calls, or
    ``"checkpoint"`` for the gather of a ``shard_optimizer=True`` checkpoint
    across processes, which run between steps (``step`` is then the last step applied), or
    ``"session start"`` for the collectives a session across processes runs
    before its first step.
    """

    _tells_its_cause = True

    site: str = "buffer broadcast"  # the class default: an instance pickled before sites existed has none

    def __init__(self, step: int, bucket: int | None, detail: str = "", site: str | None = None) -> None:
        if site in _BETWEEN_STEPS:
            what = f"the collective of {site} {_after(step)} failed"
        elif site == SESSION_START:
            what = "the collectives that start the session (checking parameters and resume steps, broadcasting rank 0's state) failed"
        elif bucket is None:
            what = f"closing collectives (buffer broadcast, cross-process agreement) failed at step {step}"
        else:
            what = f"all-reduce of bucket {bucket} failed at step {step}"
        super().__init__(what + (f": {detail}" if detail else ""))
        self.step = step
        self.bucket = bucket
        self.site = site or ("buffer broadcast" if bucket is None else f"all-reduce of bucket {bucket}")


class SyncTimeout(FitError, TimeoutError):
    """A step (or an evaluation, ``site="evaluate"``, an all_reduce, ``site="all_reduce"``, or the gather of a
    sharded checkpoint across processes, ``site="checkpoint"``) did not complete within ``sync_timeout`` seconds.

    ``missing`` lists the ``(device, bucket)`` pairs that never reported ready;
    ``unreduced`` the buckets that were ready everywhere but whose reduction
    never finished; ``stalled_devices`` the device names involved, and
    ``last_seen`` where each of them was last seen (e.g. ``"step 2, optimizer"``);
    ``site`` what did not complete (``"gradient sync"``, ``"optimizer step"``, ...),
    named as :attr:`WorkerFailed.site` is.
    """

    def __init__(
        self,
        step: int,
        timeout: float,
        missing: Sequence[tuple[str, int]] = (),
        unreduced: Sequence[int] = (),
        stalled_devices: Sequence[str] = (),
        site: str = "gradient sync",
        last_seen: dict[str, str] | None = None,
    ) -> None:
        self.step = step
        self.timeout = timeout
        self.missing = tuple(missing)
        self.unreduced = tuple(unreduced)
        self.stalled_devices = tuple(stalled_devices) or tuple(dict.fromkeys(d for d, _ in self.missing))
        self.last_seen = dict(last_seen or {})
        self.site = site
        if site in _BETWEEN_STEPS:  # ``step`` is the last step applied
            parts = [f"{site} {_after(step)} did not complete within {timeout:g} s"]
        else:
            parts = [f"step {step} did not complete its {site} within {timeout:g} s"]
        if self.stalled_devices:
            described = [
                f"{d} (last seen in {self.last_seen[d]})" if d in self.last_seen else d for d in self.stalled_devices
            ]
            parts.append(f"stalled devices: {', '.join(described)}")
        if self.missing:
            shown = ", ".join(f"({d}, bucket {b})" for d, b in self.missing[:16])
            more = f" and {len(self.missing) - 16} more" if len(self.missing) > 16 else ""
            parts.append(f"buckets never ready: {shown}{more}")
        if self.unreduced:
            parts.append(f"buckets whose all-reduce never finished: {list(self.unreduced)}")
        super().__init__("; ".join(parts))


class NonFiniteLoss(FitError, FloatingPointError):
    """A device's loss was NaN or infinite (with ``on_nonfinite="raise"``, the default)."""

    def __init__(self, device: str, device_index: int, step: int, value: float) -> None:
        super().__init__(
            f"loss on device {device} at step {step} is {value}; lower the learning rate, check the data, "
            "or pass on_nonfinite='skip' to skip such steps on every device"
        )
        self.device = device
        self.device_index = device_index
        self.step = step
        self.value = value


class ReplicasDiverged(FitError):
    """Replicas that must hold equal parameters do not (checked every ``check_replicas_every`` steps)."""

    def __init__(self, step: int, fingerprints: dict[str, float]) -> None:
        shown = ", ".join(f"{device}: {value!r}" for device, value in fingerprints.items())
        super().__init__(
            f"replicas differ after step {step} (parameter fingerprints {shown}); something changed one replica "
            "outside the optimizer (a loss_fn writing to parameters, a non-deterministic custom op)"
        )
        self.step = step
        self.fingerprints = dict(fingerprints)


class PeerFailed(FitError):
    """Another rank's fit failed; this rank stopped instead of waiting on it.

    ``rank``, ``device``, ``step`` and ``site`` say where it failed
    (``site`` ``"session start"``: while its session started, before the
    first step: building its replicas and optimizers from the model or a checkpoint);
    ``error_type`` and ``remote_message`` are its original exception's type
    name and message (the exception itself lives in the other process). A
    rank that left its session normally while this one started another step
    is reported the same way, with ``error_type`` ``"SessionClosed"`` and
    ``step`` its last step; a rank that named lost peers (:class:`PeerLost`)
    with ``error_type`` ``"PeerLost"`` and a message naming them.
    """

    def __init__(
        self,
        rank: int,
        device: str,
        step: int,
        site: str,
        error_type: str,
        remote_message: str,
        device_index: int = -1,
    ) -> None:
        if error_type == "SessionClosed":
            # Not a failure of the peer: it ended its loop while this rank went on.
            super().__init__(f"rank {rank} left its session after step {step}: {remote_message}")
        elif error_type == "PeerLost":
            # The peer gave up on others that stopped or got stuck; the message names them.
            super().__init__(f"rank {rank} stopped waiting at step {step} ({site}): {remote_message}")
        elif site == SESSION_START:
            super().__init__(f"rank {rank} failed to start its session: {error_type}: {remote_message}")
        else:
            if device:
                where = f"worker on device {device} failed at step {step} during {site}"
            elif site in _BETWEEN_STEPS:
                where = f"{site} {_after(step)} failed"
            elif step >= 0:
                where = f"{site} failed at step {step}"
            else:
                where = f"{site} failed"
            super().__init__(f"rank {rank} failed: {where}: {error_type}: {remote_message}")
        self.rank = rank
        self.device = device
        self.device_index = device_index
        self.step = step
        self.site = site
        self.error_type = error_type
        self.remote_message = remote_message


@dataclass(frozen=True)
class LostRank:
    """Where a rank that stopped or got stuck was, from its last heartbeat."""

    rank: int
    step: int
    phase: str
    """What it was doing: a device phase (``forward``, ``backward``...), ``gradient sync``, or its own code
    between operations (``outside gsync``)."""
    device: str
    """The device furthest behind on that rank, when one is."""
    silent_for: float | None
    """Seconds without a heartbeat; ``None`` for a rank that still beats (alive but stuck)."""
    held_for: float
    """Seconds it had been at ``step``/``phase`` by its last heartbeat."""
    heard: str = ""
    """What its last heartbeat said, when that was before ``step`` (beats are twice a second, steps can be
    faster; ``phase`` and ``device`` are then unknown and empty)."""

    def __str__(self) -> str:
        where = f"step {self.step} ({self.phase}{' on ' + self.device if self.device else ''})"
        if self.heard:
            # Its beats are half a second apart; where exactly it stopped is not known.
            where = f"step {self.step} or just before (last heard at {self.heard})"
        elif self.phase == "outside gsync":
            after = f"after step {self.step}" if self.step >= 0 else "before its first step"
            where = f"its own code {after} (the training loop or its data)"
        elif self.step < 0:
            where = f"start-up ({self.phase})"
        if self.silent_for is not None:
            return (
                f"rank {self.rank} stopped responding at {where}: no heartbeat for {self.silent_for:.1f} s; "
                "it was killed, crashed or is hung"
            )
        return (
            f"rank {self.rank} is alive but stuck at {where} for {self.held_for:.1f} s, while this rank waited "
            "for it in a collective"
        )


class PeerLost(PeerFailed):
    """Other ranks stopped responding, or are stuck outside any collective, while this rank waited for them.

    Named from the ranks' heartbeats (see :class:`LostRank`): ``lost`` lists
    every rank named; ``rank``, ``step``, ``site`` (the phase) and ``device``
    are the first one's, as in :class:`PeerFailed`. The collective error that
    revealed it is ``__cause__``.
    """

    def __init__(self, lost: Sequence[LostRank]) -> None:
        self.lost = tuple(lost)
        first = self.lost[0]
        FitError.__init__(self, "; ".join(str(rank) for rank in self.lost))
        self.rank = first.rank
        self.device = first.device
        self.device_index = -1
        self.step = first.step
        self.site = first.phase
        self.error_type = "stopped responding" if first.silent_for is not None else "stuck"
        self.remote_message = ""


class DataFailed(FitError):
    """Iterating the user's ``data`` raised; the cause is ``__cause__``.

    In ``fit`` (``site="reading data"``) while reading the batch of ``step``;
    in :meth:`Session.evaluate` (``site="evaluate"``) while reading its
    ``batch``-th batch (from 0) after ``step``, the last step applied.
    """

    _tells_its_cause = True

    site: str = "reading data"  # class defaults: an instance pickled before they existed has neither
    batch: int | None = None

    def __init__(self, step: int, site: str = "reading data", batch: int | None = None) -> None:
        if site in _BETWEEN_STEPS:
            which = "its data" if batch is None else f"batch {batch} (from 0) of its data"
            message = f"{site} {_after(step)}: reading {which} failed"
        else:
            message = f"reading the batch of step {step} from data failed"
        super().__init__(message)
        self.step = step
        self.site = site
        self.batch = batch


class SessionClosed(ConfigError):
    """A session was used after it was closed, or after a failure (or a cancelled call) closed it.

    The message says which; a failure that closed it is ``__cause__``, and its
    ``last_step`` and ``checkpoint`` are this error's too.
    """


class Departed(GsyncError):
    """This rank left its elastic run on purpose (SIGTERM: a preemption, a launcher tearing down).

    It finished the step in flight, told the others, which went on without
    waiting out a silence, and closed its session with the trained weights
    written into the model. ``last_step`` is the last step it applied and
    ``checkpoint`` its state then. Raised so the program ends as a SIGTERM
    asks, rather than going on as if the training had run to its end.
    """


class StopTraining(Exception):
    """Raise from a ``fit`` callback to end training after the current step; ``fit`` returns normally.

    Not an error: the result holds every step done so far.
    """


class CheckpointError(GsyncError, ValueError):
    """A checkpoint file that cannot be used: missing, truncated, corrupt, foreign, or of a newer format.

    The message names the file.
    """


class SessionLeftOpenWarning(RuntimeWarning):
    """A held session was dropped while open (no reference to it left), or its task cancelled (the event loop ended).

    gsync closed it, and left the model passed in as it was: the training that session did is not in the model,
    which is what ``await session.aclose()`` would have written back. A ``RuntimeWarning``, not a
    ``ResourceWarning``, because Python's default warning filters hide resource warnings, and what is lost here is
    the training, not a file handle. Silence it as any warning:
    ``warnings.filterwarnings("ignore", category=gsync.SessionLeftOpenWarning)``.
    """


# -- user-caused errors, raised from the caller's line ---------------------------------------------------------

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MACHINERY_DIRS = tuple(os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep for module in (asyncio, anyio))
_MACHINERY_FILES = (os.path.abspath(contextlib.__file__),)
_Function = TypeVar("_Function", bound=Callable[..., Any])


def _user_caused(error: BaseException) -> bool:
    return isinstance(error, (ConfigError, InputTypeError, CheckpointError))


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) or path.startswith(_MACHINERY_DIRS) or path in _MACHINERY_FILES


def _drop_internal_frames(error: BaseException | None) -> None:
    """Start a user-caused error's traceback at the user's line, when every frame below it is gsync's.

    A ConfigError, InputTypeError or CheckpointError says what to change in the call; the dozens of frames of
    gsync (and the event loop) it was raised through, from a session's start in its own task, say nothing the user
    can act on. A traceback that passes through user code (a callback that called gsync) is kept whole, and
    ``GSYNC_FULL_TRACEBACKS=1`` keeps every one (for debugging gsync itself).
    """
    if error is None or not _user_caused(error) or os.environ.get("GSYNC_FULL_TRACEBACKS"):
        return
    frame = error.__traceback__
    while frame is not None:
        if not _internal(frame.tb_frame.f_code.co_filename):
            return
        frame = frame.tb_next
    error.__traceback__ = None


def _raised_at_caller(function: _Function) -> _Function:
    """``function`` (sync or async), whose user-caused errors are raised from its caller's line.

    A bare ``raise`` re-raises without adding the raising frame, so the wrapper leaves no frame of its own.
    """
    if inspect.iscoroutinefunction(function):

        # Named so: gsync_pytest's report of a task left running looks through it, to the call it awaits.
        @functools.wraps(function)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await function(*args, **kwargs)
            except (ConfigError, InputTypeError, CheckpointError) as error:
                _drop_internal_frames(error)
                raise

        return call_async  # type: ignore[return-value]

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (ConfigError, InputTypeError, CheckpointError) as error:
            _drop_internal_frames(error)
            raise

    return call  # type: ignore[return-value]
