"""Who the members of an elastic run are: the store protocol every rank follows to agree on one membership.

The run lives under one prefix of its store (``gsync/elastic/<id>/run<R>``;
``id`` is torchrun's run id, ``TORCHELASTIC_RUN_ID``, which every agent of a
job shares, where torchrun's per-agent restart count is not). Its memberships are numbered
generations; generation ``g`` is a tuple of launch ranks (``RANK`` as each
process started), and its group is a gloo group built on the store under
``g<g>/pg`` (as torchft re-forms its groups: torch.distributed's own
backend, a fresh prefix each time).

A change of generation ``g`` is decided in the store, so every rank sees the
same one:

- whoever needs it (a rank whose collective failed, whose heartbeat says a
  peer is silent, or whose step agreed that someone joins or leaves) counts
  ``g<g>/reform`` up and *answers*: ``g<g>/in/<rank>``. Every member's
  :class:`~gsync._core.elastic.watcher.ReformWatcher` thread waits on that key
  and answers for its process at once, whatever its training threads are
  doing; a rank that departs writes ``g<g>/left/<rank>`` instead, and has
  said so since its SIGTERM (``g<g>/leaving/<rank>``), which counts alike:
  the others need not wait for it to finish its step and take its checkpoint;
- a rank deciding waits until every member answered or left, or all but
  one did and a member noted that a peer of this generation is gone (its
  gloo connection closed: ``g<g>/s/peer_gone``), or until ``answer_within``
  has passed since it began; then it proposes the members that answered,
  with the ranks that knocked (``knock<i>``) up to ``max_world_size``, by
  ``compare_set`` on ``g<g>/next``: the first proposal wins, and every rank
  reads the one stored.

A process that finds the run active (``active``) knocks instead of starting
one, and waits for a decision that takes it in. A member's watcher hears a
knock at once (``knock<i>/heard``); a knock nobody hears within a silent
peer's :data:`~gsync._core.distributed.heartbeat.STALE_AFTER_S`, while no
change is under way, was made on a run whose members are all gone (killed,
or restarted together by a launcher): the process starts a new run instead.
A knock on a run whose members finish their fit before taking it in is told
so (a :class:`~gsync.ConfigError`, at once: nothing is left to train).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import logging

import msgspec
import torch
import torch.distributed as dist

from ...elastic import Elastic
from ...errors import ConfigError
from ..distributed.heartbeat import STALE_AFTER_S
from ..threads import FitAborted
from ..base.faults import PEER_GONE_KEY, abort_communicator

__all__ = ("Decision", "ElasticRun", "Generation", "NotAMember", "RunGone", "run_scope")

logger = logging.getLogger("gsync")

# How often a rank deciding a change reads who has answered. Not a timed store.wait: TCPStore logs two C++
# warnings for each wait that times out, and a client whose wait timed out can stall its next call for seconds.
_POLL_S = 0.005
# How often a process waiting to be taken in looks for the decision.
_ADMISSION_POLL_S = 0.05
# How long a decided generation's group waits for its members to connect. They all answered moments ago, so
# one that does not come is gone again: the members change again rather than wait out the collectives' timeout.
FORM_TIMEOUT = timedelta(seconds=10)


class Decision(msgspec.Struct, frozen=True):
    """The next generation, as the store holds it: its members and what changed."""

    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    knocks_seen: int = 0
    """Knocks counted when it was decided: later ones wait for a later change."""


@dataclass(frozen=True)
class Generation:
    """One membership of the run, with its groups."""

    number: int
    members: tuple[int, ...]
    group: dist.ProcessGroup
    """The group the session's collectives run on: gloo on CPU, NCCL on CUDA devices."""
    store: dist.Store
    """The store under this generation's prefix (its failure reports and heartbeats)."""
    decision: Decision
    host: dist.ProcessGroup
    """A gloo group over the same members, for what the hosts exchange (the handover); ``group`` itself on CPU."""

    def abort_collectives(self) -> None:
        """End what is pending on an NCCL ``group`` (a change is coming); nothing for gloo."""
        abort_communicator(self.group)

    def rank_of(self, launch_rank: int) -> int:
        return self.members.index(launch_rank)


class NotAMember(Exception):
    """This process was left out of the next membership (it did not answer in time)."""


class RunGone(Exception):
    """The run knocked on has no member left to take this process in (they all died, or were restarted)."""


def run_scope() -> str:
    """Where this job's elastic runs live in the store: one prefix per torchrun run id (``default`` outside torchrun)."""
    return f"gsync/elastic/{os.environ.get('TORCHELASTIC_RUN_ID', 'default')}"


def _encode(decision: Decision) -> str:
    # JSON: compare_set takes text.
    return msgspec.json.encode(decision).decode()


def _decode(raw: bytes) -> Decision:
    return msgspec.json.decode(raw, type=Decision)


