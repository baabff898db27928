"""gsync's pytest plugin: engines on virtual CPU devices, fault injection, and a leak check, for your own tests.

Installed with gsync (a ``pytest11`` entry point, so pytest loads it by
itself; ``-p no:gsync_pytest`` turns it off). It imports neither torch nor
gsync until a test uses one of its fixtures, so in an environment where
gsync is installed but a test suite does not use it, all it adds is a check
per test that finds nothing. The ``testing`` extra (``pip install
"gsync[testing]"``) brings pytest, pytest-asyncio and pytest-timeout, which
the examples below assume.

Fixtures:

- ``gsync_engine``: a :class:`gsync.Engine` on 2 virtual CPU devices. Mark the
  test ``@pytest.mark.gsync_engine(devices=4, sync_timeout=5.0)`` for other
  devices or engine settings, or parametrize it indirectly
  (``@pytest.mark.parametrize("gsync_engine", [1, 2, 4], indirect=True)``:
  a device count, or a dict of ``Engine`` arguments).
- ``gsync_engine_factory``: ``make(devices=2, **engine_kwargs)`` builds more
  engines (``devices`` a count of virtual CPU devices or a list of device strings).
- ``gsync_faults``: :mod:`gsync.testing`'s fault injection, armed on
  ``gsync_engine`` (or ``engine=`` another) until the test ends:
  ``gsync_faults.fail(device=1, step=3, site="backward")``,
  ``gsync_faults.stall(...)``. At teardown every fault is disarmed and every
  stall released.

A session a fixture holds, for several tests (either shape; with
``loop_scope="module"`` on the fixture and the tests, one session for the
module)::

    @pytest_asyncio.fixture
    async def session(gsync_engine):
        session = await gsync_engine.session(make_model(), optimizer=..., loss_fn=...)
        yield session
        await session.aclose()          # or: async with gsync_engine.session(...) as session: yield session

The leak check: a test that passes but leaves a gsync worker thread (named
``gsync-*``) or an asyncio task running gsync code behind fails, naming each
thread and task. A session a fixture opened before the test (and closes in
its teardown) is not the test's: its task and threads are left out. It runs when the test's own code has returned, inside the
test's event loop for a pytest-asyncio test (so a task that was never awaited
is seen before the loop's teardown cancels it), after a grace period
(``gsync_leak_grace``, 1 s) that lets a fit that was cancelled finish
stopping; tasks still left then are cancelled, and awaited, so the next
test starts clean. Threads and tasks there before the test are not blamed on it;
with other async test runners (anyio's plugin) only threads are checked.
Opt a test out with ``@pytest.mark.gsync_allow_leaks``, or every test with
``gsync_leak_check = false`` in the pytest configuration.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from gsync import Engine
    from gsync.testing import Fault, Site

__all__ = ("Faults", "gsync_tasks", "gsync_threads")

_DEFAULT_DEVICES = 2
# How long the leak check waits for the tasks it cancelled to end.
_CANCEL_WAIT_S = 10.0
_THREAD_PREFIX = "gsync"


def gsync_threads() -> list[str]:
    """The names of gsync's live threads (every thread gsync starts is named ``gsync-...``)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(_THREAD_PREFIX) and t.is_alive()]


def gsync_tasks(loop: asyncio.AbstractEventLoop | None = None) -> list[str]:
    """A description of each unfinished asyncio task of ``loop`` (default: the running one) that runs gsync code.

    A task runs gsync code when its coroutine, or one it awaits, is defined in
    the gsync package: a fit or session left running, or one of their actors.
    The calling task is left out.
    """
    return [description for _, description in _gsync_tasks(loop)]


def _gsync_tasks(loop: asyncio.AbstractEventLoop | None = None) -> list[tuple[asyncio.Task[Any], str]]:
    package = _gsync_directory()
    if package is None:
        return []  # gsync was never imported: none of its code can be running
    loop = loop or asyncio.get_running_loop()
    current = asyncio.current_task(loop) if loop.is_running() else None
    found = []
    for task in asyncio.all_tasks(loop):
        if task is current or task.done():
            continue
        where = _gsync_code_awaited_by(task.get_coro(), package)
        if where is not None:
            found.append((task, f"task {task.get_name()!r} in {where}"))
    return found


def _gsync_directory() -> str | None:
    module = sys.modules.get("gsync")
    path = getattr(module, "__file__", None)
    return None if path is None else os.path.dirname(os.path.abspath(path)) + os.sep


