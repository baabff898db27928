"""Which threads run the devices' jobs: one per device, or one that a process's CPU devices share.

On a shared thread the devices take turns, so a device's job may wait behind another's. Waiting there is
neither a stall nor a timeout of its own: deadlines count a device's own work, and a timeout names the device
that holds the others up.
"""

from __future__ import annotations

import copy
import threading
import time

import anyio
import pytest
import torch

import gsync
import gsync.testing
from gsync.distributed.heartbeat import Whereabouts
from conftest import TiedNet, assert_same_state, classification_loss, make_batches, sgd, train_reference

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def test_cpu_devices_get_a_thread_each_while_each_has_a_core_and_share_one_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    two = gsync.Engine(["cpu:0", "cpu:1"])
    assert two.device_threads == "per_device" and two.intra_op_threads() == 1
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"]).device_threads == "shared"
    assert gsync.Engine(["cpu:0", "cpu:1"], device_threads="shared").intra_op_threads() is None
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"], device_threads="per_device").intra_op_threads() == 1
    assert gsync.Engine(["cpu"]).device_threads == "per_device"  # nothing to share
    assert gsync.Engine(["cpu"]).intra_op_threads() is None  # nor anything to split
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert gsync.Engine(["cpu:0", "cpu:1", "cpu:2"]).intra_op_threads() == 2


@pytest.mark.asyncio
async def test_cpu_device_threads_split_the_cores_and_leave_later_threads_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each device thread and the communication thread run torch on their share of the cores; a thread started
    after the session gets the count it would have had without it."""
    seen: dict[str, int] = {}

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen[threading.current_thread().name] = torch.get_num_threads()
        return classification_loss(model, batch)

    reduce = gsync.LocalCollective.all_reduce_each

    def all_reduce_each(self: gsync.LocalCollective, *args: object) -> None:
        seen[threading.current_thread().name] = torch.get_num_threads()
        reduce(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gsync.LocalCollective, "all_reduce_each", all_reduce_each)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        engine = gsync.Engine(["cpu:0", "cpu:1"], device_threads="per_device")
        await engine.fit(TiedNet(), make_batches(2, 12), optimizer=sgd, loss_fn=loss_fn)
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen == {"gsync-device-0": 2, "gsync-device-1": 2, "gsync-comm": 2}
    assert later == [4]


def test_a_device_threads_setting_that_does_not_exist_is_refused() -> None:
    with pytest.raises(gsync.ConfigError, match="'auto', 'shared' or 'per_device'"):
        gsync.Engine(["cpu"], device_threads="one")  # type: ignore[arg-type]


def test_cuda_devices_never_share_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(gsync.ConfigError, match="cuda:0, cuda:1 each need their own thread"):
        gsync.Engine(["cuda:0", "cuda:1"], device_threads="shared")
    assert gsync.Engine(["cuda:0", "cuda:1"]).device_threads == "per_device"


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
    # The reduction is the same computation either way: bit for bit the same parameters.
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
    engine.site_hooks.append(take_time)
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
                where = session._whereabouts()  # noqa: SLF001 - what the heartbeat thread reads
                flags = {actor.name: (actor.queued, actor.waiting) for actor in session._actors}  # noqa: SLF001
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
