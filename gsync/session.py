"""Sessions: gsync's machinery kept open while your code drives the steps, from any task of the loop.

``session = await engine.session(model, ...)`` opens everything a fit needs
(replicas, device actors, the sync server, worker threads and, across
processes, the process group) and returns a :class:`Session` you can hold:
step it in one notebook cell, plot in the next, ``fit`` it in a third, and
``await session.aclose()`` in the last, or in a pytest fixture's teardown.
``async with engine.session(model, ...) as session`` is the scoped form:
leaving the block is ``aclose()``. ``Engine.fit`` opens one, runs
:meth:`Session.fit` and closes it.

The session's task group lives in a task the session owns, started on the
loop that opened it; so no call depends on which task makes it. What each
call does when things go wrong:

- A failure while a call waits (a device raised, a collective failed or
  stalled, a peer process failed or was lost) makes that call raise it:
  :class:`~gsync.WorkerFailed`, :class:`~gsync.SyncFailed`,
  :class:`~gsync.SyncTimeout`, :class:`~gsync.NonFiniteLoss`,
  :class:`~gsync.PeerFailed`, :class:`~gsync.PeerLost`, each with
  ``last_step`` and ``checkpoint``.
- A failure while no call runs (a peer lost while you plot) closes the
  session at once (threads ended, peers told); the next call raises it, or
  :meth:`Session.aclose` does if no call comes. In the scoped form it also
  cancels the block's code at its next ``await``, and the ``async with``
  raises it.
- Cancelling a call (a notebook interrupt, ``anyio.move_on_after``, a test's
  timeout) cancels it and closes the session: devices may be inside a step,
  and across processes the ranks' collectives would no longer match. Later
  calls raise :class:`~gsync.SessionClosed`, with the checkpoint.
- An exception of your own that leaves the scoped block, or a callback's in
  :meth:`Session.fit`, ends the session and propagates unchanged.
- Whatever closed it, the session is closed afterwards and using it again
  raises :class:`~gsync.SessionClosed` saying why. A clean close writes the
  trained weights into the model you passed in; after a failure the model
  is left as it was and the error's checkpoint has the state.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import warnings
import weakref
from dataclasses import replace
from collections.abc import AsyncIterable, AsyncIterator, Generator, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio
import torch
from torch import nn

from ._core.session.core import ReduceOp, SessionCore
from ._core.session.operations import AllReduce, Evaluate
from ._core.session.service import SessionService, SessionSlot
from ._core.settings import EngineSettings
from .checkpoint import Checkpoint
from ._core.step.context import Recipe
from .errors import ConfigError, SessionClosed, SessionLeftOpenWarning, _raised_at_caller
from ._core.session.fit import run_fit
from ._core.session.fit_settings import FitLoopSettings
from ._core.session.cancelling import cancellation_kept
from ._core.base.outcome import is_cancellation
from ._core.monitoring import SessionMonitor
from .result import FitResult, FitStats, StepResult
from .trace import Trace
from .types import MetricFn

__all__ = ("Session", "SessionOpener", "StepResult")

_CALL_CANCELLED = (
    "gsync: this cancellation closed the session (a call cancelled midway leaves the devices apart); the next call "
    "raises SessionClosed with .checkpoint: open a new session with resume=that checkpoint to go on"
)
_CLOSE_CANCELLED = "gsync: the session was closed all the same (a close that has begun finishes)"

# Held services, until they end: the event loop keeps only weak references to its tasks.
_HELD: set[asyncio.Task[None]] = set()
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class Session:
    """One open session of data-parallel training; see :mod:`gsync.session` and :meth:`gsync.Engine.session`.

    Get one with ``session = await engine.session(...)`` or ``async with
    engine.session(...) as session``, never directly. Use it from any task
    of the event loop that opened it, one call at a time; a call from
    another thread or another event loop is a :class:`~gsync.ConfigError`.
    """

    def __init__(self, service: SessionService, *, scoped: bool, monitor: SessionMonitor | None = None) -> None:
        self._service = service
        self._scoped = scoped
        # Hands each step to the loggers and this process's counters; told how the session ended.
        self._monitor = monitor if monitor is not None else SessionMonitor()
        self._thread = threading.get_ident()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # trio: one run per thread, so the thread check is the loop check

    @property
    def _core(self) -> SessionCore:
        """The session's core: one for its whole life, across an elastic run's membership changes."""
        return self._service.serving

    # -- what the session holds ------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """A module holding the weights of the last step applied: look at the model between calls.

        A copy of the model you passed in, made the first time you read this
        (one more model's memory, on the model's own device), refreshed from
        the first replica each time you read it again after a step (one copy
        of its parameters and buffers: a device-to-host copy for a CUDA
        replica, which waits for the device). Read while a step runs (from
        another task), it holds the weights as of your last read and is
        refreshed as that step is applied. Training never reads it: put it in
        eval mode, sample from it, plot it. It is a snapshot, so read
        ``session.model`` again to see later steps. The model you passed in
        is left as it was until the session closes cleanly.

        :raises ~gsync.SessionClosed: once the session is closed (after a
            clean close, the model you passed in holds the trained weights).
        """
        self._check_caller()
        return self._core.current_model()

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """This process's replicas' optimizers, one per local device, for what ``scheduler=`` cannot do.

        A metric-driven schedule (``ReduceLROnPlateau``, stepped with a
        validation loss) or a learning rate set by hand: build or change it
        over every one of them, the same way, between steps (on every rank:
        ``evaluate`` returns the same global metrics everywhere). Replicas
        whose optimizers differ would train apart.

        :raises ~gsync.SessionClosed: once the session is closed.
        :raises ~gsync.ConfigError: while a step, evaluate or all_reduce runs.
        """
        self._check_caller()
        return self._core.optimizers

    @property
    def first_step(self) -> int:
        """The global index of this session's first step (> 0 when resuming)."""
        return self._core.first_step

    @property
    def next_step(self) -> int:
        """The global index the next :meth:`step` will have."""
        return self._core.next_step

    @property
    def rank(self) -> int:
        """This process's rank (0 in a one-process run)."""
        return self._core.rank

    @property
    def world_size(self) -> int:
        """The number of processes (1 in a one-process run)."""
        return self._core.world_size

    @property
    def stats(self) -> FitStats:
        """Counters of this session so far: steps, buckets, messages, bytes reduced."""
        return self._core.stats

    @property
    def trace(self) -> Trace | None:
        """The session's timeline, when the engine traces."""
        return self._core.trace

    @property
    def closed(self) -> bool:
        """Whether the session has ended (closed, failed or dropped): calls raise :class:`~gsync.SessionClosed`."""
        return self._service.closing

    # -- calls -----------------------------------------------------------------------

    async def step(self, *batches: Any) -> StepResult:
        """One optimizer step on every device, over one or more *global* batches.

        Each batch is split across all devices of all processes exactly as in
        :meth:`fit`. With several batches the step accumulates: its gradient
        is the mean over the batches of each batch's mean-loss gradient, and
        the backward passes before the last move no bytes. Returns once every
        local replica has applied the step.

        A bad batch is refused before anything is dispatched, and the
        session stays open.

        - Cancelled: the step is abandoned, the session closed (peers told)
          and the cancellation propagates, within about half a second
          whatever the devices do (a thread stuck in native code is left
          behind, named in a warning). One that arrives while the step is
          already raising a failure is raised all the same (``CancelledError``,
          the failure its ``__context__``).
        - A failure settled while no call ran (a peer lost between calls) is
          raised by this call, before anything is dispatched.
        - A membership change mid-step (``Engine(elastic=...)``) redoes the
          step over the new membership from the last consistent state, on the
          same global batch, and returns its result; if the new membership
          starts past it (a member that applied it handed its state over), the
          result has ``loss=nan``.

        :raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError` for a bad
            batch (before anything is dispatched), when called while another
            task's call runs, or from another thread or event loop.
        :raises ~gsync.SessionClosed: after the session closed.
        :raises ~gsync.WorkerFailed: and the other errors of :meth:`fit`, or a
            failure settled since the last call; the session is closed afterwards.
        """
        self._check_call()
        with cancellation_kept(_CALL_CANCELLED):
            try:
                result = await self._service.step(batches, last=False)
                if result is None:
                    # The new membership started after this step: a member that had applied it handed its state over.
                    core = self._core
                    return StepResult(step=core.next_step - 1, loss=math.nan, lr=math.nan, rows=0, seconds=0.0, world_size=core.world_size)
                self._monitor.stepped(result)
                return result
            except BaseException as error:
                await self._closed_by(error)
                raise

    async def _after_change(self) -> SessionCore:
        """The session's core, once it runs a generation a call can use (an elastic run's due change made first)."""
        return await self._service.serving_core()

    async def fit(
        self,
        data: Iterable[Any] | AsyncIterable[Any],
        *,
        epochs: int = 1,
        accumulate: int = 1,
        callbacks: Sequence[Any] = (),
        progress: bool | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep: int = 2,
        val_data: Iterable[Any] | AsyncIterable[Any] | None = None,
        eval_every: int | None = None,
        val_metric_fn: MetricFn | None = None,
        keep_best: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        uneven: Literal["refuse", "join"] | None = None,
    ) -> FitResult:
        """Train on ``data`` from where the session is; ``Engine.fit`` is this call between an open and a close.

        Takes :meth:`gsync.Engine.fit`'s loop arguments, with the same
        meaning but for ``epochs``: here, that many passes over ``data``
        from where the session is. The optimizer, scheduler and scaler state and the step
        numbers carry over from the session's earlier steps and fits: two
        calls of ``session.fit(data)`` end with the parameters of one
        ``engine.fit(data, epochs=2)``. Each result has the losses and history
        of its own call; its ``first_step`` is where the call began, and its
        ``model`` is :attr:`model` as of its last step. In a session opened
        with ``resume=``, the first fit before any step continues the run the
        checkpoint came from: ``data`` is replayed and the steps the
        checkpoint includes are skipped, as ``Engine.fit(resume=...)`` does,
        and ``epochs`` counts the run's epochs, those before the checkpoint too.

        ``uneven`` (default: the session's own, ``Engine.session(uneven=...)``)
        says what ranks fed process-local data of unequal length do, as in
        :meth:`gsync.Engine.fit`.

        ``val_data`` is evaluated every ``eval_every`` steps (counted by the
        session's global step, so a second fit continues the schedule) and at
        the end of the call, as in :meth:`gsync.Engine.fit`; with
        ``keep_best`` and a ``checkpoint_dir``, a later call compares against
        the best its ``best.json`` records from an earlier step.

        A :class:`~gsync.StopTraining` from a callback ends the call early,
        normally, and the session stays open. A failure, or any other
        exception from a callback, closes the session (the exception
        propagates unchanged).

        - Cancelled: the fit stops, the session is closed and the
          cancellation propagates, as for :meth:`step` (a checkpoint file due
          for a step already applied is still written).
        - A failure settled while no call ran is raised before the first step.
        - Closed from another task (``aclose``): the fit raises
          :class:`~gsync.SessionClosed` and the model is left as it was.
        - A membership change mid-fit redoes the interrupted step over the new
          membership and goes on; ``on_membership_change`` callbacks hear of it.

        :raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError` for bad
            arguments, before any step (the session stays open).
        :raises ~gsync.WorkerFailed: and the other errors of :meth:`gsync.Engine.fit`.
        """
        self._check_call()
        settings = FitLoopSettings.checked(
            data, epochs, accumulate, callbacks, progress, checkpoint_dir, checkpoint_every, keep, uneven=uneven,
            val_data=val_data, eval_every=eval_every, val_metric_fn=val_metric_fn, keep_best=keep_best,
            best_mode=best_mode,
        )
        with cancellation_kept(_CALL_CANCELLED):
            return await self._fit(data, settings)

    async def _fit(self, data: Iterable[Any] | AsyncIterable[Any], settings: FitLoopSettings, result_model: nn.Module | None = None) -> FitResult:
        service = self._service
        try:
            # The whole fit is one call: another task's step, evaluate or fit is refused until it ends, and a close
            # from another task ends it (the fit's own callbacks may use the session).
            with service.fit_running():
                # The monitor is the fit's first callback, so a step is logged before any callback can stop the fit.
                settings = replace(settings, callbacks=[self._monitor, *settings.callbacks])
                return await run_fit(self, await self._after_change(), data, settings, result_model, carry=service)
            raise self._core.failure or SessionClosed("the fit was ended by a close from another task")
        except BaseException as error:
            # A fit that raised, whatever raised it, leaves the ranks' loops apart: the session ends with it.
            await self._service.close(error)
            self._monitor.ended(error)
            raise

    async def evaluate(self, data: Iterable[Any] | AsyncIterable[Any], *, metric_fn: MetricFn | None = None) -> dict[str, float]:
        """Evaluate on every global batch of ``data``, in eval mode and without gradients; global row-weighted means.

        Without ``metric_fn`` the result is ``{"loss": ...}`` from the
        session's ``loss_fn``. ``metric_fn(model, shard)`` returns a scalar
        (reported under the function's name) or a dict of scalars keyed by
        name. Each shard's values are weighted by its rows and divided by
        every row seen, and a name a shard leaves out counts as 0 for its
        rows: exact, on any number of devices, for a per-row mean (a fraction
        of rows that are positive, which a shard with none may leave out). A
        ratio of counts (recall) is not a per-row mean: return its numerator
        and denominator as per-row means, and divide the results. Each batch
        is split over the devices as in :meth:`step` (with process-local data,
        over this process's devices). Across processes this is a collective:
        every rank calls it at the same point of its loop (not only rank 0, as
        DDP scripts often validate; a rank that skips it leaves the others
        waiting until ``sync_timeout``); ranks may see different numbers of
        rows, and a metric's names are combined over every rank. Module modes
        are restored afterwards.

        A failure midway (reading ``data``, a bad batch, ``metric_fn``)
        closes the session, as a failed :meth:`step` does: across processes
        the ranks' evaluations no longer match. The error carries the
        checkpoint of the last step (``error.checkpoint``) to resume from.
        Cancelled, it closes the session and the cancellation propagates, as
        for :meth:`step`; a failure settled while no call ran is raised
        before any batch is read; a membership change due before the call is
        made first, and one that interrupts it redoes the evaluation over the
        new membership from its first batch (a one-shot iterator, whose
        batches are gone, raises the loss instead, once the change is made).
        A rank whose peer completed the evaluation before the change returns
        that peer's result instead of redoing it, so every rank returns the
        same metrics and goes on to the same next call.

        :raises ~gsync.InputTypeError: for ``data`` that is not an iterable of batches, or a ``metric_fn`` that
            is not callable (before any work, the session stays open).
        :raises ~gsync.DataFailed: when iterating ``data`` raises (``site="evaluate"``; the cause chained).
        :raises ~gsync.WorkerFailed: when ``metric_fn`` raises on a device.
        :raises ~gsync.SyncTimeout: when a device's share of a batch takes longer than ``sync_timeout``.
        :raises ~gsync.ConfigError: for a bad batch, an empty ``data``, or a closed session.
        """
        self._check_call()
        with cancellation_kept(_CALL_CANCELLED):
            try:
                # Over a membership change the evaluation is redone from its first batch, if data can be read again.
                metrics = await self._service.carried(Evaluate(data, metric_fn, redoable=_iterable_again(data)))
                self._monitor.evaluated(metrics)
                return metrics
            except BaseException as error:
                await self._closed_by(error)
                raise

    async def all_reduce(self, value: float | torch.Tensor, op: ReduceOp = "sum") -> float | torch.Tensor:
        """Combine one value per *process* (not per device) over every process.

        ``value`` is a number or a tensor (the same shape on every rank);
        ``op`` is ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``. Across
        processes it is a collective: every rank must call it, in the same
        order, with a value of the same shape and dtype. The result has the
        same type on any number of processes: an ``int`` stays an ``int``
        (reduced as int64) and a tensor keeps its dtype, except that
        ``"mean"`` divides, giving a ``float`` (a floating tensor: float64 for
        an integer or bool one). In one process ``sum``, ``max`` and ``min``
        return the value itself.

        Cancelled, it closes the session and the cancellation propagates, as
        for :meth:`step`; a failure settled while no call ran is raised
        first; a membership change due before the call is made first, and
        one that interrupts it redoes the reduction over the new membership
        (every survivor redoes it with its value), unless a peer completed it
        before the change: then every rank returns that peer's result.

        :raises ~gsync.ConfigError: for an unknown ``op`` or a closed session.
        :raises ~gsync.InputTypeError: for a value that is neither a number nor a tensor.
        """
        self._check_call()
        with cancellation_kept(_CALL_CANCELLED):
            try:
                return await self._service.carried(AllReduce(value, op))
            except BaseException as error:
                await self._closed_by(error)
                raise

    def checkpoint(self) -> Checkpoint:
        """The current consistent state as of the last step, copied to the CPU.

        Model, optimizer, scheduler and scaler state, and the global random
        generators as they are now (a session opened with ``resume=`` this
        checkpoint restores them, so dropout continues as it would have).

        With ``shard_optimizer=True`` across processes each rank holds only
        its devices' shards of the optimizer state, and this call gathers
        them: it is a collective, to be called on every rank at the same
        point between steps (as ``step`` is). It blocks until every rank has
        called it (each collective within ``sync_timeout``), and every rank
        gets the whole state, as unsharded; each receives the shards it does
        not hold (see the sharding page of the docs). A gather that fails
        closes the session, as a failed ``all_reduce`` does.

        :raises ~gsync.ConfigError: while a step runs, or after the session ended.
        :raises ~gsync.SyncFailed: (``site="checkpoint"``), :class:`~gsync.SyncTimeout`,
            :class:`~gsync.PeerFailed`: when the gather of a sharded checkpoint across processes failed.
        """
        self._check_caller()
        return self._core.checkpoint()

    async def aclose(self) -> None:
        """Close the session: the model you passed in receives the trained weights; every thread ends. Idempotent.

        After a failure (or a cancelled call) the model is left as it was.
        A call still running in another task (a step, or a fit between its
        steps) is ended first with :class:`~gsync.SessionClosed`, and the
        model is left as it was. From the moment the close begins, every
        call raises :class:`~gsync.SessionClosed`. Closing finishes even if
        the calling task is cancelled meanwhile; that cancellation is raised
        once the session is down. In an elastic run, a close that comes while
        the membership changes lets the change finish and then leaves without
        serving the new membership (its other members see this rank gone and
        change again).

        :raises ~gsync.PeerLost: or whichever failure ended the session while
            no call ran, if no call has raised it yet (with ``last_step`` and
            ``checkpoint``); once: a second ``aclose()`` returns quietly.
        :raises ~gsync.ConfigError: from another thread or event loop.
        """
        self._check_caller(closing=True)
        with cancellation_kept(_CLOSE_CANCELLED):
            await self._closing(None)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """``async with session:`` on a held session closes it when the block ends, as the scoped form does."""
        await self._closing(exc)

    async def _closing(self, exc: BaseException | None) -> None:
        """Close the service (``exc``: what ends the session, if anything) and tell the loggers how it ended."""
        try:
            await self._service.close(exc)
        except BaseException as error:
            self._monitor.ended(error)
            raise
        self._monitor.ended(exc)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"open, next step {self.next_step}"
        return f"<gsync.Session {state}, opened at {self._service.opened_at}>"

    def __del__(self) -> None:
        service = getattr(self, "_service", None)
        if service is None:
            return
        if service.done.is_set():
            service.log_if_pending()  # a failure nobody can raise any more is logged, not lost
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # trio (its sessions are scoped), or the loop that ran it has ended, and its tasks with it
        dropped = not service.closing
        why = f"the session opened at {service.opened_at} was dropped while open (no reference to it was left)"
        if dropped:
            warnings.warn(
                f"{why}; it is closed now, and its model is left as it was: `await session.aclose()` when you are done",
                SessionLeftOpenWarning,
                stacklevel=2,
            )
            # At once, not on the loop's next turn: an open right after the drop waits for this one to end.
            service.mark_closing()

        def drop() -> None:
            if dropped:
                service.drop(why)
            task = asyncio.ensure_future(_log_when_done(service), loop=loop)
            _HELD.add(task)
            task.add_done_callback(_HELD.discard)

        try:
            loop.call_soon_threadsafe(drop)
        except RuntimeError:
            pass  # the loop closed meanwhile

    async def _closed_by(self, error: BaseException) -> None:
        """After a call raised ``error``: if that closed the session, wait until everything it started has stopped."""
        if not self._core.usable:
            await self._service.close(error)
            self._monitor.ended(error)

    # -- checks ----------------------------------------------------------------------

    def _check_call(self) -> None:
        """A call that runs an operation: from the right thread and loop, and not beside another task's fit."""
        self._check_caller()
        # Once closed, every call says so (the core raises SessionClosed), though a fit may still be winding down.
        if self._service.fit_runs_elsewhere():
            raise ConfigError(
                "a call of this session while another task's fit() runs: a session does one thing at a time; "
                "await the fit first (its callbacks may use the session)"
            )

    def _check_caller(self, closing: bool = False) -> None:
        if threading.get_ident() != self._thread:
            raise ConfigError(
                "a gsync session is used from the event loop that opened it, in its thread; this call came from "
                "another thread: hand the work to that loop (asyncio.run_coroutine_threadsafe, anyio.from_thread)"
            )
        loop = self._loop
        if loop is not None:
            try:
                current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                current = None
            if current is not loop:
                if loop.is_closed() and not closing:
                    raise SessionClosed("the event loop that opened this session has ended, and the session with it")
                if current is not None or not closing:
                    raise ConfigError(
                        "a gsync session is used from the event loop that opened it; this call came from "
                        + ("another event loop" if current is not None else "outside any event loop")
                    )