def _gsync_code_awaited_by(coro: object, package: str) -> str | None:
    """``Qualname (gsync/file.py:line)`` of the outermost gsync coroutine in ``coro``'s await chain, if any."""
    seen = 0
    while coro is not None and seen < 100:
        seen += 1
        code = getattr(coro, "cr_code", None) or getattr(coro, "ag_code", None) or getattr(coro, "gi_code", None)
        # gsync.errors' wrapper of the public coroutines only forwards (it trims a user's error): the call it
        # awaits (Engine.fit, ...) is what the task is in.
        forwarding = code is not None and code.co_qualname == "_raised_at_caller.<locals>.call_async"
        if code is not None and not forwarding and os.path.abspath(code.co_filename).startswith(package):
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
            line = frame.f_lineno if frame is not None else code.co_firstlineno
            where = os.path.relpath(code.co_filename, os.path.dirname(package.rstrip(os.sep)))
            return f"{code.co_qualname} ({where}:{line})"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return None


# -- configuration ---------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "gsync_leak_check",
        "fail a test that leaves a gsync thread or task running (gsync's plugin)",
        type="bool",
        default=True,
    )
    parser.addini(
        "gsync_leak_grace",
        "seconds the gsync leak check waits for gsync threads and tasks to end after a test",
        default="1.0",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gsync_engine(devices=2, **engine_kwargs): the gsync_engine fixture's virtual CPU devices (a count or a "
        "list of device strings) and gsync.Engine arguments",
    )
    config.addinivalue_line("markers", "gsync_allow_leaks: skip gsync's check for threads and tasks left running")


# -- the leak check ----------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    config = item.config
    if not config.getini("gsync_leak_check") or item.get_closest_marker("gsync_allow_leaks") is not None:
        return (yield)
    grace = float(config.getini("gsync_leak_grace"))
    # A session a fixture holds (opened before the test, closed after it) starts its threads as the test uses it.
    before = set(threading.enumerate()) | _threads_of_sessions_open_now()
    with ExitStack() as restore:
        checked_in_loop = _check_inside_the_loop(item, before, grace, restore)
        result = yield
    if not checked_in_loop:
        _fail_on_leaks(item, before, grace)
    return result


def _check_inside_the_loop(item: pytest.Item, before: set[threading.Thread], grace: float, restore: ExitStack) -> bool:
    """For a pytest-asyncio test, run the check at the end of the test's coroutine, while its loop still runs."""
    try:
        import pytest_asyncio
    except ImportError:
        return False
    is_async_test = getattr(pytest_asyncio, "is_async_test", None)
    if is_async_test is None or not is_async_test(item) or not isinstance(item, pytest.Function):
        return False
    test = item.obj
    if not inspect.iscoroutinefunction(test):
        return False  # e.g. a hypothesis test, whose coroutine pytest-asyncio finds elsewhere

    @functools.wraps(test)
    async def checked(*args: Any, **kwargs: Any) -> Any:
        tasks_before = asyncio.all_tasks()  # a loop shared by several tests may run tasks of earlier ones
        result = await test(*args, **kwargs)
        await _fail_on_leaks_async(item, before, tasks_before, grace)
        return result

    patch = restore.enter_context(pytest.MonkeyPatch.context())
    patch.setattr(item, "obj", checked)
    return True


def _threads_of_sessions_open_now() -> set[threading.Thread]:
    service = sys.modules.get("gsync._core.session.service")
    if service is None:
        return set()  # gsync was never imported: no session can be open
    return {thread for session in service.open_services() for thread in session.threads()}


def _new_threads(before: set[threading.Thread]) -> list[str]:
    return [
        f"thread {t.name!r}"
        for t in threading.enumerate()
        if t.name.startswith(_THREAD_PREFIX) and t.is_alive() and t not in before
    ]


def _leak_message(item: pytest.Item, leaks: list[str], grace: float, cancelled: bool = False) -> str:
    listed = "\n".join(f"  - {leak}" for leak in leaks)
    after = "\n(the check cancelled those tasks, and waited for them to end)" if cancelled else ""
    return (
        f"{item.nodeid} left gsync running ({grace:g} s after it returned):\n{listed}{after}\n"
        "Await every fit and session the test starts (a task that runs one: await it, or cancel it and await it), "
        "and set `fault.release` on a stall(interruptible=False) before the test returns. "
        "Mark the test @pytest.mark.gsync_allow_leaks to skip this check."
    )


def _fail_on_leaks(item: pytest.Item, before: set[threading.Thread], grace: float) -> None:
    deadline = time.monotonic() + grace
    while leaks := _new_threads(before):
        if time.monotonic() >= deadline:
            pytest.fail(_leak_message(item, leaks, grace), pytrace=False)
        time.sleep(0.01)