class ElasticRun:
    """One process's part in an elastic run on ``store``; every method blocks (store round trips, rendezvous)."""

    def __init__(
        self,
        store: dist.Store,
        launch_rank: int,
        launch_world: int,
        settings: Elastic,
        group_timeout: timedelta,
        device: torch.device | None = None,
    ) -> None:
        self.store = store
        self.device = device
        """The CUDA device of an NCCL run's collectives; ``None``: gloo only."""
        self.launch_rank = launch_rank
        self.launch_world = launch_world
        self.settings = settings
        self.group_timeout = group_timeout
        self.scope = run_scope()
        self.run: int | None = None
        self.current: Generation | None = None
        self.leaving = False
        """This process is departing (SIGTERM): its watcher no longer answers for it."""
        self._retired: list[dist.ProcessGroup] = []

    def key(self, *parts: object) -> str:
        return "/".join([self.scope, f"run{self.run}", *map(str, parts)])

    # -- entering -------------------------------------------------------------

    def enter(self, abort: threading.Event) -> Generation:
        """Start the run with the launch's ``WORLD_SIZE`` ranks, or knock and wait to be taken into a running one.

        :raises ~gsync.ConfigError: when the running run ends (its members
            finish) before taking this process in, or does not take it in
            within the group timeout.
        """
        active = f"{self.scope}/active"
        marked = self.store.get(active).decode() if self.store.check([active]) else ""
        if marked:  # cleared to "" by the run's last member to finish or leave
            self.run = int(marked)
            try:
                return self._join(abort)
            except RunGone as gone:
                logger.warning("gsync: rank %d: %s; it starts a new run with the launch's %d rank(s)", self.launch_rank, gone, self.launch_world)
        # Every launch rank counts once per run it starts: the same run number on each.
        self.run = (self.store.add(f"{self.scope}/starts", 1) - 1) // self.launch_world
        first = Decision(0, tuple(range(self.launch_world)))
        # The launch's ranks start as slowly as a loaded machine imports torch: they meet within the collectives'
        # timeout, as a run that is not elastic does, not within the short one for a change's survivors.
        generation = self._form(first, self.group_timeout)
        self.store.set(active, str(self.run))
        return generation

    def rejoin(self, abort: threading.Event) -> Generation:
        """Knock on the run this process was left out of, and wait to be taken back in.

        :raises RunGone: when no member is left to take it in.
        """
        return self._join(abort)

    def _join(self, abort: threading.Event) -> Generation:
        # The knock's name first, then its count: a member that counts it can read whose it is.
        knock = self.store.add(self.key("knocks"), 1)
        self.store.set(self.key(f"knock{knock}"), str(self.launch_rank))
        number = int(self.store.get(self.key("current")))
        # A generation formed after the knock counted it, or its watcher sees it as it starts; this one's
        # watchers are woken.
        self._wake(number, _decode(self.store.get(self.key(f"g{number}", "decided"))).members)
        admission = _Admission(self, knock)
        while True:
            decision = self._wait_decision(number, abort, admission)
            if self.launch_rank in decision.members:
                return self._form(decision)
            number = decision.generation

    def _wait_decision(self, number: int, abort: threading.Event, admission: _Admission) -> Decision:
        key = self.key(f"g{number}", "next")
        while not self.store.check([key]):
            admission.check(number)
            if abort.wait(_ADMISSION_POLL_S):
                raise FitAborted
        admission.progressed()
        return _decode(self.store.get(key))

    def _wake(self, number: int, members: tuple[int, ...]) -> None:
        """Wake the watchers of generation ``number``'s members (after writing what they should find)."""
        for member in members:
            self.store.set(self.key(f"g{number}", f"wake/{member}"), "1")

    # -- changing ---------------------------------------------------------------

    def knocks(self) -> int:
        """How many processes have knocked so far (one store round trip)."""
        return self.store.add(self.key("knocks"), 0)

    def reform(self, abort: threading.Event, leaving: bool = False, planned_after: int | None = None) -> Decision:
        """Decide the generation after the current one, with the others; ``leaving``: this rank departs.

        ``planned_after``: the change every member agreed on in step
        ``planned_after``'s agreement (a departure, a knock), made at that step's
        boundary. Members still finishing that step finish it (its collectives
        are all done), instead of giving it up to be redone.

        :raises NotAMember: when the decision leaves this rank out (it answered too late).
        """
        current = self._current()
        current.abort_collectives()  # nothing of this generation is waited for again
        number = current.number
        if leaving:
            self.store.set(self.key(f"g{number}", f"left/{self.launch_rank}"), "1")
        if planned_after is not None:
            # Before the reform key: a watcher that sees the reform reads this next.
            self.store.compare_set(self.key(f"g{number}", "planned"), "", str(planned_after))
        self.store.add(self.key(f"g{number}", "reform"), 1)
        if not leaving:
            self.answer(number)
        self._wake(number, current.members)
        next_key = self.key(f"g{number}", "next")
        deadline = time.monotonic() + self.settings.answer_within
        while not self.store.check([next_key]):
            answered, left = self._roll_call(current)
            if self._known(current, answered, left, leaving, deadline):
                # Agreed, not raced: members deciding at the same moment may propose different memberships (one
                # read an answer or a note of a lost peer that another did not yet), but compare_set stores only
                # the first proposal, and every member, the proposers included, goes on with the one stored.
                self.store.compare_set(next_key, "", _encode(self._propose(current, answered, left)))
                break
            if abort.wait(_POLL_S):
                raise FitAborted
        decision = _decode(self.store.get(next_key))
        if not decision.members:
            # Everyone left: a process started later begins a run of its own, without knocking on this one.
            self.store.compare_set(f"{self.scope}/active", str(self.run), "")
        if leaving:
            return decision
        if self.launch_rank not in decision.members:
            raise NotAMember(
                f"rank {self.launch_rank} answered the membership change after generation {number} too late and "
                f"was left out (members now {list(decision.members)}); raise Elastic(answer_within=...) on a "
                "machine this loaded"
            )
        return decision

    def answer(self, number: int) -> None:
        """Say this process is alive in the change after generation ``number`` (the watcher does, at once)."""
        self.store.set(self.key(f"g{number}", f"in/{self.launch_rank}"), "1")

    def _known(self, current: Generation, answered: list[int], left: list[int], leaving: bool, deadline: float) -> bool:
        """Whether the change after ``current`` can be decided now: who is in is known, or waiting is over.

        - Every member answered or left: nobody is left to hear from. A
          departing rank proposes too then (every member leaving at once, as
          a launcher tearing down signals them all).
        - One member is silent, and a member's collective in this generation
          failed on a connection a peer's process closed (``peer_gone``): the
          silent one is that peer, since a member that answered or left was
          alive when it did (a departing one waits for this decision). No
          need to wait out ``answer_within`` for an answer that cannot come.
          Two or more silent: which of them is gone is not known, so the
          wait goes on for the others.
        - ``answer_within`` has passed since this rank began: the silent ones
          are left out. A departing rank never decides to go on without a
          silent one.

        A silent member left out while alive after all (too starved to answer)
        is told so when it does, and knocks to be taken back in.
        """
        silent = len(current.members) - len(answered) - len(left)
        if silent == 0:
            return True
        if leaving:
            return False
        if silent == 1 and self.store.check([self._peer_gone_key(current.number)]):
            return True
        return time.monotonic() > deadline

    def _peer_gone_key(self, number: int) -> str:
        # Under generation ``number``'s own store (``Generation.store``), where its members' runtimes write it; by
        # number, since a generation that did not form keeps its predecessor's store object.
        return self.key(f"g{number}", "s", PEER_GONE_KEY)

    def note_peer_gone(self, number: int) -> None:
        """A member of generation ``number`` is gone (its connection closed while that generation formed or was handed over)."""
        self.store.set(self._peer_gone_key(number), "1")

    def say_leaving(self) -> None:
        """Tell the current generation's members that this process departs (SIGTERM), before it reaches the step
        boundary where it leaves: a change after that step does not wait for it. Blocks for one store write."""
        current = self.current
        if current is None:
            return
        try:
            self.store.set(self.key(f"g{current.number}", f"leaving/{self.launch_rank}"), "1")
        except Exception as error:  # noqa: BLE001 - it says so again as it leaves, or the store is gone
            logger.info("gsync: rank %d could not say it departs ahead of the change: %s", self.launch_rank, error)

    def _roll_call(self, current: Generation) -> tuple[list[int], list[int]]:
        answered, left = [], []
        for member in current.members:
            said = [self.key(f"g{current.number}", f"{what}/{member}") for what in ("left", "leaving")]
            if self.store.check(said[:1]) or self.store.check(said[1:]):
                left.append(member)
            elif self.store.check([self.key(f"g{current.number}", f"in/{member}")]):
                answered.append(member)
        return answered, left

    def _propose(self, current: Generation, answered: list[int], left: list[int]) -> Decision:
        knocks = self.knocks()
        joined: list[int] = []
        room = (self.settings.max_world_size or 2**31) - len(answered)
        for index in range(current.decision.knocks_seen + 1, knocks + 1):
            rank = int(self.store.get(self.key(f"knock{index}")))
            if rank not in answered and rank not in joined and len(joined) < room:
                joined.append(rank)
        gone = set(current.members) - set(answered)
        return Decision(
            current.number + 1,
            tuple(sorted(answered + joined)),
            lost=tuple(sorted(gone - set(left))),
            left=tuple(sorted(left)),
            joined=tuple(sorted(joined)),
            knocks_seen=knocks,
        )

    def form(self, decision: Decision) -> Generation:
        """Build the decided generation's group (a rendezvous of its members) and make it the current one."""
        return self._form(decision)

    def _form(self, decision: Decision, timeout: timedelta | None = None) -> Generation:
        old = self.current
        prefix = self.key(f"g{decision.generation}")
        rank, size = decision.members.index(self.launch_rank), len(decision.members)
        host = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/pg", self.store), rank, size, timeout or min(FORM_TIMEOUT, self.group_timeout))
        host._set_default_timeout(self.group_timeout)  # the collectives' own, once every member connected
        # Bare backends, which torch's collective functions take as groups (gsync broadcasts through its own call).
        group = cast(dist.ProcessGroup, host) if self.device is None else self._nccl_group(f"{prefix}/nccl", rank, size)
        generation = Generation(
            decision.generation, decision.members, group, dist.PrefixStore(f"{prefix}/s", self.store), decision, cast(dist.ProcessGroup, host)
        )
        self.current = generation
        if self.leaving:
            self.say_leaving()  # a SIGTERM that came while this generation formed
        self.store.set(self.key(f"g{decision.generation}", "decided"), _encode(decision))
        self.store.set(self.key("current"), str(decision.generation))
        if old is not None:
            self._retire(old)
        return generation

    def _nccl_group(self, store_prefix: str, rank: int, size: int) -> dist.ProcessGroup:
        """An NCCL group over the members (its communicator is made by its first collective). Not run on a GPU yet."""
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.group_timeout
        return cast(dist.ProcessGroup, dist.ProcessGroupNCCL(dist.PrefixStore(store_prefix, self.store), rank, size, options))

    def not_formed(self, decision: Decision) -> None:
        """A decided generation whose group did not form: it becomes the one the next change starts from."""
        old = self._current()
        self.current = Generation(decision.generation, decision.members, old.group, old.store, decision, old.host)

    def _retire(self, generation: Generation) -> None:
        # Work a dead peer never completes may still be pending in the old group, and its destructor would
        # wait for it: the group is kept until the run ends, so no thread of ours destroys it meanwhile. An
        # NCCL communicator is aborted (normally already, when the change began).
        generation.abort_collectives()
        self._retired.append(generation.group)
        self._retired.append(generation.host)

    def finish(self) -> None:
        """The run ended normally on this rank: the last member to finish clears ``active`` for the next run."""
        current = self.current
        if current is None or self.run is None:
            return
        if self.store.add(self.key(f"g{current.number}", "finished"), 1) == len(current.members):
            self.store.compare_set(f"{self.scope}/active", str(self.run), "")

    def _current(self) -> Generation:
        if self.current is None:
            raise RuntimeError("the elastic run has no membership yet")
        return self.current