def _iterable_again(data: object) -> bool:
    """Whether iterating ``data`` again starts it over (a list, a DataLoader), unlike an iterator or a generator."""
    # Asked of the type, not by iterating: a DataLoader's iter() would start its workers.
    return not isinstance(data, (Iterator, AsyncIterator))


def _call_if_alive(method: weakref.WeakMethod[Any]) -> None:
    bound = method()
    if bound is not None:
        bound()


async def _log_when_done(service: SessionService) -> None:
    await service.done.wait()
    service.log_if_pending()


class SessionOpener:
    """What :meth:`gsync.Engine.session` returns: ``await`` it for a held session, or ``async with`` it for a scoped one."""

    def __init__(
        self,
        slot: SessionSlot,
        settings: EngineSettings,
        model: nn.Module,
        recipe: Recipe,
        resume: Checkpoint | None,
        process_local_data: bool,
        *,
        for_fit: bool = False,
        monitor: SessionMonitor | None = None,
    ) -> None:
        self._slot = slot
        self._monitor = monitor if monitor is not None else SessionMonitor()
        self._settings = settings
        self._args = (model, recipe, resume, process_local_data)
        self._for_fit = for_fit
        self._opened_at = _caller_location()
        self._entered = self._exiting = self._interrupted = False
        self._session: Session | None = None
        self._block_task: asyncio.Task[Any] | None = None
        self._group: tuple[anyio.abc.TaskGroup, anyio.CancelScope] | None = None

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open_held().__await__()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what the opener lacks: a session's attribute here is a missing `await`.
        if not name.startswith("_") and hasattr(Session, name):
            raise AttributeError(
                f"'SessionOpener' object has no attribute {name!r}: engine.session(...) returns an opener, not the "
                f"session; write `session = await engine.session(...)`, or `async with engine.session(...) as "
                f"session:`, and then session.{name}",
                name=name,
                obj=self,
            )
        raise AttributeError(f"'SessionOpener' object has no attribute {name!r}", name=name, obj=self)

    @_raised_at_caller
    async def _open_held(self, scoped: bool = False) -> Session:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "a held session (`session = await engine.session(...)`) needs asyncio; on trio, use the scoped form, "
                "`async with engine.session(...) as session:`"
            ) from None
        service = await self._service(held=not scoped)
        task = loop.create_task(service.run(), name=f"gsync session opened at {self._opened_at}")
        _HELD.add(task)
        task.add_done_callback(_HELD.discard)
        await service.wait_open()
        session = Session(service, scoped=scoped, monitor=self._monitor)
        self._monitor.opened(session)
        return session

    @_raised_at_caller
    async def __aenter__(self) -> Session:
        if self._entered:
            raise ConfigError("this engine.session(...) was entered already; call engine.session(...) again for another")
        self._entered = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return await self._enter_in_a_task_group()
        # On asyncio the block may end in another task than the one it began in (a pytest-asyncio fixture's
        # setup and teardown): the session is held, and the block only closes it.
        session = self._session = await self._open_held(scoped=True)
        self._block_task = asyncio.current_task()
        # Weakly: an opener whose block is never left (`await cm.__aenter__()` in a notebook) is dropped like a
        # held session, and warns.
        interrupt = weakref.WeakMethod(self._interrupt_block)
        session._service.on_idle_failure(lambda: _call_if_alive(interrupt))
        return session

    def _interrupt_block(self) -> None:
        """A failure while the block's code does something else cancels that code; the block then raises it."""
        task = self._block_task
        if task is not None and not self._exiting and not task.done() and self._session is not None:
            self._interrupted = True
            self._session._service.block_was_interrupted()
            task.cancel("gsync: the session failed while the block's code did something else")

    async def _enter_in_a_task_group(self) -> Session:
        """trio: the block's task runs the session's task group (a trio block begins and ends in one task)."""
        service = await self._service()
        group = anyio.create_task_group()
        await group.__aenter__()
        try:
            group.start_soon(service.run)
            await service.wait_open()
        except BaseException as error:
            # The service has ended (wait_open waited for it); what opening raised is raised as itself, not in a group.
            if is_cancellation(error):
                await group.__aexit__(type(error), error, error.__traceback__)
            else:
                await group.__aexit__(None, None, None)
            raise
        scope = anyio.CancelScope()
        scope.__enter__()
        service.on_idle_failure(scope.cancel)
        self._group = (group, scope)
        session = self._session = Session(service, scoped=True, monitor=self._monitor)
        self._monitor.opened(session)
        return session

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            swallowed = await self._exit(exc_type, exc, tb)
        except BaseException as error:
            self._monitor.ended(error)
            raise
        self._monitor.ended(None if swallowed else exc)
        return swallowed

    async def _exit(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._exiting = True
        session = self._session
        if session is None:
            return False
        if self._group is not None:
            group, scope = self._group
            try:
                ours = bool(scope.__exit__(exc_type, exc, tb)) and scope.cancelled_caught
            except BaseException:
                # trio raises from the scope's exit when it strips its own cancellation from a group: the
                # session is still closed and the task group left before that propagates.
                with anyio.CancelScope(shield=True):
                    await session._service.close(exc)
                    await group.__aexit__(None, None, None)
                raise
        else:
            group = None
            task = self._block_task
            ours = False
            if self._interrupted and task is not None and task is asyncio.current_task():
                # gsync's own cancel of the block is taken back, whether the block raised it or swallowed it (a
                # task left cancelling would make the next asyncio.timeout take its expiry for someone else's).
                others = task.uncancel()
                # Only a cancellation of ours, and no other pending: one from outside still propagates.
                ours = isinstance(exc, asyncio.CancelledError) and others == 0
        try:
            # The block's own exception (or a cancellation from outside) ends the session as it does the
            # block; a failure that cancelled the block's code is raised in its place.
            await session._service.close(None if exc is None or ours else exc)
        finally:
            if group is not None:
                await group.__aexit__(None, None, None)
        if ours:
            raise session._core.failure or SessionClosed("the session failed while the block's code ran")
        return False

    def __enter__(self) -> None:
        raise ConfigError(
            "engine.session(...) is asynchronous: `async with engine.session(...) as session:` "
            "or `session = await engine.session(...)`, in an async function or a notebook cell"
        )

    def __exit__(self, *exc: object) -> None:
        """Never reached: :meth:`__enter__` refuses."""

    async def _service(self, held: bool = False) -> SessionService:
        # Looped: two openers waiting for the same closing session must not both open.
        while (open_one := self._slot.service) is not None and not open_one.done.is_set():
            if not open_one.closing:
                raise ConfigError(_busy_engine(open_one, "a fit" if self._for_fit else "a session"))
            await open_one.done.wait()  # one that is closing (a dropped session) first ends
        model, recipe, resume, process_local_data = self._args
        service = SessionService(
            self._settings, model, recipe, resume, process_local_data, self._opened_at, for_fit=self._for_fit, held=held
        )
        self._slot.service = service
        return service


def _busy_engine(running: SessionService, wanted: str) -> str:
    """Why ``wanted`` cannot start: what the engine runs now, where it was started, and what to do."""
    if running.for_fit:
        where = f" (engine.fit called at {running.opened_at})" if running.opened_at != _UNKNOWN_PLACE else ""
        return (
            f"this engine is running a fit{where}, and runs one fit or session at a time: await that fit before "
            f"starting {wanted}, or give concurrent training an Engine of its own"
        )
    return (
        f"this engine already has an open session (opened at {running.opened_at}); "
        "`await session.aclose()` it (or `await engine.aclose()`) before opening another"
    )


_UNKNOWN_PLACE = "an unknown place"
# Frames of the event loop's own machinery: a task started with create_task(engine.fit(...)) has no caller of the
# user's, and what lies beyond the loop (whatever started it) is no place to name either.
_LOOP_MACHINERY = tuple(os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep for module in (asyncio, anyio))


def _caller_location() -> str:
    """``file:line`` of the first frame outside gsync and the event loop: where the user opened the session."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(_LOOP_MACHINERY):
        return _UNKNOWN_PLACE  # the task's first coroutine is gsync's: nothing of the user's awaits it
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
