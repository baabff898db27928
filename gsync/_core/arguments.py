"""The checks of what users pass to ``Engine.session`` and ``Engine.fit``, each raised before any work starts.

Each error says what gsync calls and what to pass instead, since the error
the argument would otherwise cause comes from deep inside a session's start
(or from every device at step 0) and never names the argument.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint import Checkpoint
from ..errors import ConfigError, InputTypeError
from .state.checkpointing import resolve_resume
from .devices import plan_device_threads
from .batchnorm import has_sync_batchnorm
from .step.context import Recipe

if TYPE_CHECKING:
    from .settings import EngineSettings

__all__ = ("checked_recipe", "positive", "resume_argument", "settings_for_model")

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def positive(name: str, value: object) -> float:
    """``value`` as a float. :raises ~gsync.ConfigError: unless it is a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def resume_argument(resume: object, checkpoint_dir: object = None) -> Checkpoint | None:
    """The checkpoint ``resume=`` names (a file, the newest in a directory), or ``None``."""
    if resume is None or isinstance(resume, (Checkpoint, str, os.PathLike)):
        directory = checkpoint_dir if isinstance(checkpoint_dir, (str, os.PathLike)) else None
        return resolve_resume(resume, directory)  # type: ignore[arg-type]
    raise InputTypeError(
        f"resume must be a gsync.Checkpoint, a checkpoint file or a checkpoint directory, got {type(resume).__name__}"
    )


def checked_recipe(
    model: object,
    optimizer: object,
    loss_fn: object,
    scheduler: object,
    clip_grad_norm: object,
    autocast: object,
    resume: object,
) -> Recipe:
    """Check the arguments a session and a fit share, and bundle the recipe.

    :raises ~gsync.InputTypeError: or :class:`~gsync.ConfigError`, naming what to change.
    """
    _check_model(model)
    _check_optimizer(optimizer)
    _check_loss_fn(loss_fn, model)
    _check_scheduler(scheduler)
    if isinstance(clip_grad_norm, float) and clip_grad_norm == math.inf:
        # Every step's grad_norm with nothing clipped: the gradient is multiplied by exactly 1.0. Not the default
        # without clip_grad_norm, as it costs a pass over every gradient per step (and a collective, sharded).
        pass
    elif clip_grad_norm is not None:
        clip_grad_norm = positive("clip_grad_norm", clip_grad_norm)
    if autocast is not None and autocast not in _AUTOCAST_DTYPES:
        raise ConfigError(f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast!r}")
    if resume is not None and not isinstance(resume, Checkpoint):
        raise InputTypeError(
            f"resume must be a gsync.Checkpoint (an error's, a result's, or Checkpoint.load(path)), got {type(resume).__name__}"
        )
    if resume is not None:
        resume.check_fits(model)  # type: ignore[arg-type]  # checked to be a Module above
    return Recipe(
        loss_fn=loss_fn,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        scheduler=scheduler,  # type: ignore[arg-type]
        clip_grad_norm=clip_grad_norm,  # type: ignore[arg-type]
        autocast=autocast,  # type: ignore[arg-type]
    )


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    # Each replica is a copy moved onto its device, and a meta tensor has a shape but no data to move: torch's own
    # "Cannot copy out of meta tensor" would come from deep inside the session's start.
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                raise ConfigError(
                    f"{kind} {name} is on the meta device (a shape with no data), so there is nothing to copy onto "
                    "each device: materialize the model first, e.g. model.to_empty(device='cpu') and then "
                    "initialize it (model.load_state_dict(state) or each layer's reset_parameters()), "
                    "or build it on a real device"
                )


def _check_optimizer(optimizer: object) -> None:
    forms = (
        "e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1), or, to group parameters by name or by "
        "module, optimizer=lambda model: model.configure_optimizers(...) (a first parameter named model or module "
        "is given the replica, one named named_parameters its (name, parameter) pairs)"
    )
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a factory, called once per replica with that replica's parameters, {forms}")
    try:
        inspect.signature(optimizer).bind(None)
    except TypeError as error:
        raise InputTypeError(f"optimizer cannot be called with one argument ({error}): {forms}") from None
    except ValueError:
        pass  # no signature to read (a builtin): building it will tell


