"""The state a rank holds between two generations of an elastic run: kept replicas, a checkpoint only on demand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gsync
from gsync._core.state.held import HeldState
from gsync._core.state.replicas import Replica


def stepped_replica() -> Replica:
    module = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    # The next step's backward ran, and its step was interrupted: the gradients are the interrupted step's.
    module(torch.ones(4, 3)).sum().backward()
    return Replica(module, optimizer, None, None)


def test_a_checkpoint_is_taken_only_when_asked_for_and_once() -> None:
    replica = stepped_replica()
    captures = []

    def capture() -> gsync.Checkpoint:
        captures.append(1)
        return gsync.Checkpoint.capture(4, replica.module, replica.optimizer)

    held = HeldState(4, capture, [replica])
    assert captures == [] and held.next_step == 5 and held.has_replicas
    first = held.checkpoint()
    assert held.checkpoint() is first and captures == [1]
    assert first.step == 4


def test_the_next_session_takes_the_replicas_themselves_with_the_interrupted_steps_gradients_dropped() -> None:
    replica = stepped_replica()
    weight = replica.module.weight
    held = HeldState(4, lambda: gsync.Checkpoint.capture(4, replica.module, replica.optimizer), [replica])
    (taken,) = held.take_replicas()
    assert taken is replica and taken.module.weight is weight  # nothing copied
    # A redone step's backward must not add to the interrupted one's gradients.
    assert all(p.grad is None for p in taken.module.parameters())
    assert not held.has_replicas
    with pytest.raises(RuntimeError, match="taken already"):
        held.take_replicas()


def test_a_checkpoint_asked_for_after_the_replicas_moved_on_is_refused_not_wrong() -> None:
    replica = stepped_replica()
    held = HeldState(4, lambda: gsync.Checkpoint.capture(4, replica.module, replica.optimizer), [replica])
    held.take_replicas()
    with pytest.raises(RuntimeError, match="taken before their checkpoint"):
        held.checkpoint()
    # Given back by a session that failed to open (no forward ran): the state is still step 4's.
    assert held.put_back().checkpoint().step == 4
    assert held.has_replicas


def test_a_checkpoint_held_as_it_is_has_no_replicas_and_is_never_copied_again() -> None:
    checkpoint = gsync.Checkpoint.capture(2, nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    held = HeldState.of(checkpoint)
    assert held.step == 2 and not held.has_replicas and held.checkpoint() is checkpoint
