"""ProcessGroupCollective passes the collective conformance cases across 2 real processes.

The cases mirror ``tests/unit/comm/test_conformance.py``, with the devices spread
over two ranks: every rank builds the same *global* tensors from one seed,
keeps its local slice, runs the collective, and checks the global answer. All
layouts and cases run in one spawn (process start-up dominates); each case is
reported as its own pytest test.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import gsync
from gsync._core.transports.process_group import ProcessGroupCollective
from gsync._core.distributed import GroupMembership, gather_topology, join
from gsync._core.topology import Topology
from gsync.comm._shards import shard_bounds

from tests.support.harness import RankResult, run_ranks
from tests.support.inside import take_the_scatter_path

# Local devices per rank: 1 each, 2 each, and uneven.
LAYOUTS: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (1, 2))

Case = Callable[[GroupMembership, Topology], None]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn

    return register


def _collective(session: GroupMembership, topology: Topology) -> ProcessGroupCollective:
    return ProcessGroupCollective(session.group, topology)


@case("is_a_collective")
def _is_a_collective(session: GroupMembership, topology: Topology) -> None:
    collective = _collective(session, topology)
    assert isinstance(collective, gsync.Collective)
    assert collective.world_devices == topology.world_devices
    collective.close()
    collective.close()
    with pytest.raises(gsync.GsyncError, match="closed"):
        collective.broadcast([torch.zeros(1)] * topology.local_devices)


def _weighted(dtype: torch.dtype) -> Case:
    def run(session: GroupMembership, topology: Topology) -> None:
        n = topology.world_devices
        generator = torch.Generator().manual_seed(n)
        tensors = [torch.randn(1000, generator=generator).to(dtype) for _ in range(n)]
        rows = torch.randint(1, 9, (n,), generator=generator).tolist()
        weights = [r / sum(rows) for r in rows]
        expected = sum(w * t.double() for w, t in zip(weights, tensors))
        local = tensors[topology.local_slice]
        _collective(session, topology).all_reduce(local, weights[topology.local_slice])
        tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
        for tensor in local:
            torch.testing.assert_close(tensor.double(), expected, atol=tolerance, rtol=tolerance)
            assert tensor.dtype == dtype

    return run


for _dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    case(f"weighted_all_reduce_{str(_dtype).removeprefix('torch.')}")(_weighted(_dtype))


@case("fp16_weighted_sum_does_not_overflow")
def _fp16_no_overflow(session: GroupMembership, topology: Topology) -> None:
    n = topology.world_devices
    local = [torch.full((16,), 40000.0, dtype=torch.float16) for _ in range(topology.local_devices)]
    _collective(session, topology).all_reduce(local, [1 / n] * topology.local_devices)
    for tensor in local:
        assert torch.isfinite(tensor).all()
        torch.testing.assert_close(tensor.float(), torch.full((16,), 40000.0), rtol=1e-3, atol=0)


@case("broadcast_from_global_device_0")
def _broadcast(session: GroupMembership, topology: Topology) -> None:
    n = topology.world_devices
    tensors = [torch.full((5,), float(i)) for i in range(n)][topology.local_slice]
    ints = [torch.arange(3) + 10 * i for i in range(n)][topology.local_slice]
    collective = _collective(session, topology)
    collective.broadcast(tensors)
    collective.broadcast(ints)
    for tensor, integers in zip(tensors, ints):
        assert torch.equal(tensor, torch.zeros(5))
        assert torch.equal(integers, torch.arange(3))


@case("zero_weight_devices_contribute_nothing")
def _zero_weights(session: GroupMembership, topology: Topology) -> None:
    n = topology.world_devices
    tensors = [torch.ones(4), torch.full((4,), 1e30)] + [torch.full((4,), 3.0) for _ in range(n - 2)]
    weights = [0.0 if i == 1 else 1 / (n - 1) for i in range(n)]
    expected = (1.0 + 3.0 * (n - 2)) / (n - 1)
    local = tensors[topology.local_slice]
    _collective(session, topology).all_reduce(local, weights[topology.local_slice])
    for tensor in local:
        torch.testing.assert_close(tensor, torch.full((4,), expected))


@case("strided_tensors_are_written_back")
def _strided(session: GroupMembership, topology: Topology) -> None:
    n = topology.world_devices
    bases = [torch.full((4, 2), float(i + 1)) for i in range(n)][topology.local_slice]
    views = [base[:, 0] for base in bases]  # non-contiguous
    _collective(session, topology).all_reduce(views, [1 / n] * topology.local_devices)
    mean = (n + 1) / 2
    for position, base in enumerate(bases):
        torch.testing.assert_close(base[:, 0], torch.full((4,), mean))
        untouched = float(topology.device_offset + position + 1)
        torch.testing.assert_close(base[:, 1], torch.full((4,), untouched))


def _reduce_scatter(dtype: torch.dtype, numel: int, scatter_by_all_reduce: bool) -> Case:
    """Each device's shard (shard_bounds over every device of every rank) is the weighted sum; over gloo by its
    all-reduce, and by the reduce-scatter path other backends take (gloo has one in this torch, waited without
    polling)."""

    def run(session: GroupMembership, topology: Topology) -> None:
        n = topology.world_devices
        generator = torch.Generator().manual_seed(n + numel)
        tensors = [torch.randn(numel, generator=generator).to(dtype) for _ in range(n)]
        rows = torch.randint(1, 9, (n,), generator=generator).tolist()
        weights = [r / sum(rows) for r in rows]
        weights[-1] = 0.0
        tensors[-1].fill_(float("inf"))  # a zero-weight device is left out
        weights = [w / sum(weights) for w in weights]
        expected = sum(w * t.double() for w, t in zip(weights, tensors) if w != 0)
        local = tensors[topology.local_slice]
        # Over gloo as a session runs it: with an abort flag, so every wait polls (gloo's own reduce-scatter
        # never reports completion to that polling, which is why gloo takes the all-reduce).
        abort = threading.Event() if scatter_by_all_reduce else None
        collective = ProcessGroupCollective(session.group, topology, abort)
        take_the_scatter_path(collective, by_all_reduce=scatter_by_all_reduce)
        collective.reduce_scatter(local, weights[topology.local_slice])
        tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
        bounds = shard_bounds(numel, n)[topology.local_slice]
        for tensor, (start, stop) in zip(local, bounds):
            torch.testing.assert_close(tensor[start:stop].double(), expected[start:stop], atol=tolerance, rtol=tolerance)  # type: ignore[index]
        # The updated shards back to every device: each holds its own, and gets every other device's.
        for tensor, (start, stop) in zip(local, bounds):
            tensor[:start] = -1.0
            tensor[stop:] = -1.0
        collective.all_gather(local)
        for tensor in local:
            torch.testing.assert_close(tensor.double(), expected, atol=tolerance, rtol=tolerance)  # type: ignore[arg-type]

    return run


for _dtype in (torch.float32, torch.bfloat16):
    for _numel in (1000, 1003, 2):
        for _by_all_reduce in (True, False):
            _path = "all_reduce" if _by_all_reduce else "reduce_scatter"
            case(f"reduce_scatter_{str(_dtype).removeprefix('torch.')}_{_numel}_by_{_path}")(
                _reduce_scatter(_dtype, _numel, _by_all_reduce)
            )


@case("sharded_collectives_refuse_strided_buffers")
def _sharded_strided(session: GroupMembership, topology: Topology) -> None:
    views = [torch.zeros(4, 2)[:, 0] for _ in range(topology.local_devices)]
    collective = _collective(session, topology)
    with pytest.raises(gsync.GsyncError, match="contiguous"):
        collective.reduce_scatter(views, [1.0] * topology.local_devices)
    with pytest.raises(gsync.GsyncError, match="contiguous"):
        collective.all_gather(views)


@case("wrong_topology_is_rejected")
def _wrong_topology(session: GroupMembership, topology: Topology) -> None:
    other = Topology(topology.local_devices, (topology.rank + 1) % 2, 2, 0, topology.world_devices)
    with pytest.raises(gsync.ConfigError, match="topology says rank"):
        ProcessGroupCollective(session.group, other)
    collective = _collective(session, topology)
    with pytest.raises(gsync.GsyncError, match="one tensor"):
        collective.all_reduce([torch.zeros(1)] * (topology.local_devices + 1), [0.5] * (topology.local_devices + 1))


def rank_main() -> dict[str, str | None]:
    """In each rank: run every case under every layout; a case's value is None or its traceback."""
    session = join(None, "cpu", timeout_s=30)
    outcomes: dict[str, str | None] = {}
    try:
        for layout in LAYOUTS:
            topology = gather_topology(session, layout[session.rank])
            for name, run in CASES.items():
                try:
                    run(session, topology)
                    outcomes[f"{layout}-{name}"] = None
                except Exception:
                    outcomes[f"{layout}-{name}"] = traceback.format_exc()
                # Keep the ranks in step even when a case failed on one of them.
                dist.barrier(group=session.group)
    finally:
        session.close()
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> list[RankResult]:
    return run_ranks(rank_main, 2, timeout=60, check=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"local{layout[0]}+{layout[1]}")
