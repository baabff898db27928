"""The user's loggers, each called behind a guard: one that raises is reported once and left out from then on.

A logger is anything shaped like Lightning's ``Logger``: ``log_metrics(metrics,
step)``, and if it has them ``log_hyperparams(params)`` and ``finalize(status)``.
A dashboard that breaks must not cost the training run it watches, so a call
that raises disables that logger (logged with its traceback) and nothing else.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import InputTypeError

__all__ = ("LoggerSet", "check_loggers")

logger = logging.getLogger("gsync")

_OPTIONAL = ("log_hyperparams", "finalize")


def check_loggers(loggers: object) -> list[Any]:
    """The loggers as a list; one logger alone is taken as a list of one.

    :raises ~gsync.InputTypeError: for anything without a callable ``log_metrics``, or with a coroutine method
        (loggers are called on the event loop, between steps, and must not block or be awaited).
    """
    if loggers is None:
        return []
    if callable(getattr(loggers, "log_metrics", None)):
        loggers = [loggers]
    if not isinstance(loggers, Iterable) or isinstance(loggers, (str, bytes, Mapping)):
        raise InputTypeError(f"loggers must be a list of logger objects, got {type(loggers).__name__}")
    checked = list(loggers)
    for each in checked:
        if not callable(getattr(each, "log_metrics", None)):
            raise InputTypeError(
                f"logger {each!r} has no log_metrics(metrics, step) method: a logger is shaped like Lightning's "
                "Logger (log_metrics, and optionally log_hyperparams and finalize)"
            )
        for name in ("log_metrics", *_OPTIONAL):
            method = getattr(each, name, None)
            if method is not None and not callable(method):
                raise InputTypeError(f"logger {each!r} has a {name} that is not callable")
            if inspect.iscoroutinefunction(method):
                raise InputTypeError(
                    f"logger {each!r} has an async {name}: gsync calls loggers synchronously, between steps"
                )
    return checked


class LoggerSet:
    """Loggers called in order; each that raises is reported on the ``gsync`` logger and disabled."""

    def __init__(self, loggers: list[Any]) -> None:
        self._live = list(loggers)

    def __bool__(self) -> bool:
        return bool(self._live)

    def call(self, hook: str, *args: Any) -> None:
        for each in list(self._live):
            method = getattr(each, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception:
                self._live.remove(each)
                logger.error(
                    "gsync: logger %r raised in %s and is disabled for the rest of this run (training goes on)",
                    each,
                    hook,
                    exc_info=True,
                )
