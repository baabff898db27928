"""Sessions across 2 real processes (gloo on loopback): the recipe, evaluate, all_reduce, and ranks that diverge."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.inside import ended_event, site_hooks_of
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import plain_loop, state_of, step_lr

GROUPS = 3  # steps, each accumulating 2 batches


def recipe_everywhere() -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(2 * GROUPS, 19)
    out: dict[str, Any] = {}

    async def main() -> None:
        engine = gsync.Engine(["cpu:0", "cpu:1"], sync_timeout=30)
        trained = copy.deepcopy(model)
        async with engine.session(trained, optimizer=sgd, loss_fn=classification_loss, scheduler=step_lr, clip_grad_norm=0.05) as session:
            results = [await session.step(batches[2 * i], batches[2 * i + 1]) for i in range(GROUPS)]
            out["evaluate"] = await session.evaluate(make_batches(2, 13, seed=3))
            out["sum"] = await session.all_reduce(float(rank + 1))
            out["mean"] = await session.all_reduce(torch.tensor([rank, 10.0]), op="mean")
            out["max"] = await session.all_reduce(float(rank), op="max")
            out["min"] = await session.all_reduce(float(rank), op="min")
            # An int stays an int (exactly, past float64's 2**53), as it does in one process; a mean is a float.
            out["int_sum"] = await session.all_reduce(2**53 + rank)
            out["int_mean"] = await session.all_reduce(rank, op="mean")
            out["big_mean"] = await session.all_reduce(10**12 + 1, op="mean")  # past float32's 2**24
            out["bool_mean"] = await session.all_reduce(torch.tensor([True, rank == 0]), op="mean")
            out["world"] = (session.rank, session.world_size)
            # Process-local data: each rank evaluates its own half of the rows.
        out["losses"] = [r.loss for r in results]
        out["lrs"] = [r.lr for r in results]
        out["norms"] = [r.grad_norm for r in results]
        out["state"] = state_of(trained)
        eval_model = copy.deepcopy(trained)
        local = gsync.Engine(["cpu"], sync_timeout=30)
        async with local.session(eval_model, optimizer=sgd, loss_fn=classification_loss, process_local_data=True) as session:
            out["local_evaluate"] = await session.evaluate([tuple(t[rank::2] for t in b) for b in make_batches(2, 14, seed=3)])

    asyncio.run(main())
    return out


@pytest.mark.timeout(120)
def test_a_session_recipe_across_processes_matches_a_plain_loop() -> None:
    results = run_ranks(recipe_everywhere, 2, timeout=100, check=True)
    torch.manual_seed(0)
    model = TiedNet()
    batches = make_batches(2 * GROUPS, 19)
    expected, losses, lrs, norms = plain_loop(
        model, [batches[2 * i : 2 * i + 2] for i in range(GROUPS)], scheduler=step_lr, clip=0.05
    )
    reference = state_of(expected)
    val = make_batches(2, 13, seed=3)
    expected.eval()
    with torch.no_grad():
        val_loss = sum(float(classification_loss(expected, b)) * 13 for b in val) / 26
        local_val = make_batches(2, 14, seed=3)
        local_loss = sum(float(classification_loss(expected, b)) * 14 for b in local_val) / 28
    for result in results:
        out = result.value
        for name, value in out["state"].items():
            torch.testing.assert_close(value, reference[name], atol=2e-5, rtol=0, msg=f"rank {result.rank} {name}")
        assert out["losses"] == pytest.approx(losses, abs=2e-5)
        assert out["lrs"] == pytest.approx(lrs)
        assert out["norms"] == pytest.approx(norms, rel=1e-5)
        assert out["evaluate"]["loss"] == pytest.approx(val_loss, abs=1e-5)
        assert out["local_evaluate"]["loss"] == pytest.approx(local_loss, abs=1e-5)
        assert out["sum"] == 3.0
        assert out["mean"].tolist() == [0.5, 10.0]
        assert (out["max"], out["min"]) == (1.0, 0.0)
        assert out["int_sum"] == 2**54 + 1 and type(out["int_sum"]) is int
        assert out["int_mean"] == 0.5 and type(out["int_mean"]) is float
        assert out["big_mean"] == 10**12 + 1
        assert out["bool_mean"].tolist() == [1.0, 0.5] and out["bool_mean"].dtype == torch.float64
        assert out["world"] == (result.rank, 2)


def rank_1_leaves_early() -> dict[str, Any]:
    import gsync

    rank = int(os.environ["RANK"])
    batches = make_batches(4, 8)
    steps = 2 if rank == 1 else 4
    started = time.monotonic()
    done = []

    async def main() -> None:
        engine = gsync.Engine(["cpu"], sync_timeout=20)
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            for batch in batches[:steps]:
                done.append((await session.step(batch)).step)

    try:
        asyncio.run(main())
    except gsync.GsyncError as error:
        return {"type": type(error).__name__, "message": str(error), "done": done, "elapsed": time.monotonic() - started}
    return {"type": None, "done": done}


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_its_session_early_makes_a_peer_starting_a_step_raise() -> None:
    peer, left = run_ranks(rank_1_leaves_early, 2, timeout=80, check=True)
    assert left.value == {"type": None, "done": [0, 1]}
    assert peer.value["type"] == "PeerFailed", peer.value
    assert "rank 1 left its session after step 1" in peer.value["message"]
    assert peer.value["done"] == [0, 1]
    assert peer.value["elapsed"] < 20  # never waits out sync_timeout in a collective


def failure_while_rank_0_waits_between_steps(slow_first_update: bool = False) -> dict[str, Any]:
    import anyio

    import gsync
    import gsync.testing

    rank = int(os.environ["RANK"])
    engine = gsync.Engine(["cpu"], sync_timeout=20)
    faults = [gsync.testing.fail(0, 1, "forward", error=RuntimeError("boom on rank 1"))] if rank == 1 else []
    reached = []

    def slow_optimizer(device: int, step: int, site: str, abort: threading.Event) -> None:
        if step == 0 and site == "optimizer":
            # Rank 0 is still finishing step 0 when rank 1, past it, fails in step 1.
            abort.wait(3.0)

    if slow_first_update and rank == 0:
        site_hooks_of(engine).append(slow_optimizer)

    async def main() -> None:
        with gsync.testing.inject(engine, *faults):
            async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
                await session.step(make_batches(1, 8)[0])
                if rank == 0:
                    reached.append("waiting")
                    await anyio.sleep(60)  # the user's code, doing something else between steps
                    reached.append("not cancelled")
                else:
                    await session.step(make_batches(1, 8)[0])

    started = time.monotonic()
    try:
        asyncio.run(main())
    except gsync.GsyncError as error:
        return {"type": type(error).__name__, "message": str(error), "reached": reached, "elapsed": time.monotonic() - started}
    return {"type": None, "reached": reached}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("slow_first_update", [False, True], ids=["between-steps", "while-this-rank-finishes-step-0"])
def test_a_peer_failure_between_steps_cancels_the_users_code(slow_first_update: bool) -> None:
    # A peer failing in a later step than the one this rank is finishing lets that step complete.
    waiting, failed = run_ranks(
        failure_while_rank_0_waits_between_steps, 2, args=(slow_first_update,), timeout=80, check=True
    )
    assert failed.value["type"] == "WorkerFailed"
    assert waiting.value["type"] == "PeerFailed" and "boom on rank 1" in waiting.value["message"]
    assert waiting.value["reached"] == ["waiting"]
    assert waiting.value["elapsed"] < 20


# A rank that waited for its failed peer would only stop at this timeout (and raise SyncTimeout): one named sooner,
# with PeerFailed, was told. Well above a loaded machine's start-up time, which the elapsed time includes.
OUTSIDE_STEPS_TIMEOUT_S = 45.0


def failures_outside_steps(case: str) -> dict[str, Any]:
    """Rank 1 fails (or leaves with the user's own exception) while rank 0 is in evaluate or all_reduce."""
    import gsync

    rank = int(os.environ["RANK"])
    started = time.monotonic()

    def broken_metric(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise ValueError("metric bug on rank 1")

    def broken_data() -> Any:
        yield make_batches(1, 8)[0]
        raise OSError("val shard missing on rank 1")

    async def main() -> None:
        engine = gsync.Engine(["cpu"], sync_timeout=OUTSIDE_STEPS_TIMEOUT_S)
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            await session.step(make_batches(1, 8)[0])
            if case == "evaluate":
                metric = broken_metric if rank == 1 else None
                await session.evaluate(make_batches(3, 8), metric_fn=metric)
            elif case == "evaluate_data":
                await session.evaluate(broken_data() if rank == 1 else make_batches(3, 8))
            elif rank == 1:
                raise KeyError("the user's own bug on rank 1")
            else:
                await session.all_reduce(1.0)

    try:
        asyncio.run(main())
    except (gsync.GsyncError, KeyError) as error:
        return {"type": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - started}
    return {"type": None}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("case", "error_type", "cause"),
    [
        ("evaluate", "WorkerFailed", "metric bug on rank 1"),
        # Evaluate's data failing midway: the ranks' evaluations no longer match, so it ends the session too.
        ("evaluate_data", "DataFailed", "evaluate after step 0 failed: OSError: val shard missing on rank 1"),
        ("user_exception", "KeyError", "the user's own bug on rank 1"),
    ],
)
def test_a_peer_failing_outside_a_step_is_named_not_waited_for(case: str, error_type: str, cause: str) -> None:
    peer, failed = run_ranks(failures_outside_steps, 2, args=(case,), timeout=80, check=True)
    assert failed.value["type"] == error_type, failed.value
    assert peer.value["type"] == "PeerFailed", peer.value
    assert cause in peer.value["message"], peer.value
    assert peer.value["elapsed"] < OUTSIDE_STEPS_TIMEOUT_S, peer.value


def evaluate_with_a_rank_that_gets_no_rows() -> dict[str, float]:
    import gsync

    async def main() -> dict[str, float]:
        engine = gsync.Engine(["cpu"], sync_timeout=20)
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            return await session.evaluate(make_batches(1, 1))  # one row: rank 1's device gets none

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_evaluate_when_one_rank_gets_no_rows() -> None:
    results = run_ranks(evaluate_with_a_rank_that_gets_no_rows, 2, timeout=80, check=True)
    assert results[0].value == results[1].value and set(results[0].value) == {"loss"}


def native_threads_after_a_session() -> list[str]:
    import gc

    import gsync

    async def main() -> None:
        engine = gsync.Engine(["cpu"], sync_timeout=20)
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            # What torch.optim's first optimizer does (through torch._dynamo), done here whatever gsync imported
            # first: torch.distributed.nn binds group.WORLD into its default arguments as it is imported.
            import torch.distributed.nn  # noqa: F401

            await session.step(make_batches(1, 8)[0])

    asyncio.run(main())
    gc.collect()
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(names)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists the process's threads through /proc")
def test_the_group_gsync_created_leaves_no_native_threads_behind_after_the_session() -> None:
    # A group still alive at exit (held by torch.distributed.nn's default arguments) keeps gloo's threads and the
    # TCPStore server running while the interpreter shuts down, which now and then aborts a rank that returned.
    for result in run_ranks(native_threads_after_a_session, 2, timeout=80, check=True):
        left = [name for name in result.value if "gloo" in name or "tcpstore" in name]
        assert left == [], f"rank {result.rank}: {result.value}"


def a_rank_fails_while_its_session_starts(case: str) -> dict[str, Any]:
    """Rank 1 fails after joining the group, while rank 0 waits in the session's first collectives."""
    import torch.distributed as dist

    import gsync

    rank = int(os.environ["RANK"])
    users_group = case == "users_group"
    if users_group:
        # A group the user made stays up after rank 1's failure: no connection rank 0 waits on closes.
        dist.init_process_group("gloo")

    # From the end of rank 0's own start-up work, right before the start's collectives: joining the group (rank 1
    # may start seconds later on a loaded machine) is not what the test bounds.
    waits_from: list[float] = []

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if rank == 1:
            if case == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("no optimizer for rank 1")
        waits_from.append(time.monotonic())
        return sgd(params)

    try:
        asyncio.run(
            gsync.Engine(["cpu"], sync_timeout=20).fit(TiedNet(), make_batches(2, 8), optimizer=optimizer, loss_fn=classification_loss)
        )
    except (gsync.GsyncError, ValueError) as error:
        out = {
            "type": type(error).__name__,
            "message": str(error),
            "elapsed": time.monotonic() - waits_from[0] if waits_from else None,
            "rank": getattr(error, "rank", None),
            "site": getattr(error, "site", None),
        }
    else:
        out = {"type": None}
    if users_group:
        # Rank 1 stays in the group until rank 0 has its answer.
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            store.set("rank 0 is done", "1")
        else:
            store.wait(["rank 0 is done"])
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["gsyncs_group", "users_group", "killed"])
def test_a_rank_failing_while_its_session_starts_is_named_not_waited_for(case: str) -> None:
    # Rank 0 waits in the session's first collectives (the parameter check, rank 0's state going out). Its group's
    # own timeout (50 s here, 30 min for a group the user made) must not be what ends its wait, nor gloo's
    # "Connection closed by peer" what it reports. (Killed: gloo's error comes first, then the heartbeat's blame.)
    results = run_ranks(a_rank_fails_while_its_session_starts, 2, args=(case,), timeout=80, failure_grace=20)
    peer = results[0]
    assert peer.ok, peer.describe()
    if case == "killed":
        assert results[1].returncode == -signal.SIGKILL
        assert peer.value["type"] == "PeerLost", peer.value
        assert "rank 1 stopped responding at start-up (starting the session)" in peer.value["message"], peer.value
    else:
        assert results[1].unwrap()["type"] == "ValueError"
        assert peer.value["type"] == "PeerFailed", peer.value
        assert peer.value["site"] == "session start", peer.value
        assert "rank 1 failed to start its session: ValueError: no optimizer for rank 1" in peer.value["message"], peer.value
    assert peer.value["rank"] == 1, peer.value
    assert peer.value["elapsed"] < 15, peer.value


