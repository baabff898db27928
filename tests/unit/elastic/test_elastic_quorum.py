"""The elastic run's store protocol, with several members in threads of one process on one real TCPStore.

Real gloo groups form over loopback; what is left out is the training, which the multi-process tests add.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

import gsync
from gsync._core.elastic.quorum import Decision, ElasticRun, NotAMember, run_scope
from gsync._core.base.faults import PEER_GONE_KEY, connection_lost
from gsync._core.elastic.watcher import ReformWatcher

TIMEOUT = timedelta(seconds=20)


def store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def member(server: dist.TCPStore, rank: int, world: int, settings: gsync.Elastic) -> ElasticRun:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    return ElasticRun(client, rank, world, settings, TIMEOUT)


def started(server: dist.TCPStore, world: int, settings: gsync.Elastic) -> list[ElasticRun]:
    runs = [member(server, rank, world, settings) for rank in range(world)]
    abort = threading.Event()
    with ThreadPoolExecutor(world) as pool:
        generations = list(pool.map(lambda run: run.enter(abort), runs))
    assert [g.number for g in generations] == [0] * world
    return runs


@pytest.mark.timeout(60)
def test_the_members_that_answer_agree_on_one_membership_and_a_silent_one_is_left_out() -> None:
    server = store_server()
    settings = gsync.Elastic(answer_within=0.5)
    runs = started(server, 3, settings)
    abort = threading.Event()
    # Rank 1 never answers (killed); ranks 0 and 2 both decide.
    with ThreadPoolExecutor(2) as pool:
        decisions = list(pool.map(lambda run: run.reform(abort), [runs[0], runs[2]]))
    assert decisions[0] == decisions[1]
    assert decisions[0].members == (0, 2) and decisions[0].lost == (1,) and decisions[0].generation == 1
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda run: run.form(decisions[0]), [runs[0], runs[2]]))
    assert [g.group.rank() for g in groups] == [0, 1] and groups[0].group.size() == 2
    # Rank 1 comes back to life and tries to answer: it is told it was left out.
    with pytest.raises(NotAMember, match="too late"):
        runs[1].reform(abort)


def decide_timed(runs: list[ElasticRun]) -> tuple[list[Decision], float]:
    """Every run in ``runs`` decides the next change at once (each in a thread); the decisions and the seconds it took."""
    abort = threading.Event()
    began = time.monotonic()
    with ThreadPoolExecutor(len(runs)) as pool:
        decisions = list(pool.map(lambda run: run.reform(abort), runs))
    return decisions, time.monotonic() - began


@pytest.mark.timeout(60)
def test_a_silent_member_known_gone_is_left_out_without_waiting_out_answer_within() -> None:
    server = store_server()
    runs = started(server, 3, gsync.Elastic(answer_within=30.0))
    # Rank 0's collective failed on a connection a peer closed: its runtime notes it in the generation's store.
    runs[0].current.store.set(PEER_GONE_KEY, "1")
    decisions, took = decide_timed([runs[0], runs[2]])
    assert decisions[0] == decisions[1]
    assert decisions[0].members == (0, 2) and decisions[0].lost == (1,)
    assert took < 15, took  # far below answer_within (30 s), which a silent rank costs without the note


@pytest.mark.timeout(60)
def test_two_silent_members_are_waited_for_though_one_is_known_gone() -> None:
    server = store_server()
    runs = started(server, 4, gsync.Elastic(answer_within=1.0))
    runs[3].current.store.set(PEER_GONE_KEY, "1")
    # Which of ranks 1 and 2 is gone is not known: the live one may still answer within answer_within.
    decisions, took = decide_timed([runs[0], runs[3]])
    assert decisions[0] == decisions[1] and decisions[0].members == (0, 3) and decisions[0].lost == (1, 2)
    assert took >= 1.0, took


@pytest.mark.timeout(60)
def test_a_note_of_a_gone_peer_counts_for_its_own_generation_only() -> None:
    server = store_server()
    runs = started(server, 3, gsync.Elastic(answer_within=1.0))
    decisions, _ = decide_timed(runs)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda run: run.form(decisions[0]), runs))
    # Generation 0's old group failing late, on a peer that is gone by now.
    runs[0].note_peer_gone(0)
    # In generation 1 rank 1 is silent, and nobody noted a gone peer in it: it is waited for.
    decisions, took = decide_timed([runs[0], runs[2]])
    assert decisions[0].members == (0, 2) and decisions[0].generation == 2
    assert took >= 1.0, took


@pytest.mark.timeout(60)
def test_a_rank_that_said_it_departs_is_not_waited_for_at_the_step_boundary() -> None:
    server = store_server()
    runs = started(server, 3, gsync.Elastic(answer_within=30.0))
    # Rank 1 got SIGTERM: it says so at once, then finishes its step and takes its checkpoint, which takes long.
    runs[1].leaving = True
    runs[1].say_leaving()
    decisions, took = decide_timed([runs[0], runs[2]])
    assert decisions[0] == decisions[1]
    assert decisions[0].members == (0, 2) and decisions[0].left == (1,) and decisions[0].lost == ()
    assert took < 15, took  # not answer_within (30 s)
    # When it comes to leave, the change is made: it reads the one decided.
    assert runs[1].reform(threading.Event(), leaving=True) == decisions[0]


def test_only_gloo_saying_a_peers_connection_closed_is_proof_that_a_member_is_gone() -> None:
    # As gloo 2.13 words it (measured: a peer process killed, the survivor's next collective).
    closed = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:32968. This is typically caused by a remote worker crashing."
    )
    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:4711: Connection reset by peer")
    for cause in (closed, reset):
        failed = gsync.SyncFailed(4, None)
        failed.__cause__ = cause
        assert connection_lost(failed)
    assert not connection_lost(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv operation to complete"))
    # The store's own socket errors say nothing of the members.
    assert not connection_lost(dist.DistStoreError("Connection reset by peer"))
    assert not connection_lost(gsync.SyncFailed(4, None))
    # Nor under a gsync error, whose message ends with its cause's.
    wrapped = gsync.SyncFailed(4, None)
    wrapped.__cause__ = dist.DistStoreError("Connection reset by peer")
    assert not connection_lost(wrapped)


@pytest.mark.timeout(60)
def test_a_process_that_knocks_is_taken_in_at_the_next_change_and_a_departure_needs_no_wait() -> None:
    server = store_server()
    settings = gsync.Elastic(answer_within=30.0)  # nobody is silent: no change below may wait for it
    runs = started(server, 2, settings)
    abort = threading.Event()
    joiner = member(server, 5, 2, settings)
    with ThreadPoolExecutor(3) as pool:
        entering = pool.submit(joiner.enter, abort)
        # The members see the knock (as their watcher threads do), then change together.
        runs[0].store.wait([runs[0].key("knock1")])
        assert runs[0].knocks() == 1
        decisions = list(pool.map(lambda run: run.reform(abort), runs))
        list(pool.map(lambda run: run.form(decisions[0]), runs))
        joined = entering.result(timeout=30)
    assert decisions[0].members == (0, 1, 5) and decisions[0].joined == (5,)
    assert joined.members == (0, 1, 5) and joined.group.rank() == 2
    # Rank 1 leaves on purpose: the others decide at once, not after answer_within (30 s here).
    with ThreadPoolExecutor(3) as pool:
        leaving = pool.submit(runs[1].reform, abort, True)
        decisions = list(pool.map(lambda run: run.reform(abort), [runs[0], joiner]))
        assert leaving.result(timeout=30) == decisions[0]
    assert decisions[0].members == (0, 5) and decisions[0].left == (1,) and decisions[0].lost == ()


@pytest.mark.timeout(60)
def test_every_member_leaving_at_once_decides_without_waiting() -> None:
    server = store_server()
    runs = started(server, 2, gsync.Elastic(answer_within=30.0))
    abort = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        decisions = list(pool.map(lambda run: run.reform(abort, True), runs))
    assert decisions[0] == decisions[1]
    assert decisions[0].members == () and decisions[0].left == (0, 1)
    # Nobody is left in run 0, so the next launch starts run 1 without knocking on run 0.
    again = started(server, 2, gsync.Elastic())
    assert [run.run for run in again] == [1, 1]
    assert again[0].store.add(f"{run_scope()}/run0/knocks", 0) == 0


@pytest.mark.timeout(60)
def test_a_launch_that_finds_a_run_whose_members_are_gone_starts_a_new_one() -> None:
    # Run 0's members are gone without finishing (killed together, or restarted by a launcher): its mark stays.
    server = store_server()
    started(server, 2, gsync.Elastic())
    # The next launch knocks on run 0; nobody hears it (no member's watcher runs), so it starts run 1 instead.
    again = started(server, 2, gsync.Elastic())
    assert [run.run for run in again] == [1, 1]
    assert again[0].store.add(f"{run_scope()}/run0/knocks", 0) == 2


@pytest.mark.timeout(60)
def test_a_knock_on_a_run_that_finishes_before_taking_it_in_is_told_so() -> None:
    server = store_server()
    runs = started(server, 2, gsync.Elastic())
    joiner = member(server, 1, 2, gsync.Elastic())
    abort = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        entering = pool.submit(joiner.enter, abort)
        runs[0].store.wait([runs[0].key("knock1")])
        runs[0].store.set(runs[0].key("knock1", "heard"), "1")  # as a member's watcher does when it wakes
        for run in runs:
            run.finish()
        with pytest.raises(gsync.ConfigError, match="finished their fit before taking it in"):
            entering.result(timeout=30)


def test_elastic_settings_are_checked_before_any_work() -> None:
    for bad in ({"min_world_size": 0}, {"min_world_size": 3, "max_world_size": 2}, {"answer_within": 0}, {"answer_within": True}):
        with pytest.raises(gsync.ConfigError):
            gsync.Elastic(**bad)  # type: ignore[arg-type]
    with pytest.raises(gsync.ConfigError, match="elastic must be"):
        gsync.Engine(["cpu"], elastic="yes")  # type: ignore[arg-type]
    with pytest.raises(gsync.ConfigError, match="process_group"):
        gsync.Engine(["cpu"], elastic=True, process_group=object())  # type: ignore[arg-type]
    change = gsync.MembershipChange(step=4, lost=(1,), joined=(), world_size=2)
    assert str(change) == "membership change at step 4: lost rank(s) 1; 2 rank(s) now"


class StandInNccl:
    """Stands in for torch's ProcessGroupNCCL, which a CPU build of torch does not have: it counts aborts."""

    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def on_stand_in_nccl(monkeypatch: pytest.MonkeyPatch) -> tuple[dist.TCPStore, list[ElasticRun]]:
    """A store server (keep it referenced) and 2 started members whose generation's group is a StandInNccl."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInNccl, raising=False)
    server = store_server()
    runs = started(server, 2, gsync.Elastic(answer_within=5.0))
    for run in runs:
        run.current = dataclasses.replace(run.current, group=StandInNccl())
    return server, runs


@pytest.mark.timeout(60)
def test_an_nccl_generation_aborts_its_communicator_before_the_session_hears_of_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL waits on a dead peer for ever: the communicator is aborted the moment a change is known, once.
    server, runs = on_stand_in_nccl(monkeypatch)
    heard: list[int] = []
    watched = runs[1].current
    planned: list[int | None] = []

    def on_reform(after: int | None) -> None:
        planned.append(after)
        heard.append(watched.group.aborted)

    watcher = ReformWatcher(runs[1], watched, on_reform, lambda: None)
    watcher.start()
    abort = threading.Event()
    decision = runs[0].reform(abort)  # rank 1's watcher answers for it
    assert decision.members == (0, 1)
    assert heard == [1]  # aborted before the session was told
    assert planned == [None]  # after a loss: the step in flight is given up
    assert runs[0].current.group.aborted == 1
    before = runs[0].current.group
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda run: run.form(decision), runs))
    assert before.aborted == 1  # retiring it does not abort it again
    watcher.stop()


@pytest.mark.timeout(60)
def test_a_change_planned_in_a_steps_agreement_lets_the_others_finish_that_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # A departure (or a knock) agreed in step 6's agreement: the member that begins the change is past that step,
    # and so is every collective of it. A member still applying step 6 is told which step, and finishes it
    # (its communicator is not aborted under it) instead of giving it up to be redone.
    server, runs = on_stand_in_nccl(monkeypatch)
    watched = runs[1].current
    told: list[int | None] = []
    heard = threading.Event()

    def on_reform(after: int | None) -> None:
        told.append(after)
        heard.set()

    watcher = ReformWatcher(runs[1], watched, on_reform, lambda: None)
    watcher.start()
    decision = runs[0].reform(threading.Event(), planned_after=6)
    assert decision.members == (0, 1)  # answered by rank 1's watcher, at once
    assert heard.wait(30)
    assert told == [6]
    assert watched.group.aborted == 0
    watcher.stop()


@pytest.mark.timeout(60)
def test_a_stopped_watcher_ends_and_join_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A session's close joins its watcher: a thread of a generation that ended must not outlive the session.
    server, runs = on_stand_in_nccl(monkeypatch)
    watcher = ReformWatcher(runs[1], runs[1].current, lambda after: None, lambda: None)
    watcher.start()
    assert not watcher.join(0.05)  # it waits on the store for news, and nothing else ends that wait
    watcher.stop()
    assert watcher.join(10)