def _check_loss_fn(loss_fn: object, model: object) -> None:
    if not callable(loss_fn):
        raise InputTypeError("loss_fn must be callable as loss_fn(model, shard) -> scalar tensor")
    # torch's losses take (input, target): passed as loss_fn they would fail on every device at step 0 with
    # "argument 'input' must be Tensor, not Sequential", which never says what gsync calls.
    calls = "gsync calls loss_fn(model, batch) with each device's replica and its shard of the batch"
    wrap = (
        f"{calls}; wrap the loss, e.g. criterion = nn.CrossEntropyLoss(); "
        "loss_fn=lambda model, batch: criterion(model(batch[0]), batch[1])"
    )
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise InputTypeError(f"loss_fn is the class {loss_fn.__name__}, not a loss function; {wrap}")
    if isinstance(loss_fn, nn.modules.loss._Loss):
        raise InputTypeError(f"loss_fn is a {type(loss_fn).__name__} module, which takes (input, target); {wrap}")
    if getattr(loss_fn, "__module__", None) == "torch.nn.functional":
        name = getattr(loss_fn, "__name__", "loss")
        raise InputTypeError(f"loss_fn is torch.nn.functional.{name}, which takes (input, target); {wrap}")
    try:
        inspect.signature(loss_fn).bind(model, None)
    except TypeError as error:
        raise InputTypeError(
            f"loss_fn cannot be called as loss_fn(model, batch) ({error}): {calls}, and takes back the shard's mean loss"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): the first step tells


def _check_scheduler(scheduler: object) -> None:
    # A scheduler already built has a step method; so does a scheduler class, which is a factory (LinearLR).
    built = hasattr(scheduler, "step") and not isinstance(scheduler, type)
    if scheduler is not None and (not callable(scheduler) or built):
        raise InputTypeError(
            "scheduler must be a factory, called once per replica with that replica's optimizer, "
            "e.g. scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 10)"
        )
    if isinstance(scheduler, type):
        _check_builds_from_the_optimizer_alone(scheduler)


def _check_builds_from_the_optimizer_alone(scheduler: type) -> None:
    try:
        inspect.signature(scheduler).bind(object())
    except ValueError:
        return  # no signature to read (a builtin): building it will tell
    except TypeError as error:
        name = scheduler.__name__
        raise InputTypeError(
            f"scheduler={name} needs more than the optimizer to build ({error}); give a factory instead, "
            f"e.g. scheduler=lambda optimizer: {name}(optimizer, ...)"
        ) from None


def settings_for_model(settings: EngineSettings, model: nn.Module, asked: str) -> EngineSettings:
    """The settings a session of ``model`` runs with: one thread per device where it holds ``nn.SyncBatchNorm``.

    Devices taking turns on one thread cannot meet inside forward (the
    first would wait for ever for the others), so ``device_threads="auto"``
    gives each device its own thread for such a model.

    :raises ~gsync.ConfigError: for ``device_threads="shared"`` with several devices and a SyncBatchNorm layer.
    """
    if settings.device_threads != "shared" or len(settings.devices) < 2 or not has_sync_batchnorm(model):
        return settings
    if asked == "shared":
        raise ConfigError(
            "the model holds nn.SyncBatchNorm layers, whose devices meet inside every forward and backward, and "
            "device_threads='shared' runs the devices one after another on one thread: use "
            "Engine(device_threads='per_device') (or 'auto'), or convert the layers back to nn.BatchNorm"
        )
    plan = plan_device_threads(settings.devices, "per_device")
    return dataclasses.replace(
        settings,
        device_threads=plan.device_threads,
        intra_op_threads=plan.intra_op_threads,
        devices_in_turn=plan.devices_in_turn,
    )


def check_uneven(uneven: object, process_local_data: object) -> None:
    """:raises ~gsync.ConfigError: for an unknown ``uneven``, or ``"join"`` without process-local data."""
    if uneven not in ("refuse", "join"):
        raise ConfigError(f"uneven must be 'refuse' or 'join', got {uneven!r}")
    if uneven == "join" and not process_local_data:
        raise ConfigError(
            "uneven='join' is for process-local data, where each rank's data may end at a different step: pass "
            "process_local_data=True too (with global data every rank reads the same batches, which end together)"
        )


def uneven_setting(settings: EngineSettings, uneven: object, process_local_data: object) -> EngineSettings:
    """The settings of a session whose ranks' process-local data may end at different steps.

    :raises ~gsync.ConfigError: for an unknown ``uneven``, or ``"join"`` without ``process_local_data=True``.
    """
    check_uneven(uneven, process_local_data)
    return settings if uneven == "refuse" else dataclasses.replace(settings, uneven="join")


def check_shardable(model: nn.Module) -> None:
    """``shard_optimizer=True`` cuts each trainable parameter as a range of its elements, in memory order.

    :raises ~gsync.ConfigError: for a parameter whose elements are not laid out densely in order (a
        ``channels_last`` or transposed one).
    """
    for name, param in model.named_parameters():
        if param.requires_grad and not param.is_contiguous():
            raise ConfigError(
                f"parameter {name} is not contiguous (stride {param.stride()}), and shard_optimizer=True cuts each "
                "parameter as a range of its elements: make it contiguous first (model.to(memory_format="
                "torch.contiguous_format), or param.data = param.data.contiguous()), or drop shard_optimizer="
            )
