"""``fit``: one loop over a session, with the data reading, accumulation, callbacks and progress around it.

Every step goes through :meth:`gsync.Session.step`, so ``fit`` and a
user's own loop share one code path for the actors, the server and failures.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
import anyio.to_thread
import anyio.lowlevel
from torch import nn

from ...checkpoint import Checkpoint
from ..state.checkpointing import restore_checkpoint_rng
from ..state.checkpointing import BestSoFar, CheckpointWriter, read_best
from ...errors import CheckpointError, ConfigError, StopTraining
from ..data.feeder import BatchRead, EpochEnded, Feeder, FeedItem, ReadFailed, batches_per_epoch
from ..base.outcome import flatten, is_cancellation
from .fit_settings import FitLoopSettings, ValidationSettings
from .progress import Progress, progress_wanted
from ...result import Evaluation, FitResult, StepRecord
from ...result import StepResult

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream

    from ...elastic import MembershipChange
    from .core import SessionCore

__all__ = ("FitLoopSettings", "run_fit")

class MembershipCarry(Protocol):
    """What carries a fit across an elastic run's membership changes: the session's service."""

    @property
    def elastic(self) -> object | None:
        """The elastic run the session belongs to (``None`` outside one)."""

    async def step(
        self,
        batches: Sequence[Any],
        last: bool,
        on_change: Callable[[MembershipChange], Awaitable[None]] | None = None,
        expected: int | None = None,
        joining: bool | None = None,
    ) -> StepResult | None: ...

    def membership_changes(self) -> tuple[MembershipChange, ...]: ...

    def note_data_position(self, step: int, position: tuple[int, int]) -> None: ...


async def run_fit(
    session: object,
    core: SessionCore,
    data: Iterable[Any] | AsyncIterable[Any],
    settings: FitLoopSettings,
    result_model: nn.Module | None = None,
    carry: MembershipCarry | None = None,
) -> FitResult:
    """The loop of one fit over an open session; ``result_model``: the result's model (default ``session.model``).

    ``session`` is the public handle, which callbacks receive; the loop itself works on ``core`` (the same one
    across an elastic run's membership changes, which ``carry`` carries each step through).

    The caller closes the session if this raises (see :meth:`gsync.Session.fit`).
    """
    history: list[StepRecord] = []
    epochs, accumulate, checkpoints = settings.epochs, settings.accumulate, settings.checkpoints
    # The first fit of a resumed session continues the run its checkpoint came from: the data is replayed up to
    # it, and the generators restored there; any other fit trains on its data from the session's next step.
    resume = core.pending_replay
    if resume is not None:
        core.rewind_generators_for_replay()
    # One rank writes: the replicas of every rank hold the same state.
    writer = (
        CheckpointWriter(checkpoints.directory, checkpoints.every, checkpoints.keep, core.loop_handle())
        # An elastic run's rank 0 can change: every rank is ready to write, and the current rank 0 writes. A
        # sharded run's checkpoint gathers from every rank: each takes it when one is due, and rank 0 writes it.
        if checkpoints is not None
        and (core.rank == 0 or (carry is not None and carry.elastic is not None) or checkpoint_gathers(core))
        else None
    )
    joining = settings.uneven == "join" or (settings.uneven is None and core.joins)
    if joining and not core.process_local:
        raise ConfigError(
            "uneven='join' is for process-local data, where each rank's data may end at a different step: open the "
            "session with process_local_data=True"
        )
    loop = _FitLoop(session, core, settings.callbacks, accumulate, history, writer, resume, carry, joining)
    validation = settings.validation
    if validation is not None:
        loop.validation = validation
        if validation.best_metric is not None and checkpoints is not None:
            loop.best = read_best(checkpoints.directory, validation.best_metric, validation.best_mode, core.next_step)
    # The fit reports the changes from its first step on: one made as its session opened (a rank lost while the
    # launch met, or the change that took this process into a running run) is its own; one made before an
    # earlier `session.step` is not.
    changes_before = sum(change.step < core.next_step for change in carry.membership_changes()) if carry is not None else 0
    # Joined, the run's steps depend on the other ranks' data too.
    total = None if joining else _total_steps(data, epochs, accumulate)
    replayed = core.next_step if resume is not None else 0  # a resumed run's bar starts where its checkpoint is
    display = Progress(total, core.next_step, replayed) if progress_wanted(settings.progress, core.rank) else None
    loop.progress = display
    try:
        feeder = Feeder(
            data, epochs, core.loop_handle(), accumulate, resuming=resume is not None, first_step=core.next_step,
            empty_epochs=joining,
        )
        await loop.run(feeder)
        _check_trained(history, resume, epochs, accumulate)
        core = loop.core
        checkpoint = await _finish(loop, session, writer)
    except BaseException:
        if writer is not None:
            # The run's own error matters more than the last write's.
            with anyio.CancelScope(shield=True):
                await writer.abandon()
        raise
    finally:
        if display is not None:
            display.close()
    return FitResult(
        model=core.current_model() if result_model is None else result_model,
        losses=[record.loss for record in history],
        first_step=history[0].step,
        skipped_steps=[record.step for record in history if record.skipped],
        checkpoint=checkpoint,
        stats=core.stats,
        trace=core.trace,
        history=history,
        membership=carry.membership_changes()[changes_before:] if carry is not None else (),
        evaluations=loop.evaluations,
    )


def _check_trained(history: list[StepRecord], resume: Checkpoint | None, epochs: int, accumulate: int) -> None:
    if not history and resume is not None:
        raise ConfigError(
            f"resuming after step {resume.step} trained nothing: data has no batch past it in {epochs} "
            "epoch(s); epochs counts all epochs of the run, including those before the checkpoint"
        )
    if not history:
        # Data whose length is known is refused before any work (FitLoopSettings); this is data without one.
        raise ConfigError(
            f"no optimizer step ran: no epoch of data had the accumulate={accumulate} batches a step takes "
            "(an epoch's left-over batches are left out, not carried into the next); lower accumulate"
        )


async def _finish(loop: _FitLoop, session: object, writer: CheckpointWriter | None) -> Checkpoint:
    """The fit's last checkpoint, ``on_fit_end`` called, and the last file written: what a clean end does."""
    # Taken before on_fit_end, as a step's file is before the next step's callbacks: a run that resumes
    # from it continues as one that never stopped, which would not have called on_fit_end there.
    # Copying the state to the CPU takes as long as a step may: in a thread, off the event loop.
    core = loop.core
    # The fit ends with the model it returns validated, unless its last step just was (eval_every divides it).
    last = core.next_step - 1
    improved = False
    if loop.validation is not None and loop.evaluated_step != last:
        try:
            improved = await loop.evaluate(last)
        except StopTraining:
            improved = loop.best_at(last)  # training has ended anyway
    core = loop.core
    checkpoint = replace(await _capture(core), data_position=loop.position)
    best_checkpoint = checkpoint
    steps_before = core.next_step
    try:
        await loop.call("on_fit_end", session)
    except StopTraining:
        pass  # training has ended anyway
    if core.next_step != steps_before:  # on_fit_end stepped the session itself: its state is newer
        checkpoint = replace(await _capture(core), data_position=loop.position)
    if writer is not None:
        if loop.core.rank == 0:
            await writer.write(checkpoint)
            if improved and loop.best is not None and loop.best.step == last:
                # Taken before on_fit_end, as the newest file is: the best is the model its evaluation saw.
                await writer.write_best(best_checkpoint, loop.best)
        await writer.close()
    return checkpoint


def checkpoint_gathers(core: SessionCore) -> bool:
    """A ``shard_optimizer=True`` run across processes: each rank holds part of the optimizer state, and a
    checkpoint is a collective every rank takes at the same step (see :meth:`SessionCore.checkpoint`)."""
    return core.checkpoint_gathers


async def _capture(core: SessionCore) -> Checkpoint:
    """The session's checkpoint, its copy (and gather) in a thread off the event loop."""
    return await core.checkpoint_off_loop()


class _FitLoop:
    """Groups batches into steps, reads one step ahead (so the last step is known), runs callbacks."""

    def __init__(
        self,
        session: object,
        core: SessionCore,
        callbacks: Sequence[Any],
        accumulate: int,
        history: list[StepRecord],
        writer: CheckpointWriter | None = None,
        resume: Checkpoint | None = None,
        carry: MembershipCarry | None = None,
        joining: bool = False,
    ) -> None:
        self.session = session
        self.joining = joining
        """``uneven="join"``: a rank whose data ended steps on with empty shards until every rank's has."""
        self.core = core
        """The session's core (the same one across an elastic run's membership changes)."""
        self._carry = carry
        self.resume = resume
        self.position: tuple[int, int] | None = None
        """``(epoch, batches)`` of data consumed through the last step run (or replayed)."""
        self.writer = writer
        self.callbacks = list(callbacks)
        self.accumulate = accumulate
        self.history = history
        self.progress: Progress | None = None
        self._held: tuple[int, int, list[Any], tuple[int, int]] | None = None
        self._epochs_to_close: list[int] = []
        self._generators_to_restore = resume
        """The checkpoint whose random generators the run takes once its data is replayed (then ``None``)."""
        self.validation: ValidationSettings | None = None
        self.evaluations: list[Evaluation] = []
        self.evaluated_step: int | None = None
        """The step of the last evaluation, so the one at the end of the fit is not a second of the same model."""
        self.best: BestSoFar | None = None
        """With ``keep_best``: the best evaluation so far (a resumed run's starts as the run it continues left it)."""

    async def _step(self, step: int, batches: list[Any], last: bool) -> StepResult | None:
        """Step ``step``; ``None`` when an elastic run's new membership started past it (its state includes it)."""
        if self._carry is None:
            return await self.core.step(batches, last=last, joining=self.joining)

        async def changed(change: MembershipChange) -> None:
            await self.call("on_membership_change", self.session, change)

        return await self._carry.step(batches, last, changed, step, joining=self.joining)

    async def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                outcome = method(*args)
                if inspect.isawaitable(outcome):
                    await outcome

    async def run(self, feeder: Feeder) -> None:
        """Train on everything the feeder reads; a callback's ``StopTraining`` ends it early, without error."""
        send, receive = anyio.create_memory_object_stream[FeedItem](1)
        raised: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(feeder.run, send)
                async with receive:
                    try:
                        consume = self._consume_joined if self.joining else self._consume
                        await consume(_FeedItems(receive), feeder.next_epoch)
                    except StopTraining:
                        pass
                group.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            # The feeder never raises (it sends its failures), so this is the
            # loop's own error: raise it as itself, not in a group.
            raised = next((e for e in flatten(errors) if not is_cancellation(e)), errors)
        if raised is not None:
            raise raised

    async def _consume(self, items: AsyncIterable[FeedItem], next_epoch: Callable[[], None]) -> None:
        # Resuming, the data's steps count from 0 and those before the session's first are replayed; otherwise
        # the data's first step is the session's next.
        first_step = self.core.next_step
        index = 0 if self.resume is not None else first_step
        group: list[Any] = []
        in_epoch = 0
        async for item in items:
            match item:
                case BatchRead(epoch=epoch, batch=batch):
                    group.append(batch)
                    in_epoch += 1
                    if len(group) < self.accumulate:
                        continue
                    batches, group = group, []
                    step, index = index, index + 1
                    if step < first_step:
                        self.position = (epoch, in_epoch)
                        continue  # resuming: the checkpoint already includes this step
                    if step == first_step:
                        self._check_position()
                    await self._run_held(last=False)
                    self._held = (step, epoch, batches, (epoch, in_epoch))
                case EpochEnded(epoch=epoch, final=final):
                    in_epoch = 0
                    if group:
                        warnings.warn(
                            f"epoch {epoch} ended with {len(group)} batch(es) that do not fill a step of "
                            f"accumulate={self.accumulate}; they were left out",
                            UserWarning,
                            stacklevel=2,
                        )
                        group = []
                    if self._held is not None and self._held[1] == epoch:
                        self._epochs_to_close.append(epoch)
                    if not final:
                        # The epoch's last step and callbacks run before the next epoch is read (a step
                        # followed by another epoch is not the run's last, unless that epoch is too short).
                        await self._run_held(last=False)
                        if index == first_step:
                            # Resuming from the end of this epoch: the run it continues took its checkpoint
                            # here, before the next epoch's iter(data) (a DataLoader's draws a seed).
                            self._restore_generators()
                        next_epoch()
                case ReadFailed(error=error):
                    # The step already read still runs (it is not the last: the data did not end).
                    await self._run_held(last=False)
                    raise error
        await self._run_held(last=True)

    async def _consume_joined(self, items: AsyncIterable[FeedItem], next_epoch: Callable[[], None]) -> None:
        """``uneven="join"``: each rank's epoch ends with its data, the run's once every rank's has.

        Every rank starts each epoch at the same step, and steps together
        through it: with its own batches while it has them, then with empty
        shards (``step(None, ...)``) until a step finds no rank with a batch.
        A position is the run's ``(epoch, steps into it x accumulate)``, alike
        on every rank, so a resumed rank replays its own data up to it (all
        of it, when its data of that epoch ended before the checkpoint).
        """
        accumulate = self.accumulate
        resume = self.resume
        skip_epoch, skip_steps = -1, 0
        if resume is not None:
            if resume.data_position is None:
                raise ConfigError(
                    f"resuming after step {resume.step} with uneven='join' needs the checkpoint's data position, and "
                    "this checkpoint has none: resume from a checkpoint file fit(checkpoint_dir=...) wrote"
                )
            skip_epoch, skip_steps = resume.data_position[0], resume.data_position[1] // accumulate
        replaying = resume is not None
        group: list[Any] = []
        run_steps = 0  # the run's steps in this epoch so far
        async for item in items:
            match item:
                case BatchRead(epoch=epoch, batch=batch):
                    group.append(batch)
                    if len(group) < accumulate:
                        continue
                    batches, group = group, []
                    run_steps += 1
                    if replaying and (epoch < skip_epoch or (epoch == skip_epoch and run_steps <= skip_steps)):
                        self.position = (epoch, run_steps * accumulate)
                        continue  # the checkpoint already includes this step
                    replaying = False
                    await self._run_held(last=False)
                    self._held = (self.core.next_step, epoch, batches, (epoch, run_steps * accumulate))
                case EpochEnded(epoch=epoch, final=final):
                    if group:
                        warnings.warn(
                            f"epoch {epoch} ended with {len(group)} batch(es) that do not fill a step of "
                            f"accumulate={accumulate}; they were left out",
                            UserWarning,
                            stacklevel=2,
                        )
                        group = []
                    await self._run_held(last=False)
                    if replaying and epoch < skip_epoch:
                        run_steps = 0
                        if not final:
                            next_epoch()
                        continue
                    if replaying:
                        # This rank's data of the checkpoint's epoch ended before the checkpoint: it was joining.
                        replaying = False
                        run_steps = max(run_steps, skip_steps)
                        self._restore_generators()
                    while True:
                        self._held = (self.core.next_step, epoch, [None] * accumulate, (epoch, (run_steps + 1) * accumulate))
                        result = await self._run_held(last=False)
                        if result is not None and result.rows == 0:
                            break  # no rank has a batch left in this epoch
                        run_steps += 1
                    run_steps = 0
                    await self.call("on_epoch_end", self.session, epoch)
                    if not final:
                        next_epoch()
                case ReadFailed(error=error):
                    await self._run_held(last=False)
                    raise error

    async def _run_held(self, last: bool) -> StepResult | None:
        held, self._held = self._held, None
        result: StepResult | None = None
        due: Checkpoint | None = None
        best: Checkpoint | None = None
        evaluate_at: int | None = None
        if held is not None:
            step, epoch, batches, position = held
            if self.resume is not None and step == self.resume.next_step:
                self._restore_generators()
            if self._carry is not None:
                self._carry.note_data_position(step, position)
            result = await self._step(step, batches, last)
            if result is not None and result.rows == 0:
                return result  # joined, and no rank had a batch: nothing ran
            self.position = position
            if result is not None:
                self._record(result, epoch)
            # The fit's last step is evaluated here, before its epoch's on_epoch_end, as Lightning validates
            # before the epoch ends (a fit that ends otherwise, stopped or joined, is evaluated in _finish).
            # A step an elastic run's new membership started right after (result None) is evaluated too: its
            # peers evaluate there, and the session hands this rank their result if they completed it. One it
            # started further past is behind every peer: they evaluated there before this rank came back.
            if (
                self.validation is not None
                and (last or self.validation.due(step))
                and (result is not None or self.core.next_step - 1 == step)
            ):
                evaluate_at = step
            if (
                result is not None
                and self.writer is not None
                and (self.core.rank == 0 or checkpoint_gathers(self.core))
                and self.writer.due(result.step)
            ):
                # Copied between steps, in a thread (gathered from every rank when sharded across processes).
                due = replace(await _capture(self.core), data_position=position)
        try:
            if result is not None:
                await self.call("on_step_end", self.session, result)
            if evaluate_at is not None:
                # After on_step_end and before on_epoch_end, as Lightning and HF's Trainer validate; before the
                # step's file is written, whose generators are as the evaluation left them (what a resumed run
                # starts from).
                try:
                    await self.evaluate(evaluate_at)
                except StopTraining:
                    # Early stopping on this very evaluation: its file is still the best.
                    best = await self._best_checkpoint(evaluate_at, due)
                    raise
                best = await self._best_checkpoint(evaluate_at, due)
            closing, self._epochs_to_close = self._epochs_to_close, []
            for epoch in closing:
                await self.call("on_epoch_end", self.session, epoch)
        except StopTraining:
            await self._write(due, best, generators_now=True)
            raise
        except BaseException:
            # A callback raised, or the fit is being cancelled (a notebook interrupt during an evaluate in
            # on_step_end): the step is consistent and its file is still written, with the generators as the
            # step left them; what the callback raised (or the cancellation) is what propagates.
            with contextlib.suppress(CheckpointError):
                await self._write(due, best, generators_now=False)
            raise
        await self._write(due, best, generators_now=True)
        return result

    async def _best_checkpoint(self, step: int, due: Checkpoint | None) -> Checkpoint | None:
        """The checkpoint of ``step`` for ``best.pt`` when its evaluation is the best so far (and this rank writes)."""
        if self.writer is None or self.validation is None or self.validation.best_metric is None:
            return None
        improved = self.best_at(step)
        # Every rank takes part in a sharded run's gather; one that took its best so far from another best.json
        # than rank 0 (a directory not shared) must still meet rank 0's gather, so each evaluation takes one.
        if not checkpoint_gathers(self.core) and (not improved or self.core.rank != 0):
            return None
        taken = due if due is not None else replace(await _capture(self.core), data_position=self.position)
        return taken if improved else None

    def best_at(self, step: int) -> bool:
        """Whether the evaluation after ``step`` is the best so far (a resumed run's best from before is earlier)."""
        return self.best is not None and self.best.step == step

    async def evaluate(self, step: int) -> bool:
        """Validate the model as of ``step`` (every rank: it is a collective), record it and tell the callbacks;
        whether it is the best so far by ``keep_best``.

        Through the public ``session.evaluate``, so that an elastic run carries it across membership changes and
        the loggers get its ``eval/<name>`` once, as for an evaluate a callback calls.

        :raises ~gsync.ConfigError: when the evaluation has no ``keep_best`` metric (at the first one).
        """
        validation = self.validation
        if validation is None:
            raise RuntimeError("evaluate() on a fit without val_data")  # a bug in gsync: only called with validation
        session = cast(Any, self.session)
        metrics = await session.evaluate(validation.data, metric_fn=validation.metric_fn)
        self.evaluated_step = step
        improved = False
        metric = validation.best_metric
        if metric is not None:
            if metric not in metrics:
                raise ConfigError(
                    f"keep_best={metric!r}, but the evaluation after step {step} returned {sorted(metrics)}: "
                    "name one of those, or make val_metric_fn return it"
                )
            value = float(metrics[metric])
            if self.best is None or self.best.beaten_by(value):
                self.best = BestSoFar(metric, validation.best_mode, step, value, dict(metrics))
                improved = True
        evaluation = Evaluation(step, dict(metrics), best=improved)
        self.evaluations.append(evaluation)
        await self.call("on_evaluate", self.session, evaluation)
        return improved

    def _restore_generators(self) -> None:
        """Once the data before a checkpoint is replayed: from here on the run draws random numbers as the one it
        continues did."""
        checkpoint, self._generators_to_restore = self._generators_to_restore, None
        if checkpoint is not None:
            restore_checkpoint_rng(checkpoint)

    async def _write(self, due: Checkpoint | None, best: Checkpoint | None, generators_now: bool) -> None:
        """Write the checkpoint a step was due, copied as the step ended; ``generators_now``: with the random
        generators as they are now, once the step's callbacks have run.

        The next step starts from the generators as the step's callbacks
        leave them (a callback may draw from them: a sampled log line), so
        a run resumed from the file must too.
        """
        if self.writer is None or self.core.rank != 0 or (due is None and (best is None or self.best is None)):
            return  # rank 0 writes (every rank took a sharded run's checkpoint with it), and only what is due
        generators = self.core.generators() if generators_now else None

        def as_now(checkpoint: Checkpoint) -> Checkpoint:
            if generators is None or checkpoint.rng_state is None:
                return checkpoint
            return replace(checkpoint, rng_state=generators)

        # Shielded: a cancellation requested by a callback (or from outside) while the step's callbacks ran
        # must not cost that step's file; handing it over waits at most for the write before it.
        with anyio.CancelScope(shield=True):
            if due is not None:
                await self.writer.write(as_now(due))
            if best is not None and self.best is not None:
                await self.writer.write_best(as_now(best), self.best)

    def _check_position(self) -> None:
        """Before the first step after a checkpoint: the replayed data must end where the checkpoint's did."""
        resume = self.resume
        if resume is None or resume.data_position is None or self.position == resume.data_position:
            return
        saved_epoch, saved_batches = resume.data_position
        replayed = "no batch" if self.position is None else f"{self.position[1]} batch(es) of epoch {self.position[0]}"
        raise ConfigError(
            f"the data does not line up with the checkpoint: through step {resume.step} it had consumed "
            f"{saved_batches} batch(es) of epoch {saved_epoch}, but replaying the data given now consumes {replayed}; "
            "resume with the same data (same batches per epoch) and the same accumulate"
        )

    def _record(self, result: StepResult, epoch: int) -> None:
        self.history.append(
            StepRecord(
                result.step, epoch, result.loss, result.lr, result.rows, result.seconds, result.skipped,
                result.grad_norm, result.lrs,
            )
        )
        if self.progress is not None:
            self.progress.update(result.step, epoch, result.loss, result.lr, result.rows, result.seconds)


class _FeedItems:
    """The feeder's items, each one it has already read taken without a turn of the event loop.

    Iterating the stream itself would first yield to the loop on every item
    (anyio's checkpoint), and the steps run one after another: each such
    turn comes between one step's optimizer and the next step's forward,
    where every device waits. A cancellation already requested (a callback
    cancelling an enclosing scope) is still seen here, before the next step
    starts; waiting for an item not yet read yields, as before.
    """

    def __init__(self, items: MemoryObjectReceiveStream[FeedItem]) -> None:
        self._items = items

    def __aiter__(self) -> _FeedItems:
        return self

    async def __anext__(self) -> FeedItem:
        await anyio.lowlevel.checkpoint_if_cancelled()
        try:
            return self._items.receive_nowait()
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        try:
            return await self._items.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


def _total_steps(data: object, epochs: int, accumulate: int) -> int | None:
    per_epoch = batches_per_epoch(data)
    return None if per_epoch is None else per_epoch // accumulate * epochs