async def _fail_on_leaks_async(
    item: pytest.Item, before: set[threading.Thread], tasks_before: set[asyncio.Task[Any]], grace: float
) -> None:
    await asyncio.sleep(0)  # a task created just before the test returned takes its first step
    deadline = time.monotonic() + grace
    while leaks := _new_threads(before) + [where for task, where in _gsync_tasks() if task not in tasks_before]:
        if time.monotonic() >= deadline:
            # Cancel what was left and let it stop while the loop still runs: closing the loop under a fit that
            # is still running leaves coroutines never awaited and streams never closed, and their warnings land
            # on whichever test runs next.
            tasks = [task for task, _ in _gsync_tasks() if task not in tasks_before]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=_CANCEL_WAIT_S)
                for task in tasks:
                    if task.done() and not task.cancelled():
                        task.exception()  # retrieved: the leak is the failure to report
            pytest.fail(_leak_message(item, leaks, grace, cancelled=bool(tasks)), pytrace=False)
        await asyncio.sleep(0.01)


# -- fixtures --------------------------------------------------------------------


def _devices(devices: int | Sequence[str]) -> list[str]:
    if isinstance(devices, bool) or not isinstance(devices, (int, Sequence)) or isinstance(devices, str):
        raise TypeError(f"devices must be a number of virtual CPU devices or a list of device strings, got {devices!r}")
    if isinstance(devices, int):
        return [f"cpu:{index}" for index in range(devices)]
    return list(devices)


@pytest.fixture
def gsync_engine_factory() -> Callable[..., Engine]:
    """``make(devices=2, **engine_kwargs)``: a :class:`gsync.Engine` on ``devices`` virtual CPU devices (or listed devices)."""

    def make(devices: int | Sequence[str] = _DEFAULT_DEVICES, **engine_kwargs: Any) -> Engine:
        import gsync

        return gsync.Engine(_devices(devices), **engine_kwargs)

    return make


@pytest.fixture
def gsync_engine(request: pytest.FixtureRequest, gsync_engine_factory: Callable[..., Engine]) -> Engine:
    """A :class:`gsync.Engine` on 2 virtual CPU devices; ``@pytest.mark.gsync_engine(devices=N, **engine_kwargs)`` to change it.

    Parametrized indirectly, each parameter is a device count, a list of
    devices, or a dict of ``Engine`` arguments (``devices`` among them).
    """
    kwargs: dict[str, Any] = {}
    marker = request.node.get_closest_marker("gsync_engine")
    if marker is not None:
        if len(marker.args) > 1:
            raise TypeError("@pytest.mark.gsync_engine takes at most one positional argument, the devices")
        if marker.args:
            kwargs["devices"] = marker.args[0]
        kwargs.update(marker.kwargs)
    param = getattr(request, "param", None)
    if isinstance(param, dict):
        kwargs.update(param)
    elif param is not None:
        kwargs["devices"] = param
    return gsync_engine_factory(**kwargs)


class Faults:
    """:mod:`gsync.testing` faults armed on an engine for the rest of a test; the ``gsync_faults`` fixture."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._stack = ExitStack()
        self.armed: list[Fault] = []
        """Every fault armed so far, in order."""

    def fail(
        self, device: int | None, step: int, site: Site, error: BaseException | None = None, *, engine: Engine | None = None
    ) -> Fault:
        """Make ``device`` raise ``error`` (default :class:`gsync.testing.InjectedFault`) at ``site`` of ``step``.

        Armed on ``engine``, by default the ``gsync_engine`` fixture's, until the test ends.
        """
        from gsync import testing

        return self._arm(testing.fail(device, step, site, error), engine)

    def stall(
        self, device: int | None, step: int, site: Site, *, interruptible: bool = True, engine: Engine | None = None
    ) -> Fault:
        """Make ``device`` block at ``site`` of ``step`` (see :func:`gsync.testing.stall`); released when the test ends."""
        from gsync import testing

        return self._arm(testing.stall(device, step, site, interruptible=interruptible), engine)

    def _arm(self, fault: Fault, engine: Engine | None) -> Fault:
        from gsync import testing

        if engine is None:
            engine = self._request.getfixturevalue("gsync_engine")
        self._stack.enter_context(testing.inject(engine, fault))
        self.armed.append(fault)
        return fault

    def close(self) -> None:
        """Release every stall and disarm every fault."""
        for fault in self.armed:
            fault.release.set()
        self._stack.close()


@pytest.fixture
def gsync_faults(request: pytest.FixtureRequest) -> Iterator[Faults]:
    """Fault injection (:mod:`gsync.testing`) for this test: ``gsync_faults.fail(device=1, step=3, site="backward")``."""
    faults = Faults(request)
    try:
        yield faults
    finally:
        faults.close()

