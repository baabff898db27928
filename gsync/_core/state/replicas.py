"""Building what each device trains: its replica, optimizer, LR scheduler and GradScaler, fresh or resumed."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ...checkpoint import Checkpoint, _class_name
from ..step.context import Recipe
from ..devices import DeviceSpec
from ...errors import ConfigError, InputTypeError

__all__ = ("Replica", "copy_replicas", "equip_replicas", "import_optimizer_machinery", "optimizer_input", "trainable")


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
    first_output: list[str] = []
    for spec, module in zip(devices, modules):
        with _printed_once(first_output):
            optimizer = _build_optimizer(recipe, module)
            scheduler = _build_scheduler(recipe, optimizer)
        scaler = torch.amp.GradScaler(spec.torch_device.type) if recipe.scales_loss else None
        if resume is not None:
            _load_optimizer_state(optimizer, resume)
            if scheduler is not None and resume.scheduler_state is not None:
                scheduler.load_state_dict(copy.deepcopy(resume.scheduler_state))
            if scaler is not None and resume.scaler_state is not None:
                scaler.load_state_dict(copy.deepcopy(resume.scaler_state))
        replicas.append(Replica(module, optimizer, scheduler, scaler))
    return replicas


@contextmanager
def _printed_once(first_output: list[str]) -> Iterator[None]:
    """What the factories print, printed for the first replica only (or where a replica's differs).

    The factories run once per replica, and a recipe's own ``configure_optimizers`` reports its groups with
    ``print``: N devices would print it N times, where a plain loop prints it once.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        printed = captured.getvalue()
        if not first_output:
            first_output.append(printed)
            sys.stdout.write(printed)
        elif printed != first_output[0]:
            sys.stdout.write(printed)


def _load_optimizer_state(optimizer: torch.optim.Optimizer, resume: Checkpoint) -> None:
    """``resume``'s optimizer state into ``optimizer``, refused as the session opens when it is another optimizer's.

    :raises ~gsync.ConfigError: naming both, for a checkpoint of another optimizer class, or one whose parameter
        groups lack what this optimizer steps with (its ``defaults``), which torch would otherwise find only as a
        ``KeyError`` in the first step, inside a worker.
    """
    built = _class_name(type(optimizer))
    taken = resume.optimizer_class
    to_change = (
        "resume with the optimizer the checkpoint was taken with; to change optimizers, load only its weights "
        "(model.load_state_dict(checkpoint.model_state)) and start without resume="
    )
    if taken is not None and taken != built:
        raise ConfigError(
            f"the checkpoint (step {resume.step}) holds the state of optimizer {_short(taken)}, and the optimizer "
            f"factory built {_short(built)}: {to_change}"
        )
    try:
        # load_state_dict keeps tensors that need no cast as they are:
        # without a copy, every replica would step one shared momentum buffer.
        optimizer.load_state_dict(copy.deepcopy(resume.optimizer_state))
    except ValueError as error:
        # The model's keys and shapes fit (checked up front), its trainable parameters do not.
        raise ConfigError(
            f"the checkpoint's optimizer state (step {resume.step}) does not fit this optimizer: {error}; "
            "resume with the parameters that required grad, and the optimizer's parameter groups, "
            "as when it was taken"
        ) from error
    except KeyError as error:
        # Raised by the optimizer's own __setstate__ as it reads a state entry another optimizer does not keep
        # (Adam's "step" in SGD's momentum state); from None: torch's frames say less than the message does.
        groups = resume.optimizer_state.get("param_groups", [])
        raise ConfigError(_another_optimizers_state(optimizer, resume, groups, to_change, error.args[0])) from None
    # A loaded group's hyperparameters are the checkpoint's; torch fills in those newer versions added
    # (foreach, fused, ...), so what is still missing is another optimizer's.
    if any(set(optimizer.defaults) - set(group) for group in optimizer.param_groups):
        raise ConfigError(_another_optimizers_state(optimizer, resume, optimizer.param_groups, to_change))


def _another_optimizers_state(
    optimizer: torch.optim.Optimizer, resume: Checkpoint, groups: Sequence[dict[str, Any]], to_change: str,
    missing_entry: object = None,
) -> str:
    """Why ``resume``'s optimizer state is not ``optimizer``'s: what its parameter groups (or state) lack, and what
    they hold."""
    saved = set().union(*(set(group) for group in groups)) if groups else set()
    missing = sorted(set(optimizer.defaults) - saved)
    held = sorted(saved - set(optimizer.defaults) - {"params", "param_names", "initial_lr"})
    if missing:
        lacks = f"its parameter groups have no {', '.join(missing)}" + (f" (they hold {', '.join(held)})" if held else "")
    else:
        lacks = f"its per-parameter state has no {missing_entry!r}"
    return (
        f"the checkpoint (step {resume.step}) holds another optimizer's state than the {type(optimizer).__name__} "
        f"the optimizer factory built: {lacks}; {to_change}"
    )


def _short(qualified: str) -> str:
    return qualified.rsplit(".", 1)[-1]


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


OptimizerInput = Literal["params", "named_parameters", "module"]

_MODULE_NAMES = ("model", "module")
_NAMED_NAMES = ("named_parameters", "named_params")


def optimizer_input(factory: Callable[..., Any]) -> OptimizerInput:
    """What the optimizer factory is called with, read from the name of its first parameter.

    ``model`` or ``module``: the replica itself (``lambda model: model.configure_optimizers(...)``);
    ``named_parameters`` or ``named_params``: the replica's trainable ``(name, parameter)`` pairs; any other
    name (``params``, an optimizer class's own ``params``), or no signature to read: the trainable parameters.

    Decided by the name, not by trying: a factory may print or allocate, so it is called once per replica and
    never on a guess. The name is what the docs already write (``lambda params: ...``), so every factory
    written before keeps getting what it got.
    """
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return "params"
    if not parameters or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY, parameters[0].POSITIONAL_OR_KEYWORD):
        return "params"
    name = parameters[0].name
    if name in _MODULE_NAMES:
        return "module"
    if name in _NAMED_NAMES:
        return "named_parameters"
    return "params"


