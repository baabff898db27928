"""The parts one session runs: its device actors, the sync server and its communication thread, built and stopped.

:class:`SessionWorkers` builds them from the replicas (:func:`~gsync._core.session.assembly.assemble`),
runs them as one anyio task group while the session serves, ends them
gracefully at the end of the data, and stops every thread on teardown,
leaving behind (named) a thread stuck in native code. It knows nothing of
why a session ends: the session's life decides that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio

from ...errors import GsyncError, SessionClosed
from ...trace import Trace
from ..state.replicas import Replica
from ..step.actor import DeviceActor
from ..step.context import Recipe
from ..step.messages import Close
from ..threads import THREAD_GRACE_S, LoopHandle, WorkerThread
from ..distributed.runtime import ProcessGroupRuntime
from ..gradients.buckets import BucketPlan
from ..settings import EngineSettings
from .assembly import Assembly, assemble

__all__ = ("SessionWorkers",)

logger = logging.getLogger("gsync")


class SessionWorkers:
    """The actors, the sync server and their threads, for one session."""

    def __init__(self, abort: threading.Event) -> None:
        self._abort = abort
        self._assembly: Assembly | None = None
        self._left_behind: list[str] | None = None
        """The threads the teardown left behind; ``None`` until it ran (it runs once)."""

    def build(
        self,
        settings: EngineSettings,
        recipe: Recipe,
        plan: BucketPlan,
        replicas: Sequence[Replica],
        runtime: ProcessGroupRuntime | None,
        loop: LoopHandle,
        process_local: bool,
        trace: Trace | None,
    ) -> Assembly:
        self._assembly = assemble(settings, recipe, plan, replicas, runtime, self._abort, loop, process_local, trace)
        return self._assembly

    @property
    def built(self) -> Assembly | None:
        """Every part, once built."""
        return self._assembly

    @property
    def parts(self) -> Assembly:
        """Every part (:class:`~gsync.SessionClosed` before they are built)."""
        if self._assembly is None:
            raise SessionClosed("the session is not open: use it inside `async with engine.session(...)`")
        return self._assembly

    @property
    def actors(self) -> list[DeviceActor]:
        """The local devices' actors (none before they are built)."""
        return [] if self._assembly is None else self._assembly.actors

    @property
    def left_behind(self) -> list[str]:
        """The threads that did not stop within their grace at teardown (daemons, stuck in native code)."""
        return list(self._left_behind or ())

    @property
    def torn_down(self) -> bool:
        return self._left_behind is not None

    async def serve(self, watch: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """Run the server and the actors (and ``watch``, the peers' news) until the data ends or one fails."""
        parts = self.parts
        async with anyio.create_task_group() as group:
            if watch is not None:
                group.start_soon(watch)
            async with anyio.create_task_group() as work:
                work.start_soon(parts.server.run)
                for actor in parts.actors:
                    work.start_soon(actor.run)
            group.cancel_scope.cancel()

    def end_of_data(self) -> None:
        """Actors finish what they hold, the server closes them, and serving returns."""
        for actor in self.actors:
            actor.shards.close()
        if self._assembly is not None:
            self._assembly.server_mailbox.try_post(Close("end of session"))

    def late_failures(self) -> list[GsyncError]:
        """Failures of devices (or the server) whose tasks were cancelled before they could raise them."""
        late = [actor.failure for actor in self.actors if actor.failure is not None]
        if self._assembly is not None and self._assembly.server.failure is not None:
            late.append(self._assembly.server.failure)
        return late

    async def teardown(self) -> None:
        """Stop every actor and thread (not the process group). Idempotent."""
        if self._left_behind is not None:
            return
        self._left_behind = []
        self._abort.set()
        parts = self._assembly
        actors = self.actors
        for actor in actors:
            actor.shards.discard()
        if parts is not None:
            parts.server_mailbox.discard()
        # The session mailbox stays open: a step waiting on it learns of a
        # failure only once the failure is settled.
        workers: list[WorkerThread] = []
        for actor in actors:
            actor.close()
            actor.mailbox.discard()
            if actor.worker not in workers:  # CPU devices may share one
                workers.append(actor.worker)
        if parts is not None:
            streams = parts.streams
            # The last job of the communication thread waits for every stream's queued
            # work (a host sync, so never on the event loop), before replica state is
            # read and bucket buffers are freed.
            parts.server.comm.submit(lambda: streams.close(timeout=THREAD_GRACE_S * 10), lambda outcome: None)
            parts.server.close()
            workers.append(parts.server.comm)
        deadline = time.monotonic() + THREAD_GRACE_S
        self._left_behind = [worker.name for worker in workers if not await worker.join(max(0.0, deadline - time.monotonic()))]
        if self._left_behind:
            where = ", ".join(f"{actor.name} ({actor.where})" for actor in actors if actor.worker.name in self._left_behind)
            logger.warning(
                "gsync: thread(s) %s did not stop within %.1f s and are left behind (daemon threads, stuck in %s); "
                "they end at their job's next phase boundary, or with the process",
                ", ".join(self._left_behind), THREAD_GRACE_S, where or "a collective",
            )
        if parts is not None:
            parts.collective.close()

    def threads(self) -> list[WorkerThread]:
        """The devices' threads and the communication thread."""
        workers = [actor.worker for actor in self.actors]
        if self._assembly is not None:
            workers.append(self._assembly.server.comm)
        return workers
