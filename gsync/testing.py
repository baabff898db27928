"""Fault injection, so you can test your own training code's error paths.

Make a chosen device fail or stall at a chosen step and site, exactly where
gsync's own failure handling sees real faults::

    import gsync, gsync.testing

    engine = gsync.Engine(["cpu:0", "cpu:1"])
    with gsync.testing.inject(engine, gsync.testing.fail(device=1, step=3, site="backward")):
        with pytest.raises(gsync.WorkerFailed) as caught:
            await engine.fit(...)
    assert caught.value.device_index == 1 and caught.value.step == 3

Sites are the phases of a step: ``"data"`` (moving the shard to the device),
``"forward"`` (model and ``loss_fn``), ``"backward"``, ``"optimizer"``,
``"evaluate"`` (a device's part of ``session.evaluate``; its step is the
last step the device trained, -1 before the first), and ``"all_reduce"`` (the communication thread, before a bucket's reduction;
``device`` is ignored there). Each fault fires once, at its first match.

A fault applies to every fit and session of the engine while it is armed, a
session opened earlier (by a fixture, in an earlier notebook cell) included,
from its next step on.

Under pytest, gsync's plugin (``gsync_pytest``) arms them for one test:
``gsync_faults.fail(device=1, step=3, site="backward")`` on its ``gsync_engine``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from .engine import Engine

__all__ = ("Fault", "InjectedFault", "fail", "stall", "inject", "Site")

Site = Literal["data", "forward", "backward", "optimizer", "evaluate", "all_reduce"]
_SITES = ("data", "forward", "backward", "optimizer", "evaluate", "all_reduce")
_COMM_DEVICE = -1


class InjectedFault(RuntimeError):
    """The default exception a :func:`fail` fault raises."""


@dataclass
class Fault:
    """A fault :func:`fail` or :func:`stall` made: where it fires, and events to wait on or release it by."""

    device: int | None
    step: int
    site: Site
    error: BaseException | None = None
    stall: bool = False
    interruptible: bool = True
    reached: threading.Event = field(default_factory=threading.Event)
    """Set when the fault fires (from the worker thread)."""
    release: threading.Event = field(default_factory=threading.Event)
    """Set it to let a stall continue."""
    fired_at: float | None = None
    """``time.monotonic()`` when the fault fired."""
    _claim_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def _matches(self, device: int, step: int, site: str) -> bool:
        if self.reached.is_set() or step != self.step or site != self.site:
            return False
        return site == "all_reduce" or self.device is None or self.device == device

    def _claim(self, device: int, step: int, site: str) -> bool:
        """Whether this fault fires here; at most once, though devices' threads reach their sites together."""
        with self._claim_lock:
            if not self._matches(device, step, site):
                return False
            self.fired_at = time.monotonic()
            self.reached.set()
            return True

    def _fire(self, abort: threading.Event) -> None:
        """Raise or stall, as the fault says (once :meth:`_claim` said it fires)."""
        if not self.stall:
            raise self.error or InjectedFault(f"injected fault at device {self.device}, step {self.step}, {self.site}")
        if not self.interruptible:
            self.release.wait()
            return
        # Stop stalling when the fit ends (as a well-behaved stuck op would be
        # interrupted), or when released.
        while not (abort.is_set() or self.release.is_set()):
            abort.wait(0.01)


def _check(device: int | None, step: int, site: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (a step index), got {step!r}")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise TypeError(f"device must be an int (an index into the engine's devices) or None, got {device!r}")
    if site not in _SITES:
        raise ValueError(f"site must be one of {_SITES}, got {site!r}")
    if step < 0 and not (site == "evaluate" and step == -1):
        raise ValueError(f"step must be >= 0 (or -1 for an evaluate before the first step), got {step}")
    if device is not None and device < 0:
        raise ValueError(f"device must be a device index >= 0, got {device}")


def fail(device: int | None, step: int, site: Site, error: BaseException | None = None) -> Fault:
    """A fault that raises ``error`` (default :class:`InjectedFault`) on ``device`` when ``step`` reaches ``site``."""
    _check(device, step, site)
    return Fault(device, step, site, error=error)


def stall(device: int | None, step: int, site: Site, *, interruptible: bool = True) -> Fault:
    """A fault that blocks ``device`` at ``site`` of ``step``.

    On CPU devices that share one thread (``Engine(device_threads=...)``)
    the devices queued behind the stalled one wait too, as they would
    behind a real stall; reports still name only the stalled device.

    An interruptible stall ends when the fit ends (like an operation that
    honours cancellation) or when ``fault.release`` is set. A
    non-interruptible one ignores the fit and blocks until ``fault.release``
    is set, like native code that cannot be interrupted: set it before your
    test ends.
    """
    _check(device, step, site)
    return Fault(device, step, site, stall=True, interruptible=interruptible)


class _Injector:
    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = list(faults)

    def __call__(self, device: int, step: int, site: str, abort: threading.Event) -> None:
        for fault in self.faults:
            if fault._claim(device, step, site):
                fault._fire(abort)


def _check_not_past(engine: Engine, fault: Fault) -> None:
    service = engine._slot.service
    # The slot keeps the last session after it closed: only an open one has steps behind it that a fault misses.
    core = service.core if service is not None and not service.done.is_set() else None
    if service is None or core is None:
        return
    # An evaluate's step is the last step trained: the session is at next_step - 1 until its next step.
    reached = core.next_step - 1 if fault.site == "evaluate" else core.next_step
    if fault.step < reached:
        raise ValueError(
            f"the fault is for step {fault.step}, and the session open on this engine (opened at "
            f"{service.opened_at}) is past it, at step {reached}{' (its last step)' if fault.site == 'evaluate' else ''}: "
            f"it could never fire; arm it for step {reached} or later (steps count from the session's start)"
        )


@contextmanager
def inject(engine: Engine, *faults: Fault) -> Iterator[Sequence[Fault]]:
    """Arm ``faults`` on ``engine`` while the block runs: for its fits and sessions, the one open already included.

    A session opened earlier (by a fixture, in an earlier notebook cell)
    meets the faults from its next step on.

    :raises ValueError: for a fault that could never fire: on a device the engine does not have, or for a step
        that the session open on ``engine`` has already run.
    """
    for fault in faults:
        if fault.device is not None and fault.site != "all_reduce" and fault.device >= len(engine.devices):
            names = ", ".join(spec.name for spec in engine.devices)
            raise ValueError(
                f"the fault is for device {fault.device}, and this engine has {len(engine.devices)} ({names}): "
                "it could never fire; devices are indexed from 0 in the engine's order (this process's)"
            )
        _check_not_past(engine, fault)
    injector = _Injector(faults)
    hooks = engine._site_hooks
    hooks.append(injector)
    try:
        yield faults
    finally:
        hooks.remove(injector)
