"""Epochs and samplers: a ``DistributedSampler`` reshuffles each epoch, as in a plain loop, across resumes too."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gsync
import gsync.testing
from tests.support.models import TWO, TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state

pytestmark = pytest.mark.asyncio


class _IndexedRows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset that logs which rows are read, in the order they are."""

    def __init__(self, rows: int) -> None:
        self.x, self.y = make_batches(1, rows)[0]
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(index)
        return self.x[index], self.y[index]


def _shuffled_loader(rows: int) -> torch.utils.data.DataLoader[Any]:
    dataset = _IndexedRows(rows)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)


async def test_a_distributed_sampler_reshuffles_each_epoch_as_in_a_plain_loop() -> None:
    # A plain loop calls sampler.set_epoch(epoch) before each epoch (DistributedSampler's docs); fit does it too,
    # as Lightning and Accelerate do, so the recipe the README gives for process-local data shuffles per epoch.
    plain = _shuffled_loader(16)
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for _ in plain:
            pass
    loader = _shuffled_loader(16)
    await gsync.Engine(TWO).fit(TiedNet(), loader, optimizer=sgd, loss_fn=classification_loss, epochs=3)
    assert loader.dataset.read == plain.dataset.read  # type: ignore[attr-defined]
    epochs = [plain.dataset.read[i * 16 : (i + 1) * 16] for i in range(3)]  # type: ignore[attr-defined]
    assert epochs[0] != epochs[1] != epochs[2]


async def test_a_loop_that_sets_the_epoch_itself_and_fits_one_epoch_at_a_time_keeps_its_numbering() -> None:
    plain, loader = _shuffled_loader(16), _shuffled_loader(16)
    engine = gsync.Engine(TWO)
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for _ in plain:
            pass
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        await engine.fit(TiedNet(), loader, optimizer=sgd, loss_fn=classification_loss, epochs=1)
    assert loader.dataset.read == plain.dataset.read  # type: ignore[attr-defined]


async def test_a_run_resumed_in_a_later_epoch_reads_that_epochs_shuffle(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    args: dict[str, Any] = dict(optimizer=sgd, loss_fn=classification_loss, epochs=3)
    whole = await gsync.Engine(TWO).fit(copy.deepcopy(model), _shuffled_loader(16), **args)
    loader = _shuffled_loader(16)
    first = await gsync.Engine(TWO).fit(copy.deepcopy(model), loader, **{**args, "epochs": 2})
    # In the same process (a notebook resuming after a failure) the sampler is left at epoch 1: the resumed run
    # replays the run's epochs from 0, as the checkpoint counts them.
    resumed = await gsync.Engine(TWO).fit(copy.deepcopy(model), loader, resume=first.checkpoint, **args)
    assert resumed.first_step == 8
    assert_same_state(resumed.model, whole.model, atol=0)
