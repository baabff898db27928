"""The thread that answers a membership change for its process, and hears of processes knocking.

A member busy in a long backward pass, or in its own code between steps,
would notice a failed peer only at its next collective: seconds on a real
model, and a membership change that waited that long for it would cost
every loss those seconds. So each member runs a ``gsync-elastic`` thread,
on its own store connection, that waits on the generation's ``reform`` key
and answers the moment it appears, then tells the session (which stops its
step: the step is redone in the next generation). Between waits it counts
knocks, so a process that wants to join is taken in at the next step boundary.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta


from .quorum import ElasticRun, Generation

__all__ = ("ReformWatcher",)

# A wait that times out is logged by TCPStore (two C++ warnings), so the watcher is woken through the store
# rather than by a timeout: each wait lasts until a key is set.
_WAIT = timedelta(hours=1)


class ReformWatcher:
    """Watches one generation: ``on_reform(planned_after)`` once a change is asked for (``planned_after``: the
    step whose agreement planned it, or ``None`` after a loss), ``on_knock()`` once someone knocks.

    It sleeps in a wait on its own key (``g<g>/wake/<rank>``), which whoever
    asks for a change, knocks, or stops this watcher sets after writing what
    the watcher should find; it deletes the key before it looks, so a wake
    that comes while it looks wakes it again.
    """

    def __init__(
        self, run: ElasticRun, generation: Generation, on_reform: Callable[[int | None], object], on_knock: Callable[[], object]
    ) -> None:
        self._run = run
        self._generation = generation
        self._on_reform = on_reform
        self._on_knock = on_knock
        self._stopping = threading.Event()
        self._wake_key = run.key(f"g{generation.number}", f"wake/{run.launch_rank}")
        self._thread = threading.Thread(target=self._watch, name="gsync-elastic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        run, number = self._run, self._generation.number
        try:
            store = run.store.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        except Exception:  # noqa: BLE001 - stores that cannot clone share the connection
            store = run.store
        reform = run.key(f"g{number}", "reform")
        planned = run.key(f"g{number}", "planned")
        knocks = run.key("knocks")
        seen = self._generation.decision.knocks_seen
        heard = 0  # every knock: one left waiting while the run is full hears it is alive
        knocked = False
        try:
            while not self._stopping.is_set():
                if store.check([reform]):
                    if not run.leaving:  # a departing rank says so itself, at the step boundary
                        store.set(run.key(f"g{number}", f"in/{run.launch_rank}"), "1")
                    planned_after = int(store.get(planned)) if store.check([planned]) else None
                    if planned_after is None:
                        # Before the session hears of it: what waits on an NCCL collective with a dead peer ends now.
                        self._generation.abort_collectives()
                    self._on_reform(planned_after)
                    return
                count = store.add(knocks, 0)
                for index in range(heard + 1, count + 1):
                    # The knocker learns that the run is alive (a knock nobody hears was made on a run that is over).
                    store.set(run.key(f"knock{index}", "heard"), "1")
                heard = max(heard, count)
                if not knocked and count > seen:
                    knocked = True
                    self._on_knock()
                store.wait([self._wake_key], _WAIT)
                store.delete_key(self._wake_key)
        except Exception:  # noqa: BLE001 - a store that is gone: the heartbeat and the collectives find out
            return

    def stop(self) -> None:
        """Stop watching: wakes the thread through the store (one write), without waiting for it (:meth:`join`)."""
        self._stopping.set()
        try:
            self._run.store.set(self._wake_key, "1")
        except Exception:  # noqa: BLE001 - a store that is gone has ended the wait already
            pass

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end (blocks: not on the event loop); whether it did."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()
