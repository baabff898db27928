"""The task that owns a session's task group, so that the session can be held and used from any task.

An anyio task group must be entered and left by one task, but a held
session is opened in one notebook cell (or fixture setup) and closed in
another, each its own task. So the session's life (its core's
:func:`run_generation` with its task group, once per membership of an
elastic run) runs in a task of its own, as anyio's pytest plugin runs its
fixtures in one long-lived task: :class:`SessionService`. Operations do not
go through it: a step runs in the caller's task and meets the actors through
their mailboxes, so no call pays a hand-off. The service only waits for the
session to end (a close, a failure, a drop) and then leaves the task group.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from functools import partial
import time
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ...checkpoint import Checkpoint
from ..step.context import Recipe
from ...elastic import MembershipChange
from ...errors import ConfigError, GsyncError, SessionClosed, SessionLeftOpenWarning
from ...result import StepResult
from ...trace import MARK_TRACK, TraceEvent
from ..base.outcome import is_cancellation
from .core import SessionCore, run_generation
from .operations import Operation
from ..trace_files import finish_trace
from .state import Change, SessionState
from ..distributed.runtime import GROUP_TIMEOUT_MARGIN_S
from ..elastic.departure import departed as _departed, on_sigterm_depart
from ..elastic.membership import ElasticMembership
from ..base.faults import recoverable
from ..state.held import HeldState

if TYPE_CHECKING:
    from torch import nn

    from ..settings import EngineSettings

__all__ = ("SessionService", "SessionSlot", "open_services")

_T = TypeVar("_T")

logger = logging.getLogger("gsync")
_OPEN: weakref.WeakSet[SessionService] = weakref.WeakSet()


def open_services() -> list[SessionService]:
    """Every session of this process that has not ended yet (for the pytest plugin: those a fixture holds)."""
    return [service for service in list(_OPEN) if not service.done.is_set()]


class SessionSlot:
    """The one session an engine may have open at a time: what opening checks, and ``Engine.aclose`` closes."""

    def __init__(self) -> None:
        self.service: SessionService | None = None


class SessionService:
    """Runs one session's life in the task that calls :meth:`run`; the handle asks it to end."""

    def __init__(
        self,
        settings: EngineSettings,
        model: nn.Module,
        recipe: Recipe,
        resume: Checkpoint | None,
        process_local_data: bool,
        opened_at: str,
        *,
        for_fit: bool = False,
        held: bool = False,
    ) -> None:
        self._settings = settings
        self._model = model
        self._recipe = recipe
        self._resume = resume
        self._process_local_data = process_local_data
        self.opened_at = opened_at
        """Where the user opened the session (``file:line``), for the errors and warnings that name it."""
        self.for_fit = for_fit
        """Opened by ``Engine.fit`` (not held by the user): what an engine that is busy says it runs."""
        self.core: SessionCore | None = None
        """The session's core, once it has opened; one for the session's whole life, across membership changes."""
        self._opened = anyio.Event()
        self.done = anyio.Event()
        """Set once the session is closed and everything it started has stopped."""
        self._scope = anyio.CancelScope()
        self._open_error: BaseException | None = None
        self._end_with: BaseException | None = None
        self._close_error: BaseException | None = None
        self.closing = False
        """A close was asked for (by ``aclose``, a drop, or a failure): the session is ending."""
        self.held = held
        """Run in a task of its own (``await engine.session(...)``), not in the task group of an ``async with``."""
        self._block_interrupted = False
        """The scoped form cancelled its block's task because of a failure while no call ran."""
        self._fit_scope: anyio.CancelScope | None = None
        """The scope of a ``session.fit`` in progress: a close from another task ends it."""
        self._fit_task: object = None
        """The task running that fit (its callbacks may call the session; other tasks may not)."""
        self._on_idle_failure: Callable[[], None] | None = None
        self.elastic = (
            ElasticMembership(
                settings.elastic, settings.store, settings.sync_timeout * settings.devices_in_turn + GROUP_TIMEOUT_MARGIN_S,
                settings.devices[0].torch_device,
            )
            if settings.elastic is not None
            else None
        )
        """The elastic run this session belongs to: the core runs each of its generations in turn."""
        self._generations = 0
        """How many generations the core has opened."""
        self._replaced = anyio.Event()
        """Set when the core opens its next generation, or the session ends."""
        self._change_error: BaseException | None = None
        # (epoch, batches) of a fit's data consumed through each step, noted before the step runs (on whichever
        # generation runs it): a loss can leave the last consistent state a step past what the fit saw applied.
        self._data_positions: dict[int, tuple[int, int]] = {}
        self._marked = 0
        _OPEN.add(self)

    async def run(self) -> None:
        """The session's whole life. Raises nothing but a cancellation of this task: the handle reports the rest."""
        core: SessionCore | None = None
        raised: BaseException | None = None
        try:
            with self._scope, ExitStack() as stack:
                elastic = self.elastic
                start = None if self._resume is None else HeldState.of(self._resume)
                replay: bool | None = None
                agreed = False
                undo = self.watch_for_departure()
                stack.callback(undo)
                if elastic is not None:
                    # Entering blocks in a rendezvous (or waits to be taken in): in a thread, left on the abort flag.
                    with _aborting(elastic.abort):
                        _generation, start, handed_over = await anyio.to_thread.run_sync(elastic.enter, self._resume, abandon_on_cancel=True)
                    replay = handed_over or self._resume is not None
                    agreed = handed_over
                core = SessionCore(
                    self._settings, self._model, self._recipe, None if start is None else start.checkpoint(),
                    self._process_local_data, replay=replay, elastic=elastic, on_idle_failure=self._failed_while_idle,
                    agreed_start=agreed,
                )
                while True:
                    following = await self._serve_generation(core, start)
                    if following is None or self.closing:
                        break  # ended, or closed while its membership changed: the new generation's peers go on
                    # Every member of the next generation holds the state it starts from: the one agreed on.
                    start = following.state
                    try:
                        core.next_generation(start, agreed_start=start is not None)
                    except BaseException as error:
                        # What a call waiting for the next generation raises (a checkpoint of the state that
                        # could not be copied, say), rather than the loss that began the change.
                        self._change_error = error
                        raise
        except BaseException as error:  # noqa: BLE001 - kept for the handle, which raises it
            raised = error
            ended = self.core
            if ended is None:
                self._open_error = error
            elif error is not self._end_with and error is not ended.failure and error is not ended.undelivered:
                if not is_cancellation(error):
                    self._close_error = error
            if is_cancellation(error):
                if self.held and not self.closing and ended is not None:
                    warnings.warn(
                        f"the session opened at {self.opened_at} was still open when its task was cancelled (did "
                        "the event loop end?); it is closed, and its model is left as it was: `await "
                        "session.aclose()` when you are done",
                        SessionLeftOpenWarning,
                        stacklevel=1,
                    )
                raise
        finally:
            self.closing = True
            if core is not None:
                core.ended()
                if core.traced:
                    # Once for the session's whole life: marks how it ended, writes Engine(trace=path)'s file, ends
                    # the message of what it raises with the file's path.
                    await finish_trace(
                        core.trace, self._settings.trace_file, raised, core.life.cancellation or core.failure,
                        per_rank=self.elastic is not None,
                    )
            self._opened.set()
            self._replaced.set()
            self.done.set()

    async def _serve_generation(self, core: SessionCore, start: HeldState | None) -> _NextGeneration | None:
        """Run ``core``'s current generation until it ends; for an elastic run whose membership must change, the
        next one's start.

        ``start``: the state the generation starts from (``core`` goes on with the replicas themselves when it
        holds them: a survivor's, after a change).
        """
        elastic = self.elastic
        opened = False
        try:
            async with run_generation(core):
                opened = True
                if self._scope.cancel_called:
                    # Closed while it opened, and the start had nothing left to await: it ends here, as a
                    # failed block would (the model is not written), and the opener says so.
                    raise SessionClosed("the session was closed (aclose, or a cancellation of its task) while it opened")
                self.core = core
                if self.closing:
                    # Closed while this generation started (the close asked the last one to end): this one ends
                    # at once too, instead of serving a session nobody will call again.
                    core.request_end()
                if elastic is not None:
                    self._mark_changes(core, elastic)
                core.generation_open()
                self._generations += 1
                self._opened.set()
                replaced, self._replaced = self._replaced, anyio.Event()
                replaced.set()
                await core.end_requested.wait()
                planned = core.change is Change.PLANNED
                if not planned and not self._lost(core.failure):
                    self.closing = True
                elif not self.closing and not planned:
                    core.lost_generation()  # calls from now on wait for the next generation
                if self._end_with is not None:
                    raise self._end_with  # the session ends as the block of a failed `async with` would
        except BaseException as error:
            if elastic is None or self.closing or not self._lost(error):
                raise
            core.lost_generation()
            # A generation that failed to open took no forward step: the replicas it took are as they were.
            mine = core.hold(self._with_data_position) if opened else None if start is None else start.put_back()
        else:
            if elastic is None or self.closing:
                if elastic is not None:
                    await anyio.to_thread.run_sync(elastic.finish)
                return None
            mine = core.hold(self._with_data_position)
        # A change every rank agreed on in the last step's agreement: peers still finishing that step finish it.
        planned_after = None if core.change is not Change.PLANNED or mine is None else mine.step
        if mine is None and (opened or start is not None):
            raise SessionClosed("the elastic session lost its state while its membership changed")
        # ``mine`` None: a member lost while the first session opened, before any step; it starts over.
        try:
            if elastic.leaving:
                # SIGTERM came, and another member began the change first: this rank leaves in it.
                with _aborting(elastic.abort):
                    await anyio.to_thread.run_sync(elastic.leave, abandon_on_cancel=True)
                raise _departed(elastic, None if mine is None else mine.checkpoint())
            with _aborting(elastic.abort):
                _generation, state = await anyio.to_thread.run_sync(
                    partial(elastic.change, mine, planned_after=planned_after), abandon_on_cancel=True
                )
        except BaseException as error:
            self._change_error = error
            self.closing = True
            raise
        return _NextGeneration(state)

    async def _depart(self, core: SessionCore) -> None:
        """Leave the run after the step every rank agreed on, close normally, and raise :class:`~gsync.Departed`.

        The others go on as soon as this rank has left: its checkpoint is copied afterwards, from its replicas.
        """
        elastic = _elastic(self.elastic)
        with _aborting(elastic.abort):
            await anyio.to_thread.run_sync(elastic.leave, core.next_step - 1, abandon_on_cancel=True)
        self.closing = True
        core.request_end()
        await self.wait_done()
        held = core.hold(self._with_data_position)
        raise _departed(elastic, None if held is None else await anyio.to_thread.run_sync(held.checkpoint))

    def watch_for_departure(self) -> Callable[[], None]:
        """On the main thread: SIGTERM makes this rank depart at the next step boundary. Returns the undo."""
        if self.elastic is None:
            return lambda: None
        return on_sigterm_depart(self.elastic, lambda: None if self.core is None else self.core.runtime)

    def _mark_changes(self, core: SessionCore, elastic: ElasticMembership) -> None:
        """Mark the changes that led to this generation on its trace (an instant on the steps' track)."""
        trace = core.trace
        for change in elastic.changes[self._marked :]:
            if trace is not None:
                now = trace.now_us()
                trace.record(TraceEvent("membership", change.step, MARK_TRACK, -1, now, now, error=change.reason, message=str(change)))
        self._marked = len(elastic.changes)

    def _lost(self, error: BaseException | None) -> bool:
        return self.elastic is not None and error is not None and recoverable(error)

    # -- what the handle asks of it ---------------------------------------------------

    @property
    def serving(self) -> SessionCore:
        """The session's core (one for its whole life; :class:`~gsync.SessionClosed` before it opened)."""
        return _opened_core(self.core)

    async def serving_core(self) -> SessionCore:
        """The core, once it runs a generation a call can use.

        A change every rank agreed on after the last step (someone knocked,
        or leaves) is made here, before the next call; a change after a loss
        is already under way. Either is waited for, until the core runs the
        next generation.

        :raises: what ended the run instead (below ``min_world_size``, a rank
            left out, the store gone), with this rank's checkpoint.
        """
        core = self.serving
        if self.elastic is None:
            return core
        # Made between calls: with a call of another task in flight, that call's own refusal is what this one meets.
        if core.change_due and core.state is SessionState.IDLE and core.failure is None and not self.closing:
            if self.elastic.leaving:
                await self._depart(core)
            else:
                # Nothing is copied: the next generation goes on with this one's replicas (SessionCore.hold).
                core.end_for_change()
        elif not core.changing and not (core.failure is not None and self._lost(core.failure)):
            return core
        seen = self._generations
        while self._generations == seen and not self.done.is_set():
            await self._replaced.wait()
        if self._generations == seen:
            raise self._change_error or core.failure or SessionClosed("the session closed while its membership changed")
        return core

    def note_data_position(self, step: int, position: tuple[int, int]) -> None:
        """Before a fit runs step ``step``: its data, ``(epoch, batches)``, is consumed through it once applied."""
        self._data_positions = {at: where for at, where in self._data_positions.items() if at >= step - 1}
        self._data_positions[step] = position

    def _with_data_position(self, checkpoint: Checkpoint) -> Checkpoint:
        """``checkpoint`` with the fit's data position of its own step, when a fit noted one (for a joiner)."""
        position = self._data_positions.get(checkpoint.step)
        return checkpoint if position is None else replace(checkpoint, data_position=position)

    def membership_changes(self) -> tuple[MembershipChange, ...]:
        """The elastic run's membership changes so far (none outside an elastic run)."""
        return () if self.elastic is None else tuple(self.elastic.changes)

    async def carried(self, operation: Operation[Any, _T]) -> _T:
        """Run ``operation`` (an evaluation or all_reduce) on the serving core; in an elastic run, redone over the next
        membership if one interrupts it (every survivor redoes it: the ranks' n-th operations still meet), unless
        it is not :attr:`~Operation.redoable` (an evaluation over a one-shot iterator, whose batches are gone: the
        interruption is raised once the change is made). A survivor whose peer completed it before the change
        takes that peer's result instead, redoable or not (see :mod:`~gsync._core.elastic.carry`).
        """
        core = await self.serving_core()
        elastic = self.elastic
        if elastic is None:
            return operation.delivered(await core.run(operation))
        log = elastic.operations
        interrupted: GsyncError | None = None
        while True:
            after = core.next_step - 1
            handed, result = log.take(after, operation.kind)
            if not handed:
                if interrupted is not None:
                    raise interrupted  # not to be redone, and no peer completed it
                try:
                    result = await core.run(operation)
                except GsyncError as error:
                    if not recoverable(error):
                        raise
                    if not operation.redoable:
                        interrupted = error
                    core = await self.serving_core()
                    continue
            log.completed(after, operation.kind, result)
            return operation.delivered(result)

    async def step(
        self,
        batches: Sequence[Any],
        last: bool,
        on_change: Callable[[MembershipChange], Awaitable[None]] | None = None,
        expected: int | None = None,
        joining: bool | None = None,
    ) -> StepResult | None:
        """Step ``expected`` (default: the next one); in an elastic run, carried across membership changes.
        ``joining``: see :meth:`SessionCore.step`.

        After a change the step is redone over the next generation, unless
        that generation starts past it (a member that applied it handed its
        state over, or this rank was taken back in later): then ``None``.
        """
        elastic = self.elastic
        core = self.serving
        if elastic is None:
            return await core.step(batches, last=last, joining=joining)
        changes = len(elastic.changes)
        since = core.last_applied_at
        step = core.next_step if expected is None else expected
        while True:
            core = await self.serving_core()
            for change in elastic.changes[changes:]:
                changes += 1
                if on_change is not None:
                    await on_change(change)
            if core.next_step > step:
                return None
            try:
                result = await core.step(batches, last=last, joining=joining)
            except GsyncError as error:
                if not recoverable(error):
                    raise
                if since is None:
                    since = core.last_applied_at
                continue
            if since is not None and elastic.changes and elastic.changes[-1].step == result.step:
                elastic.applied(result.step, time.monotonic() - since)
            return result

    @contextmanager
    def fit_running(self) -> Iterator[anyio.CancelScope]:
        """Around a ``session.fit``: the scope a close from another task cancels; another fit meanwhile is refused.

        :raises ~gsync.ConfigError: while another task's fit of this session runs.
        """
        if self._fit_scope is not None and not self.closing:
            raise ConfigError("fit() while another task's fit of this session runs: await it before the next call")
        scope = self._fit_scope = anyio.CancelScope()
        self._fit_task = anyio.get_current_task().id
        try:
            with scope:
                yield scope
        finally:
            self._fit_scope = None
            self._fit_task = None

    def fit_runs_elsewhere(self) -> bool:
        """Another task's fit runs (its callbacks may call the session; other tasks may not), and no close began."""
        return self._fit_scope is not None and self._fit_task != anyio.get_current_task().id and not self.closing

    def on_idle_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once a failure that no call waits for is settled (the scoped form cancels its block)."""
        self._on_idle_failure = callback

    def _failed_while_idle(self) -> None:
        if self._on_idle_failure is not None:
            self._on_idle_failure()

    def block_was_interrupted(self) -> None:
        """The scoped form cancelled its block because of a failure while no call ran: its exit raises that failure."""
        self._block_interrupted = True

    def mark_closing(self) -> None:
        """A dropped handle: the session is closing from now on (the drop itself is made on the loop's next turn)."""
        self.closing = True

    async def wait_open(self) -> SessionCore:
        """Wait until the session serves, and return its core.

        :raises: what opening raised (a bad argument found while building, a
            peer's failure, a cancellation of this call: the start is abandoned
            and everything it started stopped first).
        """
        try:
            await self._opened.wait()
        except BaseException:
            self._scope.cancel()
            await self.wait_done()
            raise
        if self._open_error is not None:
            error, self._open_error = self._open_error, None
            raise error
        if self.core is None:  # the start was abandoned: a close while it opened, or a cancellation of its task
            raise SessionClosed("the session was closed (aclose, or a cancellation of its task) while it opened")
        return self.core

    async def close(self, error: BaseException | None = None, *, busy_reason: str = "aclose() was called") -> None:
        """End the session and wait until everything it started has stopped; idempotent.

        Without ``error`` the session ends normally (the model passed in gets
        the trained weights, unless the session had failed); with one, it ends
        as a block that raised ``error`` does (peers told, the model left as it
        was). An operation still running is ended first with
        :class:`~gsync.SessionClosed`. Shielded: a close that has begun finishes.

        :raises: a failure that nothing has raised yet (one settled while no
            call ran), unless ``error`` is given: then that failure is logged,
            since the caller's own exception is what propagates.
        """
        core = self.core
        quiet = error is not None
        if error is not None and is_cancellation(error) and self._block_interrupted:
            # The scoped block's own interrupt (a failure while it did something else): the block's exit
            # raises that failure, so it is neither a cancellation to report nor a failure to log here.
            await self.wait_done()
            return
        if core is None and not self.done.is_set():
            self.closing = True
            self._scope.cancel()  # still opening: the open is abandoned, and the opener says so
        elif core is not None and not self.done.is_set():
            if error is not None and is_cancellation(error):
                core.cancelled(error)  # closed as failed; peers hear of a cancellation, not of a departure
                error = None
            reason = f"{busy_reason} while another task's call of this session ran"
            if core.state is SessionState.OPERATING:
                core.close_operation(reason)
            if self._fit_scope is not None and self._fit_task != anyio.get_current_task().id:
                core.close_operation(reason)  # a failure, so the fit's model is not written back either
                self._fit_scope.cancel()
            if self._end_with is None and not self.closing:
                # The first close decides how the session ends: a call refused by a session already closing
                # (cleanly, by another task's aclose) does not make that close a failed one.
                self._end_with = error
            self.closing = True
            core.request_end()
        await self.wait_done()
        pending = self.take_pending()
        if pending is None:
            return
        if quiet:
            logger.warning("gsync: the session had failed before it closed: %s: %s", type(pending).__name__, pending)
            return
        raise pending

    async def wait_done(self) -> None:
        """Until the session has stopped everything it started, though the caller is cancelled meanwhile.

        A shield keeps anyio's cancellations out, but on asyncio a task that
        awaits another task (a notebook cell's, a test's ``create_task``)
        cancels it natively, once per attempt of its own cancellation: such
        a cancellation is held until the session is down, then re-raised.
        """
        cancelled: BaseException | None = None
        while not self.done.is_set():
            try:
                with anyio.CancelScope(shield=True):
                    await self.done.wait()
            except anyio.get_cancelled_exc_class() as error:
                cancelled = error
        if cancelled is not None:
            raise cancelled

    def threads(self) -> list[threading.Thread]:
        """The threads this session runs for its whole life (each started by its first job)."""
        core = self.core
        return [] if core is None or self.done.is_set() else core.threads()

    def take_pending(self) -> BaseException | None:
        """The error nothing has raised yet (a failure settled between calls, or one of the close itself), once."""
        core = self.core
        undelivered = None if core is None else core.take_undelivered()
        if undelivered is not None:
            return undelivered
        pending, self._close_error = self._close_error, None
        return pending

    def drop(self, why: str) -> None:
        """From the loop: end a session nobody holds any more, as a failed block would (the model is not written)."""
        core = self.core
        if core is None or self.done.is_set():
            return
        if self._end_with is None:
            self._end_with = SessionClosed(why)
        self.closing = True
        core.request_end()

    def log_if_pending(self) -> None:
        """Once a dropped session has closed: a failure nobody will ever raise is logged instead."""
        pending = self.take_pending()
        if pending is not None:
            logger.warning(
                "gsync: the session opened at %s failed, and was dropped before any call raised it: %s: %s",
                self.opened_at, type(pending).__name__, pending,
            )


@dataclass(frozen=True)
class _NextGeneration:
    state: HeldState | None
    """The state the next generation starts from; ``None``: the initial one (no member had applied a step)."""


def _opened_core(core: SessionCore | None) -> SessionCore:
    if core is None:
        raise SessionClosed("the session is not open")
    return core


@contextmanager
def _aborting(abort: threading.Event) -> Iterator[None]:
    """A thread's rendezvous or wait leaves on ``abort``, set when the waiting task is cancelled (a close)."""
    try:
        yield
    except BaseException:
        abort.set()
        raise


def _elastic(membership: ElasticMembership | None) -> ElasticMembership:
    if membership is None:
        raise RuntimeError("this session is not elastic")
    return membership