class _Admission:
    """A knock's wait to be taken in: it fails fast on a run that is over, and in the group timeout otherwise."""

    def __init__(self, run: ElasticRun, knock: int) -> None:
        self._run = run
        self._knock = knock
        self._heard = False
        self._deadline = time.monotonic() + run.group_timeout.total_seconds()
        self._unheard_until = time.monotonic() + STALE_AFTER_S

    def progressed(self) -> None:
        """A change was decided: the run is alive, and the next one may take this process in."""
        self._unheard_until = time.monotonic() + STALE_AFTER_S

    def check(self, number: int) -> None:
        """One look at the run while waiting for generation ``number``'s decision.

        :raises ~gsync.ConfigError: the run finished, or the wait passed the group timeout.
        :raises RunGone: nobody heard the knock, and no change is under way.
        """
        run, store = self._run, self._run.store
        if not self._heard:
            self._heard = store.check([run.key(f"knock{self._knock}", "heard")])
        if store.get(f"{run.scope}/active").decode() != str(run.run):
            if self._heard or store.check([run.key(f"g{number}", "finished")]):
                raise ConfigError(
                    f"rank {run.launch_rank} knocked on elastic run {run.run}, whose members finished their fit "
                    "before taking it in: nothing is left to train (start a lost rank again while the run goes "
                    "on, or start a new run)"
                )
            raise RunGone(f"elastic run {run.run} ended without finishing")
        now = time.monotonic()
        if not self._heard and now > self._unheard_until and not store.check([run.key(f"g{number}", "reform")]):
            raise RunGone(
                f"elastic run {run.run} is marked active, but none of its members heard a knock within "
                f"{STALE_AFTER_S:g} s (they all died, or a launcher restarted them together)"
            )
        if now > self._deadline:
            raise ConfigError(
                f"rank {run.launch_rank} knocked on the running elastic run but was not taken in within "
                f"{run.group_timeout.total_seconds():g} s (it is full at max_world_size, or its members "
                "stopped changing steps)"
            )
