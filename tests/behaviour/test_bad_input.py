"""The bad-input catalogue: each is refused with a typed error that says what to change,
before any optimizer step, leaving the user's model untouched."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gsync
from gsync_pytest import gsync_threads
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.reference import assert_same_state, train_reference

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

BATCHES = make_batches(3, 8)


async def refuse(
    error: type[BaseException],
    match: str,
    *,
    model: nn.Module | None = None,
    data: Any = BATCHES,
    optimizer: Any = sgd,
    loss_fn: Any = classification_loss,
    **fit_kwargs: Any,
) -> BaseException:
    model = model if model is not None else TiedNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match) as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(model, data, optimizer=optimizer, loss_fn=loss_fn, **fit_kwargs)
    # A refusal is gsync's own, typed error, never a builtin raised on the way by chance.
    assert isinstance(caught.value, gsync.GsyncError), repr(caught.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed"
    assert gsync_threads() == []
    return caught.value


async def test_model_with_nothing_to_train() -> None:
    frozen = TiedNet().requires_grad_(False)
    await refuse(gsync.ConfigError, "no parameter that requires grad", model=frozen)


async def test_models_gsync_cannot_copy_or_plan_and_a_sparse_only_optimizer() -> None:
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 5))
    with pytest.raises(gsync.ConfigError, match=r"parameter 0.weight is not initialized yet \(a lazy module"):
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(lazy, BATCHES, optimizer=sgd, loss_fn=classification_loss)

    class Locked(TiedNet):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

    await refuse(gsync.ConfigError, "the model cannot be copied .*cannot pickle '_thread.lock'", model=Locked())
    sparse = lambda params: torch.optim.SparseAdam(params, lr=0.1)  # noqa: E731
    await refuse(gsync.ConfigError, "SparseAdam steps sparse gradients only", optimizer=sparse)


async def test_model_that_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        await gsync.Engine(["cpu"]).fit(lambda x: x, BATCHES, optimizer=sgd, loss_fn=classification_loss)  # type: ignore[arg-type]


async def test_optimizer_not_callable() -> None:
    await refuse(gsync.InputTypeError, "factory", optimizer=torch.optim.SGD(TiedNet().parameters(), lr=0.1))


async def test_optimizer_factory_returning_something_else() -> None:
    await refuse(gsync.InputTypeError, "must return a torch.optim.Optimizer", optimizer=lambda params: params)


async def test_optimizer_over_the_wrong_parameters() -> None:
    other = TiedNet()
    await refuse(gsync.ConfigError, "build it over the params argument", optimizer=lambda _: torch.optim.SGD(other.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda model, batch: 1.0, "returned a float"),
        (lambda model, batch: model(batch[0]), "of shape .* must return a scalar"),
        (lambda model, batch: classification_loss(model, batch).detach(), "does not require grad"),
    ],
    ids=["non-tensor", "non-scalar", "no-grad"],
)
async def test_bad_loss(loss_fn: Callable[..., Any], match: str) -> None:
    error = await refuse(gsync.InputTypeError, match, loss_fn=loss_fn)
    assert isinstance(error, gsync.InputTypeError) and "step 0" in str(error)


async def test_empty_data_is_refused_before_any_work() -> None:
    built: list[int] = []

    def optimizer(params: Any) -> torch.optim.Optimizer:
        built.append(1)
        return sgd(params)

    await refuse(gsync.ConfigError, "no batch", data=[], optimizer=optimizer)
    # The DataLoader whose batch_size exceeds its dataset, with drop_last=True, has no batch either.
    dataset = torch.utils.data.TensorDataset(*make_batches(1, 10)[0])
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, drop_last=True)
    await refuse(gsync.ConfigError, "batch_size larger than its dataset", data=loader, optimizer=optimizer)
    assert built == []


class WithoutLength:
    """Re-iterable data whose length is not known up front (a loader over an iterable dataset)."""

    def __iter__(self) -> Any:
        return iter(BATCHES)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (BATCHES, r"data has 3 batch\(es\) per epoch, fewer than the accumulate=4"),  # before any work
        (WithoutLength(), r"no optimizer step ran: no epoch of data had the accumulate=4 batches"),  # once read
    ],
    ids=["with-a-length", "without-one"],
)
async def test_data_with_fewer_batches_per_epoch_than_a_step_of_accumulate(
    data: Any, match: str, tmp_path: Path
) -> None:
    # Three batches per epoch never fill a step of four: nothing would train, and no file may claim otherwise.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a length, each epoch first warns that its batches are left out
        await refuse(
            gsync.ConfigError, match, data=data, accumulate=4, epochs=2, checkpoint_dir=tmp_path, checkpoint_every=1
        )
    assert list(tmp_path.iterdir()) == []


async def test_data_that_is_a_tensor_a_dict_or_not_iterable() -> None:
    await refuse(gsync.InputTypeError, "single tensor", data=torch.zeros(4, 12))
    await refuse(gsync.InputTypeError, "iterable", data=42)
    # One batch as a dict, not a list of batches: its keys would be read as batches.
    await refuse(gsync.InputTypeError, "data is a dict", data={"x": torch.zeros(4, 12), "y": torch.zeros(4, dtype=torch.long)})


async def test_one_batch_given_as_data_is_refused_before_any_work_with_what_to_pass() -> None:
    x, y = torch.randn(32, 12), torch.randint(0, 5, (32,))
    for one_batch in ((x, y), [x, y]):
        error = await refuse(gsync.InputTypeError, r"tensors of 32 rows each .*: one batch, not an iterable of batches", data=one_batch)
        assert "pass [batch] for one step, or a DataLoader" in str(error)
    # Refused by session.fit too, leaving the session open.
    async with gsync.Engine(["cpu:0", "cpu:1"]).session(TiedNet(), optimizer=sgd, loss_fn=classification_loss) as session:
        with pytest.raises(gsync.InputTypeError, match="one batch"):
            await session.fit((x, y))
        assert (await session.fit([(x, y)])).first_step == 0


async def test_a_list_of_tensor_batches_is_not_taken_for_one_batch() -> None:
    # Each tensor a batch of its own (a loss_fn that takes a tensor): one shape throughout, and a shorter last one.
    def reconstruction(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (model(batch) - batch).pow(2).mean()

    for batches in (list(torch.randn(96, 12).split(32)), list(torch.randn(80, 12).split(32))):
        result = await gsync.Engine(["cpu:0", "cpu:1"]).fit(nn.Linear(12, 12), batches, optimizer=sgd, loss_fn=reconstruction)
        assert len(result.losses) == len(batches)


async def test_one_shot_iterator_over_several_epochs() -> None:
    await refuse(gsync.ConfigError, "one-shot iterator", data=iter(BATCHES), epochs=2)


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ("text", TypeError, "the batch is a str"),
        ((torch.zeros(8, 12), "labels"), TypeError, r"batch\[1\] is a str"),
        ((torch.zeros(8, 12), torch.zeros(7, dtype=torch.long)), gsync.ConfigError, "disagree on their size along dim 0"),
        ((torch.zeros(()),), gsync.ConfigError, "0-d tensor"),
        ((), gsync.ConfigError, "holds no tensor"),
    ],
    ids=["string", "string-leaf", "ragged", "zero-dim", "empty-tuple"],
)
async def test_bad_batches(batch: Any, error: type[BaseException], match: str) -> None:
    await refuse(error, match, data=[batch])


async def test_bad_batch_after_good_ones_is_reported_after_the_good_steps_finish() -> None:
    ragged = (torch.zeros(8, 12), torch.zeros(7, dtype=torch.long))
    model = TiedNet()
    with pytest.raises(gsync.ConfigError, match="step 2") as caught:
        await gsync.Engine(["cpu:0", "cpu:1"]).fit(model, BATCHES[:2] + [ragged], optimizer=sgd, loss_fn=classification_loss)
    assert caught.value.last_step == 1  # the two good steps are kept in the checkpoint
    assert caught.value.checkpoint.step == 1


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True])
async def test_bad_epochs(epochs: Any) -> None:
    await refuse(gsync.ConfigError, "epochs", epochs=epochs)


async def test_bad_resume() -> None:
    await refuse(gsync.InputTypeError, "gsync.Checkpoint", resume={"step": 3})


async def test_bad_engine_options() -> None:
    with pytest.raises(gsync.ConfigError, match="on_nonfinite"):
        gsync.Engine(["cpu"], on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(gsync.ConfigError, match="check_replicas_every"):
        gsync.Engine(["cpu"], check_replicas_every=0)


async def test_batch_smaller_than_the_device_count_is_allowed() -> None:
    # One row on three devices: two devices get an empty shard, and the step is still the whole batch's.
    model = TiedNet()
    batches = make_batches(2, 1)
    expected, expected_losses = train_reference(model, batches)
    result = await gsync.Engine(["cpu:0", "cpu:1", "cpu:2"]).fit(
        copy.deepcopy(model), batches, optimizer=sgd, loss_fn=classification_loss
    )
    assert result.losses == pytest.approx(expected_losses, abs=2e-5)
    assert_same_state(result.model, expected)


async def test_resuming_past_the_end_of_the_data_is_refused() -> None:
    engine = gsync.Engine(["cpu:0", "cpu:1"])
    done = await engine.fit(TiedNet(), BATCHES, optimizer=sgd, loss_fn=classification_loss)
    assert done.checkpoint is not None and done.checkpoint.step == 2
    with pytest.raises(gsync.ConfigError, match="trained nothing"):
        await engine.fit(TiedNet(), BATCHES, optimizer=sgd, loss_fn=classification_loss, resume=done.checkpoint)
    more = await engine.fit(TiedNet(), BATCHES, optimizer=sgd, loss_fn=classification_loss, epochs=2, resume=done.checkpoint)
    assert more.first_step == 3 and len(more.losses) == 3


async def test_replica_check_needs_two_local_devices() -> None:
    with pytest.raises(gsync.ConfigError, match="only one device"):
        gsync.Engine(["cpu"], check_replicas_every=1)


async def test_the_data_is_not_iterated_before_training() -> None:
    class Recording:
        def __init__(self) -> None:
            self.iterations = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.iterations += 1
            return iter(BATCHES)

    data = Recording()
    await gsync.Engine(["cpu:0", "cpu:1"]).fit(TiedNet(), data, optimizer=sgd, loss_fn=classification_loss, epochs=2)
    assert data.iterations == 2  # once per epoch, never for validation
