"""Which threads run the devices' jobs: one per device, or one that a process's CPU devices share.

On a shared thread the devices take turns, so a device's job may wait behind another's. Waiting there is
neither a stall nor a timeout of its own: deadlines count a device's own work, and a timeout names the device
that holds the others up.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

import gsync
import gsync.testing
from gsync._core.threads import THREADS_PER_THREAD
from gsync._core.distributed.heartbeat import Whereabouts
from tests.support.inside import device_flags, heartbeat_whereabouts, pretend_torch_threads_split_per_thread, site_hooks_of
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def test_cpu_devices_get_a_thread_each_while_each_has_a_core_and_share_one_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    pretend_torch_threads_split_per_thread(monkeypatch, True)  # as under OpenMP, whatever this build's backend
    two = gsync.Engine(["cpu:0", "cpu:1"])
    assert two.device_threads == "per_device" and two.intra_op_threads == (1, 1)
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"]).device_threads == "shared"
    assert gsync.Engine(["cpu:0", "cpu:1"], device_threads="shared").intra_op_threads is None
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], device_threads="per_device").intra_op_threads == (1, 1)
    assert gsync.Engine(["cpu"]).device_threads == "per_device"  # nothing to share
    assert gsync.Engine(["cpu"]).intra_op_threads is None  # nor anything to split
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"]).intra_op_threads == (2, 2)  # the reduction gets what is left
    assert gsync.Engine(["cpu:0", "cpu:1"]).intra_op_threads == (4, 1)
    # Where torch's threads cannot be split per thread (its native backend), CPU devices share one thread.
    pretend_torch_threads_split_per_thread(monkeypatch, False)
    assert gsync.Engine(["cpu:0", "cpu:1"]).device_threads == "shared"
    assert gsync.Engine(["cpu"]).device_threads == "per_device"
    assert gsync.Engine(["cpu:0", "cpu:1"], device_threads="per_device").intra_op_threads is None


async def _torch_threads_seen(engine: gsync.Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``torch.get_num_threads()`` as each of gsync's device threads and its communication thread saw it in a fit."""
    seen: dict[str, int] = {}

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen[threading.current_thread().name] = torch.get_num_threads()
        return classification_loss(model, batch)

    reduce = gsync.LocalCollective.all_reduce_each

    def all_reduce_each(self: gsync.LocalCollective, *args: object) -> None:
        seen[threading.current_thread().name] = torch.get_num_threads()
        reduce(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gsync.LocalCollective, "all_reduce_each", all_reduce_each)
    await engine.fit(TiedNet(), make_batches(2, 12), optimizer=sgd, loss_fn=loss_fn)
    return seen


def _count_a_new_thread_starts_with() -> int:
    counts: list[int] = []
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return counts[0]