def rank_0_cancelled_while_its_session_starts() -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    import gsync

    rank = int(os.environ["RANK"])
    cancelled_at: list[float] = []
    # Held past the fit: the store's server lives in rank 0 and must outlive gsync's group for the handshake below.
    stores: list[Any] = []

    def optimizer(params: Any) -> torch.optim.Optimizer:
        stores.append(dist.distributed_c10d._get_default_store())
        if rank == 0:
            # Lands in the start's first collective, the next thing rank 0 awaits (rank 1 is not there yet).
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_later(1.0, lambda: (cancelled_at.append(time.monotonic()), task.cancel()))
        else:
            # Rank 1 starts only once rank 0 has left: the collective rank 0 was cancelled in never completes.
            stores[0].wait(["rank 0 left"], timedelta(seconds=60))
        return sgd(params)

    out: dict[str, Any] = {}
    try:
        asyncio.run(
            gsync.Engine(["cpu"], sync_timeout=20).fit(TiedNet(), make_batches(2, 8), optimizer=optimizer, loss_fn=classification_loss)
        )
    except asyncio.CancelledError:
        out = {"type": "CancelledError", "to_leave": time.monotonic() - cancelled_at[0]}
    except gsync.GsyncError as error:
        out = {"type": type(error).__name__, "message": str(error), "rank": getattr(error, "rank", None)}
    stores[0].set(f"rank {rank} left", "1")
    if rank == 0:
        stores[0].wait(["rank 1 left"], timedelta(seconds=60))
    return out