def test_conformance_across_processes(outcomes: list[RankResult], layout: tuple[int, int], name: str) -> None:
    failures = [f"rank {r.rank}:\n{r.value[f'{layout}-{name}']}" for r in outcomes if r.value[f"{layout}-{name}"]]
    assert not failures, "\n".join(failures)


def abandoned_reduction() -> dict[str, object]:
    """Rank 0 waits in an all-reduce rank 1 never joins, until the run's abort flag is raised."""
    import threading
    import time

    from gsync._core.threads import FitAborted

    abort = threading.Event()
    session = join(None, "cpu", timeout_s=30, abort=abort)
    topology = gather_topology(session, 1)
    if session.rank == 1:
        session.store.wait(["rank 0 left the reduction"])
        return {}
    collective = ProcessGroupCollective(session.group, topology, abort)
    outcome: dict[str, object] = {}

    def reduce() -> None:
        try:
            collective.all_reduce([torch.ones(4)], [1.0])
            outcome["ended"] = "returned"
        except FitAborted:
            outcome["ended"] = "aborted"

    waiter = threading.Thread(target=reduce, name="gsync-test-reduce")
    waiter.start()
    waiter.join(0.3)
    outcome["blocked"] = waiter.is_alive()
    abort.set()
    started = time.monotonic()
    waiter.join(5)
    outcome["left_after_s"] = time.monotonic() - started
    outcome["still_inside"] = waiter.is_alive()
    session.store.set("rank 0 left the reduction", "1")
    return outcome


@pytest.mark.timeout(60)
def test_a_thread_waiting_on_a_peer_leaves_the_collective_on_abort_and_the_process_exits_cleanly() -> None:
    # check=True also requires exit status 0: a thread left inside a gloo wait
    # used to abort the interpreter during shutdown.
    rank0, _ = run_ranks(abandoned_reduction, 2, timeout=40, check=True)
    assert rank0.value["blocked"] and rank0.value["ended"] == "aborted", rank0.value
    assert not rank0.value["still_inside"] and rank0.value["left_after_s"] < 1.0, rank0.value
