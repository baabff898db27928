"""Module buffers put back as a step left them, for replicas kept across an elastic membership change."""

from __future__ import annotations

import torch
from torch import nn

from gsync.comm.local import LocalCollective
from gsync._core.gradients.buffers import BufferSync


def replicas() -> list[nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    second = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    second.load_state_dict(first.state_dict())
    return [first, second]


def test_running_statistics_an_interrupted_forward_moved_are_put_back_as_the_step_left_them() -> None:
    modules = replicas()
    sync = BufferSync(modules)
    for module in modules:
        module(torch.randn(8, 3))
    sync.broadcast(LocalCollective(2), step=3)
    as_of_step_3 = {name: value.clone() for name, value in modules[0].state_dict().items() if "running" in name or "num_batches" in name}
    # Step 4's forward ran on both replicas, then the step was interrupted.
    for module in modules:
        module(torch.randn(8, 3) * 5)
    assert not torch.equal(modules[0][1].running_mean, as_of_step_3["1.running_mean"])
    snapshot = sync.restore(3)
    for module in modules:
        for name, value in as_of_step_3.items():
            assert torch.equal(module.state_dict()[name], value), name
    # The next session's own BufferSync is seeded with them: a checkpoint of its interrupted first step holds them.
    following = BufferSync(modules)
    following.seed(3, snapshot)
    assert following.snapshot(3) is snapshot


def test_buffers_no_step_moved_are_left_as_they_are_and_copied() -> None:
    modules = replicas()
    sync = BufferSync(modules)
    before = modules[0][1].running_var.clone()
    copy = sync.restore(7)  # no step 7 kept: the session ended cleanly, nothing moved them since
    assert torch.equal(copy["1.running_var"], before)
    assert copy["1.running_var"].data_ptr() != modules[0][1].running_var.data_ptr()