@pytest.mark.timeout(90)
def test_a_start_cancelled_in_its_collectives_ends_at_once() -> None:
    # The cancelled rank tells its peers before it closes: that report must not queue for 10 s (the bound on
    # talking to peers while closing) behind the collective the cancellation interrupted.
    cancelled, peer = (result.unwrap() for result in run_ranks(rank_0_cancelled_while_its_session_starts, 2, timeout=80))
    assert cancelled["type"] == "CancelledError", cancelled
    assert cancelled["to_leave"] < 5, cancelled
    assert peer["type"] == "PeerFailed" and peer["rank"] == 0, peer
    assert "rank 0 failed to start its session: CancelledError" in peer["message"], peer


def held_session_whose_peer_fails_while_it_is_idle(raised_by: str) -> dict[str, Any]:
    import anyio

    import gsync
    import gsync.testing
    from gsync_pytest import gsync_threads

    rank = int(os.environ["RANK"])
    engine = gsync.Engine(["cpu"], sync_timeout=20)
    faults = [gsync.testing.fail(0, 1, "forward", error=RuntimeError("boom on rank 1"))] if rank == 1 else []
    out: dict[str, Any] = {}

    async def main() -> None:
        with gsync.testing.inject(engine, *faults):
            session = await engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss)
            await session.step(make_batches(1, 8)[0])
            if rank == 1:
                try:
                    await session.step(make_batches(1, 8)[0])
                except gsync.WorkerFailed as error:
                    out["type"] = type(error).__name__
                return
            started = time.monotonic()
            with anyio.fail_after(20):  # the user's code doing something else; the session closes by itself
                await ended_event(session).wait()
            out["closed_after"] = time.monotonic() - started
            out["threads"] = gsync_threads()
            try:
                if raised_by == "next call":
                    await session.step(make_batches(1, 8)[0])
                else:
                    await session.aclose()
            except gsync.GsyncError as error:
                out["type"] = type(error).__name__
                out["message"] = str(error)
                out["checkpoint_step"] = error.checkpoint.step if error.checkpoint is not None else None
            await session.aclose()  # quiet now: the failure was raised

    asyncio.run(main())
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("raised_by", ["next call", "aclose"])
def test_a_held_session_whose_peer_fails_while_no_call_runs_closes_and_raises_it_later(raised_by: str) -> None:
    idle, failed = run_ranks(held_session_whose_peer_fails_while_it_is_idle, 2, args=(raised_by,), timeout=80, check=True)
    assert failed.value["type"] == "WorkerFailed"
    assert idle.value["threads"] == []  # closed at once, though no call ran
    assert idle.value["closed_after"] < 20
    assert idle.value["type"] == "PeerFailed" and "boom on rank 1" in idle.value["message"], idle.value
    assert idle.value["checkpoint_step"] == 0