def _build_optimizer(recipe: Recipe, replica: nn.Module) -> torch.optim.Optimizer:
    given = optimizer_input(recipe.optimizer)
    argument: Any
    if given == "module":
        argument = replica
    elif given == "named_parameters":
        argument = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
    else:
        argument = trainable(replica)
    try:
        optimizer = recipe.optimizer(argument)
    except AttributeError as error:
        if given == "module" or getattr(error, "obj", None) is not argument:
            raise
        # A factory that wanted the module (`lambda m: m.configure_optimizers(...)`) and was given the list.
        raise InputTypeError(
            f"the optimizer factory was called with the list of the replica's parameters and asked it for "
            f"{error.name!r} ({error}); gsync passes the replica itself when the factory's first parameter is named "
            "model or module: write optimizer=lambda model: model.configure_optimizers(...)"
        ) from error
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer(params) returned a {type(optimizer).__name__}; it must return a torch.optim.Optimizer")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ConfigError(
            "SparseAdam steps sparse gradients only, and gsync reduces every gradient densely; use Adam or AdamW "
            "(with nn.Embedding(sparse=False))"
        )
    _refuse_closure_optimizers(optimizer)
    own = {id(p): name for name, p in replica.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = own.get(id(param))
            if name is None:
                raise ConfigError(
                    "the optimizer factory built an optimizer over parameters it was not given (often "
                    "`lambda params: SGD(model.parameters(), ...)`, or optimizer=model.configure_optimizers): build "
                    "it over the params argument, or name the factory's first parameter model to be given the "
                    "replica (optimizer=lambda model: model.configure_optimizers(...))"
                )
            if not param.requires_grad:
                # gsync synchronizes the gradients of trainable parameters only (the flat form never passes others).
                raise ConfigError(
                    f"the optimizer factory put parameter {name}, which does not require grad, in the optimizer; "
                    "gsync synchronizes and steps only parameters that require grad: leave it out "
                    "(e.g. [p for p in model.parameters() if p.requires_grad])"
                )
    return optimizer


def _refuse_closure_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose ``step`` needs a closure (LBFGS) cannot take gsync's one step from a reduced gradient."""
    try:
        required = [
            p for p in inspect.signature(optimizer.step).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    if required:
        kind = type(optimizer).__name__
        raise ConfigError(
            f"{kind}.step() needs a {required[0].name}: {kind} reevaluates the loss through it, several times per "
            "step, and gsync steps the optimizer once per step from the gradient reduced over every device, with no "
            "closure: use an optimizer that steps from the gradient (SGD, Adam, AdamW, ...), or train with "
            f"{kind} in a plain loop"
        )


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
