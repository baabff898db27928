"""Monitoring: a session's loggers and this process's counters (the public side: gsync.loggers, gsync.metrics,
gsync.report, FitResult.plot)."""

from .monitor import SessionMonitor, monitor_for, status_of

__all__ = ("SessionMonitor", "monitor_for", "status_of")