@pytest.fixture
def four_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.asyncio
@pytest.mark.skipif(not THREADS_PER_THREAD, reason="torch's parallel backend is not OpenMP: no per-thread counts")
async def test_cpu_device_threads_split_the_cores_and_leave_other_threads_their_count(
    four_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each device thread runs torch on its share of the cores and the communication thread on what is left; the
    thread that ran the fit keeps its count, and a thread started after the fit gets the count it would have had."""
    seen = await _torch_threads_seen(gsync.Engine(["cpu:0", "cpu:1"], device_threads="per_device"), monkeypatch)
    assert seen == {"gsync-device-0": 2, "gsync-device-1": 2, "gsync-comm": 1}
    assert torch.get_num_threads() == 4
    assert _count_a_new_thread_starts_with() == 4


@pytest.mark.asyncio
@pytest.mark.skipif(not THREADS_PER_THREAD, reason="torch's parallel backend is not OpenMP: no per-thread counts")
async def test_threads_that_do_not_split_the_cores_run_with_the_count_of_the_thread_that_opened_the_session(
    four_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As another session's device threads do, a thread setting its own count sets the one new threads start with;
    gsync's threads of this session still run with this thread's."""
    setter = threading.Thread(target=torch.set_num_threads, args=(1,))
    setter.start()
    setter.join()
    assert _count_a_new_thread_starts_with() == 1 and torch.get_num_threads() == 4
    seen = await _torch_threads_seen(gsync.Engine(["cpu:0", "cpu:1"], device_threads="shared"), monkeypatch)
    assert seen == {"gsync-devices": 4, "gsync-comm": 4}


@pytest.mark.asyncio
async def test_shared_and_per_device_threads_train_the_same_replicas() -> None:
    batches = make_batches(4, 12)
    torch.manual_seed(0)
    model = TiedNet()
    expected, _ = train_reference(copy.deepcopy(model), batches)
    trained = {}
    for setting in ("shared", "per_device"):
        replica = copy.deepcopy(model)
        engine = gsync.Engine(DEVICES, first_bucket_mb=0.001, bucket_cap_mb=0.002, device_threads=setting)  # type: ignore[arg-type]
        await engine.fit(replica, batches, optimizer=sgd, loss_fn=classification_loss)
        assert_same_state(replica, expected)
        trained[setting] = replica
    # The reduction is the same computation either way, and this model's kernels are too small for torch to split
    # over threads (whose rounding can depend on their count): bit for bit the same parameters.
    for name, value in trained["shared"].state_dict().items():
        assert torch.equal(value, trained["per_device"].state_dict()[name]), name


@pytest.mark.asyncio
async def test_devices_taking_turns_each_get_the_whole_timeout() -> None:
    """Each device's forward and optimizer step take 0.4 s of the 1 s timeout; three in turn take 1.2 s."""
    slow: list[tuple[int, str]] = []

    def take_time(device: int, step: int, site: str, abort: threading.Event) -> None:
        if step == 1 and site in ("forward", "optimizer"):
            slow.append((device, site))
            time.sleep(0.4)  # the device's own work, not a wait for anything

    engine = gsync.Engine(DEVICES, sync_timeout=1.0, device_threads="shared")
    site_hooks_of(engine).append(take_time)
    result = await engine.fit(TiedNet(), make_batches(3, 12), optimizer=sgd, loss_fn=classification_loss)
    assert len(result.losses) == 3
    assert sorted(slow) == sorted((device, site) for device in range(3) for site in ("forward", "optimizer"))


@pytest.mark.asyncio
@pytest.mark.parametrize("site", ["forward", "backward", "optimizer"])
async def test_a_stall_names_the_device_that_holds_the_thread_not_those_queued_behind_it(
    site: str, no_leaks: None
) -> None:
    engine = gsync.Engine(DEVICES, sync_timeout=0.3, device_threads="shared")
    fault = gsync.testing.stall(device=0, step=2, site=site)  # type: ignore[arg-type]
    with gsync.testing.inject(engine, fault), pytest.raises(gsync.SyncTimeout) as caught:
        await engine.fit(TiedNet(), make_batches(4, 12), optimizer=sgd, loss_fn=classification_loss)
    error = caught.value
    assert error.stalled_devices == ("cpu:0",)
    assert "cpu:1" not in str(error) and "cpu:2" not in str(error)
    if site != "optimizer":
        assert error.step == 2 and {device for device, _ in error.missing} == {"cpu:0"}
        assert error.last_seen == {"cpu:0": f"step 2, {site}"}


async def _seen_during_a_stall(device: int, site: str) -> tuple[Whereabouts, dict[str, tuple[bool, bool]]]:
    """The heartbeat's whereabouts and each device's (queued, waiting) while ``device`` stalls at ``site`` of step 1
    on the thread the devices share."""
    engine = gsync.Engine(DEVICES, device_threads="shared")
    fault = gsync.testing.stall(device=device, step=1, site=site)
    with gsync.testing.inject(engine, fault):
        async with engine.session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
            first, second = make_batches(2, 12)
            await session.step(first)
            async with anyio.create_task_group() as group:
                group.start_soon(session.step, second)
                assert await anyio.to_thread.run_sync(fault.reached.wait, 10)
                where = heartbeat_whereabouts(session)
                flags = device_flags(session)
                group.cancel_scope.cancel()
    return where, flags


@pytest.mark.asyncio
async def test_the_heartbeat_reports_the_device_that_holds_the_thread() -> None:
    """A rank's heartbeat names its furthest-behind device that is not waiting; one queued behind a stall waits."""
    where, flags = await _seen_during_a_stall(device=0, site="forward")
    assert where == Whereabouts(1, "forward", "cpu:0")
    assert {name: queued for name, (queued, _) in flags.items()} == {"cpu:0": False, "cpu:1": True, "cpu:2": True}


@pytest.mark.asyncio
async def test_a_device_whose_backward_ended_waits_while_its_report_is_held_behind_the_next_device() -> None:
    """Its job's end reaches the loop only with the next devices' (one wake-up for the burst): meanwhile the
    heartbeat must count it as waiting for the sync, not name it as the device furthest behind."""
    where, flags = await _seen_during_a_stall(device=1, site="backward")
    assert where == Whereabouts(1, "backward", "cpu:1")
    assert {name: waiting for name, (_, waiting) in flags.items()} == {"cpu:0": True, "cpu:1": False, "cpu:2": True}
