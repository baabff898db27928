"""Device names: parsing, validation, defaults.

``"cpu:N"`` names the N-th *virtual* CPU device: all share the host CPU, each
gets its own replica (and, while each can have a core, its own worker thread
and share of the cores: see ``Engine(device_threads=...)``). torch itself
only knows one CPU device, so the index is gsync's, and tensors live on
``torch.device("cpu")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import ConfigError, InputTypeError
from .threads import THREADS_PER_THREAD

__all__ = ("DeviceSpec", "DeviceThreadPlan", "default_devices", "parse_devices", "plan_device_threads")


class DeviceSpec:
    """One training device: its canonical name and the torch device its tensors live on."""

    __slots__ = ("name", "type", "index", "torch_device")

    def __init__(self, type_: str, index: int) -> None:
        self.type = type_
        self.index = index
        self.name = f"{type_}:{index}"
        self.torch_device = torch.device("cpu") if type_ == "cpu" else torch.device(type_, index)

    def __repr__(self) -> str:
        return f"DeviceSpec({self.name!r})"

    def __str__(self) -> str:
        # What a user writes in devices=[...], so f"training on {engine.devices[0]}" reads as it should.
        return self.name


def default_devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _parse_one(device: object) -> DeviceSpec:
    if isinstance(device, torch.device):
        type_, index = device.type, device.index
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ConfigError(
                f"unknown device {device!r}: use 'cpu', 'cpu:N' (the N-th virtual CPU device) or 'cuda:N'"
            ) from None
        type_, index = parsed.type, parsed.index
    else:
        raise ConfigError(f"device {device!r} is a {type(device).__name__}; pass a string such as 'cpu:0' or a torch.device")
    if type_ not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}: gsync trains on 'cpu[:N]' and 'cuda:N' devices")
    if type_ == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asks for CUDA, but torch.cuda.is_available() is False on this machine")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if index >= count:
            raise ConfigError(f"device {device!r} does not exist: this machine has {count} CUDA device(s)")
    return DeviceSpec(type_, 0 if index is None else index)


def _count_hint(count: int) -> str:
    if count < 1:
        return "list at least one device, e.g. devices=['cpu:0', 'cpu:1']"
    def names(kind: str) -> str:
        if count <= 4:
            return repr([f"{kind}:{i}" for i in range(count)])
        return f'[f"{kind}:{{i}}" for i in range({count})]'
    cpu = f"for {count} virtual CPU devices write devices={names('cpu')}"
    if torch.cuda.is_available():
        return f"for {count} GPUs write devices={names('cuda')}; {cpu}"
    return cpu


def parse_devices(devices: Sequence[str | torch.device] | None) -> list[DeviceSpec]:
    """Canonicalise a device list; ``None`` means :func:`default_devices`.

    :raises ~gsync.ConfigError: for an empty list, an unknown or unavailable
        device, a device listed twice (``"cpu"`` and ``"cpu:0"`` are the same),
        or one string or ``torch.device`` in place of a list.
    :raises ~gsync.InputTypeError: for a count (``devices=2``) or anything
        else that is not a list of devices; the message gives the list to write.
    """
    if devices is None:
        devices = default_devices()
    if isinstance(devices, str):
        # "cpu:0,cpu:1" is one string to Python, not two devices: suggest the list the user meant.
        names = [name for name in devices.replace(",", " ").split() if name]
        raise ConfigError(f"devices must be a list of device names, got the string {devices!r}; write devices={names!r}")
    if isinstance(devices, torch.device):
        raise ConfigError(f"devices must be a list, got {devices!r}; write devices=[{devices!r}]")
    if isinstance(devices, int):
        # Lightning's devices=2 means "two of them"; gsync names each device, so say which names that would be.
        raise InputTypeError(f"devices must be a list of device names, got the int {devices!r}; {_count_hint(devices)}")
    try:
        listed = list(devices)
    except TypeError:
        raise InputTypeError(
            f"devices must be a list of device names such as ['cpu:0', 'cpu:1'], got a {type(devices).__name__}"
        ) from None
    specs = [_parse_one(d) for d in listed]
    if not specs:
        raise ConfigError("devices is empty: list at least one device, e.g. devices=['cpu:0', 'cpu:1']")
    seen: dict[str, int] = {}
    for position, spec in enumerate(specs):
        if spec.name in seen:
            raise ConfigError(
                f"device {spec.name} is listed twice (positions {seen[spec.name]} and {position}); "
                "each device may hold only one replica: list distinct devices such as 'cpu:0', 'cpu:1'"
            )
        seen[spec.name] = position
    if len({spec.type for spec in specs}) > 1:
        raise ConfigError(
            f"devices mix CPU and CUDA ({[spec.name for spec in specs]}); gsync trains on one kind of device per "
            "process: list only 'cuda:N' devices, or only 'cpu:N' ones"
        )
    return specs


@dataclass(frozen=True)
class DeviceThreadPlan:
    """Which threads run a process's devices, and how they share its cores (see ``Engine(device_threads=...)``)."""

    device_threads: Literal["shared", "per_device"]
    intra_op_threads: tuple[int, int] | None
    """Torch intra-op threads per device thread and for the communication thread; ``None``: left as they are."""
    devices_in_turn: int
    """How many devices may run one after another within a step (each given ``sync_timeout``)."""


def plan_device_threads(devices: Sequence[DeviceSpec], device_threads: str) -> DeviceThreadPlan:
    """Resolve ``device_threads`` (``"auto"``, ``"shared"``, ``"per_device"``) for ``devices``.

    :raises ~gsync.ConfigError: for an unknown value, or ``"shared"`` with a non-CPU device.
    """
    if device_threads not in ("auto", "shared", "per_device"):
        raise ConfigError(f"device_threads must be 'auto', 'shared' or 'per_device', got {device_threads!r}")
    on_cpu = all(spec.torch_device.type == "cpu" for spec in devices)
    if device_threads == "shared" and not on_cpu:
        raise ConfigError(
            "device_threads='shared' is for CPU devices; "
            f"{', '.join(s.name for s in devices if s.torch_device.type != 'cpu')} each need their own "
            "thread to launch kernels while the others do: use 'per_device' or 'auto'"
        )
    cores = torch.get_num_threads()
    several_cpus = on_cpu and len(devices) > 1
    # One thread per virtual CPU device only pays while each can have a core, and where torch lets each thread
    # set its own intra-op count.
    shared = device_threads == "shared" or (
        device_threads == "auto" and several_cpus and (len(devices) > cores or not THREADS_PER_THREAD)
    )
    intra_op: tuple[int, int] | None = None
    if several_cpus and not shared and THREADS_PER_THREAD:
        share = max(1, cores // len(devices))
        intra_op = (share, max(1, cores - share * len(devices)))
    return DeviceThreadPlan("shared" if shared else "per_device", intra_op, len(devices) if on_cpu else 1)
