"""An elastic session's membership over its life: entering the run, and each change, as the service drives them.

The session's one core runs each generation on parts built over that
generation's group, started from the state the generation agreed on
(:mod:`~gsync._core.elastic.handover`); the session service moves the core
from one generation to the next
(:class:`~gsync._core.session.service.SessionService`). What
fails here fails as a run that is not elastic does: below
``min_world_size``, a store that is gone, a rank left out, each is a
:class:`~gsync.PeerLost` (or the error the quorum met) with the checkpoint
this rank holds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ...checkpoint import Checkpoint
from ...elastic import Elastic, MembershipChange
from ...errors import CheckpointError, ConfigError, LostRank, PeerLost
from ..distributed.membership import create_store, env_int
from .carry import OperationLog
from .handover import agree_state
from ..state.held import HeldState
from ..state.replicas import import_optimizer_machinery
from ..threads import FitAborted
from .quorum import Decision, ElasticRun, Generation, NotAMember, RunGone
from ..base.faults import connection_lost

__all__ = ("ElasticMembership",)

logger = logging.getLogger("gsync")


class ElasticMembership:
    """One process's view of the elastic run its sessions belong to. Its blocking methods run in a thread."""

    def __init__(self, settings: Elastic, store: dist.Store | None, group_timeout_s: float, device: torch.device | None = None) -> None:
        self.settings = settings
        self._device = device if device is not None and device.type == "cuda" else None
        for name in ("RANK", "WORLD_SIZE"):
            if os.environ.get(name, "") == "":
                raise ConfigError(
                    f"Engine(elastic=...) runs one process per rank, started by a launcher, and the environment "
                    f"variable {name} is not set (a plain `python` run?): launch with torchrun (e.g. torchrun "
                    "--nproc-per-node=2 train.py, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or drop "
                    "elastic= to train in this one process"
                )
        self.launch_rank = env_int("RANK")
        self.launch_world = env_int("WORLD_SIZE")
        if not 0 <= self.launch_rank:
            raise ConfigError(f"RANK={self.launch_rank} must be >= 0")
        self._given_store = store
        self._group_timeout = timedelta(seconds=group_timeout_s)
        self.run: ElasticRun | None = None
        self.changes: list[MembershipChange] = []
        """Every change of this process's membership, first first."""
        self.departed = False
        """This process left the run on purpose (SIGTERM)."""
        self.abort = threading.Event()
        """Set to leave a rendezvous or a wait for admission (the session is being closed)."""
        self.operations = OperationLog()
        """This process's evaluations and all_reduces since its last step: a change hands a member that must
        redo one the result the others hold (see :mod:`~gsync._core.elastic.carry`)."""

    @property
    def generation(self) -> Generation:
        run = self.run
        if run is None or run.current is None:
            raise RuntimeError("the elastic run has no membership yet")
        return run.current

    def enter(self, resume: Checkpoint | None) -> tuple[Generation, HeldState | None, bool]:
        """Start the run or join the running one; the state to start from, and whether it was handed over.

        :raises ~gsync.ConfigError: for a store that cannot be reached, or a run that does not take this rank in.
        """
        store = self._given_store
        if store is None:
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                logger.warning(
                    "gsync: elastic run on a store rank 0 hosts (MASTER_ADDR:MASTER_PORT): losing rank 0 ends the "
                    "run; host the store outside the ranks (torchrun's agent, or Engine(store=...)) so any rank may go"
                )
            store = create_store(self.launch_rank, self.launch_world, self._group_timeout)
        self.run = ElasticRun(store, self.launch_rank, self.launch_world, self.settings, self._group_timeout, self._device)
        # Made before knocking: a joiner taken in builds its replicas while the members wait for it.
        import_optimizer_machinery()
        generation = self.run.enter(self.abort)
        if generation.number == 0:
            return generation, None if resume is None else HeldState.of(resume), False
        state = agree_state(generation.host, None, self.abort, self.operations)
        self._record(generation.decision, 0 if state is None else state.next_step)
        return generation, state, state is not None

    def change(
        self, mine: HeldState | None, *, leaving: bool = False, planned_after: int | None = None
    ) -> tuple[Generation, HeldState | None]:
        """The next generation, formed, and the state it starts from; ``mine``: this rank's consistent state
        (returned itself when every member holds the same step: nothing copied).

        ``mine`` is ``None`` when no step was applied yet (a member lost while
        the first session opened): the next generation starts from the
        initial state, unless a member holds one.

        :raises ~gsync.PeerLost: below ``min_world_size``, when this rank was
            left out, or when the store is gone; with ``mine`` as its checkpoint.
        """
        run = self._run()
        while True:
            before = self.generation
            try:
                decision = run.reform(self.abort, leaving=leaving, planned_after=planned_after)
                planned_after = None  # changing again is after a loss
            except NotAMember as error:
                # Alive but too late to answer: taken back in as a process that knocks, at the next step boundary.
                logger.warning("gsync: %s; it knocks to be taken back in", error)
                try:
                    generation = run.rejoin(self.abort)
                except RunGone as gone:
                    raise self._lost(before, (), mine, f"it was left out, and could not be taken back in: {gone}") from gone
                state = self._agree_state(generation, mine)
                self._record(generation.decision, _first_step(state))
                return generation, state
            except FitAborted:
                raise
            except Exception as error:  # noqa: BLE001 - a store that is gone ends the run as it would without elastic
                raise self._lost(before, (), mine, f"the store could not be reached to agree on a new membership ({error})") from error
            if len(decision.members) < self.settings.min_world_size:
                raise self._lost(
                    before, decision.lost + decision.left, mine,
                    f"{len(decision.members)} rank(s) left, fewer than min_world_size={self.settings.min_world_size}",
                )
            decided = time.monotonic()
            try:
                generation = run.form(decision)
                formed = time.monotonic()
                state = self._agree_state(generation, mine)
            except (FitAborted, CheckpointError):
                raise
            except Exception as error:  # noqa: BLE001 - a member lost again while the group formed: change again
                logger.warning("gsync: rank %d: the new membership %s did not form (%s); changing again", self.launch_rank, list(decision.members), error)
                if run.current is None or run.current.number != decision.generation:
                    run.not_formed(decision)
                if connection_lost(error):
                    _quietly(lambda: run.note_peer_gone(decision.generation))
                continue
            logger.info(
                "gsync: rank %d: membership decided, group formed in %.3f s, state agreed in %.3f s",
                self.launch_rank, formed - decided, time.monotonic() - formed,
            )
            self._record(decision, _first_step(state))
            return generation, state

    def _agree_state(self, generation: Generation, mine: HeldState | None) -> HeldState | None:
        """The state ``generation`` starts from (see :func:`~gsync._core.elastic.handover.agree_state`).

        :raises ~gsync.CheckpointError: with ``mine`` as its checkpoint, when
            the state sent was refused: this rank cannot start the generation,
            and changing again would only be sent the same again.
        """
        try:
            return agree_state(generation.host, mine, self.abort, self.operations)
        except CheckpointError as refused:
            refused.checkpoint = None if mine is None else mine.checkpoint()
            refused.last_step = None if mine is None else mine.step
            raise

    @property
    def leaving(self) -> bool:
        return self.run is not None and self.run.leaving

    def depart_soon(self) -> None:
        """SIGTERM: leave at the next step boundary (its watcher stops answering for this process now)."""
        run = self.run
        if run is not None:
            run.leaving = True
            # Said in a thread of its own: this runs in a signal handler, on the event loop's thread, and a store
            # write waits for the store to answer.
            threading.Thread(target=run.say_leaving, name="gsync-departing", daemon=True).start()

    def leave(self, planned_after: int | None = None) -> Decision:
        """Depart from the run between steps: the others change without waiting out a silence (and finish step
        ``planned_after``, whose agreement said this rank leaves after it, when given)."""
        self.departed = True
        return self._run().reform(self.abort, leaving=True, planned_after=planned_after)

    def finish(self) -> None:
        if self.run is not None and not self.departed:
            try:
                self.run.finish()
            except Exception:  # noqa: BLE001 - the next run finds the key and joins; the store may be gone
                pass

    def applied(self, step: int, seconds: float) -> None:
        """The first step after the last change was applied: the change took ``seconds`` (see MembershipChange)."""
        if self.changes and self.changes[-1].step == step and self.changes[-1].seconds == 0.0:
            self.changes[-1] = replace(self.changes[-1], seconds=seconds)

    def _record(self, decision: Decision, first_step: int) -> None:
        reason = "joined" if not decision.lost and not decision.left else ("left" if not decision.lost else "lost")
        change = MembershipChange(
            first_step, tuple(sorted(decision.lost + decision.left)), decision.joined, len(decision.members), reason=reason
        )
        self.changes.append(change)
        logger.warning("gsync: rank %d: %s", self.launch_rank, change)

    def _lost(self, before: Generation, ranks: tuple[int, ...], mine: HeldState | None, why: str) -> PeerLost:
        named = ranks or tuple(rank for rank in before.members if rank != self.launch_rank) or (self.launch_rank,)
        step = -1 if mine is None else mine.step
        error = PeerLost([LostRank(rank, step, "elastic membership change", "", None, 0.0) for rank in named])
        lost = ", ".join(map(str, ranks)) if ranks else "none named"
        when = "before its first step" if step < 0 else f"after step {step}"
        error.args = (f"the elastic run cannot go on {when} (lost: {lost}): {why}",)
        error.checkpoint = None if mine is None else mine.checkpoint()
        error.last_step = step if step >= 0 else None
        return error

    def _run(self) -> ElasticRun:
        if self.run is None:
            raise RuntimeError("the elastic run was not entered")
        return self.run


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a store that is gone: the change that follows finds out
        pass


def _first_step(state: HeldState | None) -> int:
    return 0 if state is None else state.next_step
