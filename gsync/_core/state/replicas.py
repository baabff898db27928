"""Building what each device trains: its replica, optimizer, LR scheduler and GradScaler, fresh or resumed."""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...checkpoint import Checkpoint
from ..step.context import Recipe
from ..devices import DeviceSpec
from ...errors import ConfigError, InputTypeError

__all__ = ("Replica", "copy_replicas", "equip_replicas", "import_optimizer_machinery", "trainable")


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@dataclass
class Replica:
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None


def import_optimizer_machinery() -> None:
    """What the first optimizer a process builds imports: ``torch._dynamo``, about a second. Blocking: in a thread."""
    importlib.import_module("torch._dynamo")


def copy_replicas(model: nn.Module, devices: Sequence[DeviceSpec], resume: Checkpoint | None) -> list[nn.Module]:
    """One copy of ``model`` per device (with ``resume``'s weights): the heavy, copying half, for a thread.

    It also makes the import that building the first optimizer would make on
    the event loop, where the user's factories run (:func:`import_optimizer_machinery`).

    Modes are kept as given (a frozen BatchNorm in eval mode stays so), as DDP does.

    :raises ~gsync.ConfigError: when the model cannot be copied, or has a post-accumulate-grad hook.
    """
    _refuse_post_accumulate_hooks(model)
    import_optimizer_machinery()
    modules = []
    for spec in devices:
        module = _copy_model(model).to(spec.torch_device)
        _carry_parameter_extras(model, module)
        if resume is not None:
            module.load_state_dict(resume.model_state)
        modules.append(module)
    return modules


def equip_replicas(modules: Sequence[nn.Module], devices: Sequence[DeviceSpec], recipe: Recipe, resume: Checkpoint | None) -> list[Replica]:
    """Each copy's optimizer, scheduler and scaler, built by the user's factories where the user's code runs.

    :raises ~gsync.InputTypeError: when a factory returns the wrong type.
    :raises ~gsync.ConfigError: when the optimizer was built over other parameters, or a checkpoint's optimizer
        state does not fit it.
    """
    replicas = []
    for spec, module in zip(devices, modules):
        optimizer = _build_optimizer(recipe, module)
        scheduler = _build_scheduler(recipe, optimizer)
        scaler = torch.amp.GradScaler(spec.torch_device.type) if recipe.scales_loss else None
        if resume is not None:
            # load_state_dict keeps tensors that need no cast as they are:
            # without a copy, every replica would step one shared momentum buffer.
            try:
                optimizer.load_state_dict(copy.deepcopy(resume.optimizer_state))
            except ValueError as error:
                # The model's keys and shapes fit (checked up front), its trainable parameters do not.
                raise ConfigError(
                    f"the checkpoint's optimizer state (step {resume.step}) does not fit this optimizer: {error}; "
                    "resume with the parameters that required grad, and the optimizer's parameter groups, "
                    "as when it was taken"
                ) from error
            if scheduler is not None and resume.scheduler_state is not None:
                scheduler.load_state_dict(copy.deepcopy(resume.scheduler_state))
            if scaler is not None and resume.scaler_state is not None:
                scaler.load_state_dict(copy.deepcopy(resume.scaler_state))
        replicas.append(Replica(module, optimizer, scheduler, scaler))
    return replicas


def _copy_model(model: nn.Module) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as error:
        raise ConfigError(
            f"the model cannot be copied ({type(error).__name__}: {error}); gsync trains a copy of it on each device "
            "(copy.deepcopy), so keep what cannot be copied (a lock, an open file, a client) out of the module, "
            "or give its class a __deepcopy__"
        ) from error


def _carry_parameter_extras(model: nn.Module, replica: nn.Module) -> None:
    """Give each replica parameter its original's gradient hooks and Python attributes.

    ``Parameter.__deepcopy__`` copies data and ``requires_grad`` only. A hook
    that masks or clamps a gradient (``p.register_hook``) would silently stop
    working, and a flag that an optimizer factory groups by
    (``p._no_weight_decay = True``) would be missing, where DDP, which
    wraps the user's own module, keeps both. Hooks are shared, not copied:
    they are the user's functions, as in a plain loop. Attributes are
    copied shallowly, as flags and small dicts are.
    """
    for original, copied in zip(model.parameters(), replica.parameters()):
        for hook in (original._backward_hooks or {}).values():
            copied.register_hook(hook)
        for name, value in vars(original).items():
            if name not in vars(copied):
                setattr(copied, name, value)


def _refuse_post_accumulate_hooks(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise ConfigError(
                f"parameter {name} has a post-accumulate-grad hook (an optimizer step in backward?); gsync "
                "synchronizes every gradient and then steps each replica's optimizer itself, so that hook would "
                "see an unsynchronized gradient: remove it and pass the optimizer as optimizer="
            )


def _build_optimizer(recipe: Recipe, replica: nn.Module) -> torch.optim.Optimizer:
    optimizer = recipe.optimizer(trainable(replica))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer(params) returned a {type(optimizer).__name__}; it must return a torch.optim.Optimizer")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ConfigError(
            "SparseAdam steps sparse gradients only, and gsync reduces every gradient densely; use Adam or AdamW "
            "(with nn.Embedding(sparse=False))"
        )
    own = {id(p) for p in replica.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in own:
                raise ConfigError(
                    "the optimizer factory built an optimizer over parameters it was not given (often "
                    "`lambda params: SGD(model.parameters(), ...)`); build it over the params argument"
                )
    return optimizer


def _build_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer) -> Any:
    if recipe.scheduler is None:
        return None
    scheduler = recipe.scheduler(optimizer)
    if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
        raise InputTypeError(
            f"scheduler(optimizer) returned a {type(scheduler).__name__}; it must return an LR scheduler "
            "(with step() and state_dict()), e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)"
        )
    try:
        required = [
            p for p in inspect.signature(scheduler.step).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        required = []
    if required:
        raise InputTypeError(
            f"{type(scheduler).__name__}.step() needs an argument ({required[0].name}), and gsync steps the scheduler "
            "with none after every step; for a metric-driven schedule such as ReduceLROnPlateau, leave scheduler= "
            "out and build one over each of session.optimizers, stepped from your loop"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigError(
            "the scheduler factory built a scheduler over another optimizer; build it over the optimizer it is given"
        )
    return scheduler
