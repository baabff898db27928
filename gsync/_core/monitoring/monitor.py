"""A session's monitor: each step it learns of, handed to the user's loggers and to this process's counters.

``fit`` drives it as its first callback (its ``on_step_end``, through the fit
loop's own callback mechanism), and a held session's ``step`` and ``evaluate``
call it directly; the session tells it how it ended. It never raises into
training: the loggers are guarded (:mod:`.dispatch`), the counters are sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InputTypeError
from ..base.outcome import is_cancellation
from .dispatch import LoggerSet, check_loggers
from .hyperparams import optimizer_hyperparams, run_hyperparams
from .process_metrics import PROCESS
from .step_metrics import CommMeter, step_metrics

__all__ = ("SessionMonitor", "monitor_for", "status_of")


def status_of(error: BaseException | None) -> str:
    """``"success"``, ``"cancelled"`` or ``"failed"``: how a run that raised ``error`` (or nothing) ended."""
    if error is None:
        return "success"
    return "cancelled" if is_cancellation(error) else "failed"


class SessionMonitor:
    """One session's loggers (called on rank 0, or on every rank with ``log_all_ranks``) and counters."""

    def __init__(
        self, loggers: Sequence[Any] = (), log_all_ranks: bool = False, hparams: dict[str, Any] | None = None
    ) -> None:
        self._loggers = LoggerSet(list(loggers))
        self._all_ranks = log_all_ranks
        self._hparams = hparams
        self._session: Any = None
        self._comm: CommMeter | None = None
        self._reduced = 0
        self._changes = 0
        self._status: str | None = None
        # The rank as of the last step: read once a step, and still known once a closed session's core is gone.
        self._rank = 0

    def _logging(self) -> bool:
        return bool(self._loggers) and (self._all_ranks or self._rank == 0)

    def opened(self, session: Any) -> None:
        """The session is open: its rank is known; the loggers get the run's hyperparameters."""
        self._session = session
        self._rank = session.rank
        trace = session.trace
        self._comm = CommMeter(trace) if trace is not None else None
        self._reduced = session.stats.reduced_bytes
        self._changes = len(session._service.membership_changes())
        PROCESS.opened(self._rank, session.world_size)
        if self._hparams is not None and self._logging():
            params = dict(self._hparams)
            params["world_size"] = session.world_size
            optimizers = session.optimizers
            if optimizers:
                params.update(optimizer_hyperparams(optimizers[0]))
            self._loggers.call("log_hyperparams", params)

    # -- what fit's loop calls: the monitor is its first callback -------------------------

    def on_step_end(self, session: Any, result: Any) -> None:
        self.stepped(result)

    # -- what the session calls ----------------------------------------------------------

    def stepped(self, result: Any) -> None:
        session = self._session
        if session is None or result.rows == 0:
            return  # a joined step no rank had a batch for trained nothing
        total = session.stats.reduced_bytes
        # A new membership's core counts from 0 again.
        reduced, self._reduced = (total - self._reduced if total >= self._reduced else total), total
        rank = self._rank = session.rank
        PROCESS.stepped(rank, result.seconds, reduced, result.loss, result.world_size)
        changes = len(session._service.membership_changes())
        if changes != self._changes:
            PROCESS.membership_changed(rank, changes - self._changes, result.world_size)
            self._changes = changes
        if not self._logging():
            return
        comm = self._comm.exposed_seconds(result.step) if self._comm is not None else None
        metrics = step_metrics(result, reduced, comm)
        if session._service.elastic is not None:
            metrics["membership_changes"] = float(self._changes)
        self._loggers.call("log_metrics", metrics, result.step)

    def evaluated(self, metrics: dict[str, float]) -> None:
        """``session.evaluate``'s result, as ``eval/<name>`` at the last step trained."""
        session = self._session
        if session is None or not self._logging():
            return
        step = max(session.next_step - 1, 0)
        self._loggers.call("log_metrics", {f"eval/{name}": float(value) for name, value in metrics.items()}, step)

    def ended(self, error: BaseException | None) -> None:
        """The session has ended (``error``: what ended it): ``finalize`` once, however often this is called."""
        if self._status is not None:
            return
        self._status = status_of(error)
        session = self._session
        if session is None:
            return  # it never opened: nothing was logged
        if self._status == "failed" and error is not None:
            PROCESS.failed(self._rank, type(error).__name__)
        if self._logging():
            self._loggers.call("finalize", self._status)


def monitor_for(
    engine: Any, model: Any, loggers: object, log_all_ranks: object, recipe: dict[str, Any],
    fit: dict[str, Any] | None = None,
) -> SessionMonitor:
    """The monitor of a session ``engine`` opens, its arguments checked before any work.

    :raises ~gsync.InputTypeError: for loggers that are not loggers, or a ``log_all_ranks`` that is not a bool.
    """
    checked = check_loggers(loggers)
    if not isinstance(log_all_ranks, bool):
        raise InputTypeError(f"log_all_ranks must be True or False, got {type(log_all_ranks).__name__}")
    hparams = run_hyperparams(engine, model, recipe, fit) if checked else None
    return SessionMonitor(checked, log_all_ranks, hparams)
