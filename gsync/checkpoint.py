"""The last consistent state of a ``fit``, kept so a failure loses nothing.

gsync does not copy state at every step. The optimizer only steps after a
step's reduction completed on every device, so at any moment each replica
whose optimizer is not mid-step holds the state after some fully reduced step:
when ``fit`` fails, the engine takes the checkpoint from the most advanced such
replica. Buffers (BatchNorm statistics) change during forward, so they come
from the snapshot the buffer broadcast of that step already made.

A checkpoint saves to and loads from a file (:meth:`Checkpoint.save`,
:meth:`Checkpoint.load`): written atomically, read without running code.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError, ConfigError

__all__ = ("Checkpoint",)

_FORMAT = "gsync-checkpoint"
# 2: adds the random generators' state and the data position (version 1 files still load).
_VERSION = 2


@dataclass(frozen=True)
class Checkpoint:
    """The state of a run after ``step``, on the CPU: resume from it with ``fit(..., resume=checkpoint)``.

    Errors carry one (``error.checkpoint``), as do results (``FitResult.checkpoint``) and
    :meth:`gsync.Session.checkpoint`; :meth:`save` and :meth:`load` write and read it as a file.
    """

    step: int
    """The last step whose update this state includes; -1 for the state before the first step."""
    model_state: dict[str, torch.Tensor]
    """``state_dict()`` of the model after ``step``; load it with ``model.load_state_dict``."""
    optimizer_state: dict[str, Any]
    """``state_dict()`` of one replica's optimizer after ``step`` (all replicas' are equal); with
    ``shard_optimizer=True``, every device's shard of it gathered, in the same format."""
    scheduler_state: dict[str, Any] | None = None
    """``state_dict()`` of the LR scheduler after ``step``, when the run has one."""
    scaler_state: dict[str, Any] | None = None
    """``state_dict()`` of the float16 ``GradScaler`` after ``step``, when the run has one."""
    rng_state: dict[str, Any] | None = None
    """The global random generators (torch CPU and the run's CUDA devices, ``random``, NumPy) when the checkpoint
    was taken between steps in a one-process run (:meth:`gsync.Session.checkpoint`, ``fit``'s checkpoint files); a
    resume restores them. ``None`` for the checkpoint of a failure, taken mid-step when they had already moved on,
    and across processes, where each rank's generators are its own and one rank writes the file."""
    data_position: tuple[int, int] | None = None
    """``(epoch, batches)``: ``fit``'s data consumed through ``step``, as that many batches of that epoch. A
    resumed ``fit`` checks its data lines up with it."""
    optimizer_class: str | None = None
    """The optimizer's class, as ``module.QualifiedName`` (``torch.optim.adamw.AdamW``): a resume into another
    optimizer is refused as the session opens, not found at the first step. ``None`` in files written before
    gsync recorded it, which are checked by what their state holds."""

    @property
    def next_step(self) -> int:
        return self.step + 1

    def __repr__(self) -> str:
        # What it is, not what it holds: a model's state printed whole runs to megabytes in a notebook or a log.
        parts = [f"step={self.step}", f"model_state={_sized(self.model_state)}", f"optimizer_state={_sized(self.optimizer_state)}"]
        for name in ("scheduler_state", "scaler_state", "rng_state"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={_sized(value)}")
        if self.data_position is not None:
            parts.append(f"data_position={self.data_position}")
        if self.optimizer_class is not None:
            parts.append(f"optimizer_class={self.optimizer_class!r}")
        return f"Checkpoint({', '.join(parts)})"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint to ``path`` atomically; returns the path.

        The file is written next to its final name, flushed and fsynced, then
        renamed over it (and the directory fsynced), so a crash at any moment
        leaves either the previous file or the complete new one, never a
        torn one. Blocks for the size of the state: from async code, call it
        in a thread (``await anyio.to_thread.run_sync(checkpoint.save, path)``).
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = _payload(self)
        # Created as open() creates files (0666 less the umask: 0644 usually), not mkstemp's private 0600, so
        # another user or service that may read the directory can load the checkpoint.
        temporary = target.parent / f".{target.name}.{secrets.token_hex(8)}.partial"
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(payload, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Read a checkpoint written by :meth:`save`, onto the CPU.

        The file is read with ``torch.load(weights_only=True)``: it holds
        tensors and plain values only, and reading it cannot run code.

        :raises ~gsync.CheckpointError: naming the file, when it is missing,
            truncated, corrupt, not a gsync checkpoint, or of a newer format.
        """
        source = Path(path)
        try:
            payload = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint file at {source}") from None
        except Exception as error:  # noqa: BLE001 - unpickling garbage raises all sorts (IndexError included)
            raise CheckpointError(
                f"{source} cannot be read as a gsync checkpoint (truncated, corrupt, or not written by "
                f"Checkpoint.save): {error}"
            ) from error
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise CheckpointError(f"{source} is not a gsync checkpoint (no gsync format marker); write one with Checkpoint.save")
        version = payload.get("version")
        if not isinstance(version, int) or version > _VERSION:
            raise CheckpointError(
                f"{source} has checkpoint format version {version!r}, newer than this gsync reads ({_VERSION}); "
                "upgrade gsync"
            )
        try:
            return cls(**_fields(payload))
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{source} is a damaged gsync checkpoint: missing or bad {error}") from error

    def check_fits(self, model: nn.Module) -> None:
        """Check that this checkpoint is of ``model``'s architecture, before anything is built from it.

        :raises ~gsync.ConfigError: naming the first key that is missing,
            unexpected, or of another shape.
        """
        expected = model.state_dict()
        for name, value in expected.items():
            if name not in self.model_state:
                raise ConfigError(f"the checkpoint (step {self.step}) has no {name!r}, which the model has: it is of another model")
            saved = self.model_state[name]
            if tuple(saved.shape) != tuple(value.shape):
                raise ConfigError(
                    f"the checkpoint's {name!r} has shape {tuple(saved.shape)}, the model's {tuple(value.shape)}: "
                    "it is of another model (or another configuration of it)"
                )
        for name in self.model_state:
            if name not in expected:
                raise ConfigError(f"the checkpoint (step {self.step}) has {name!r}, which the model does not: it is of another model")

    @classmethod
    def capture(
        cls,
        step: int,
        replica: nn.Module,
        optimizer: torch.optim.Optimizer,
        buffers: dict[str, torch.Tensor] | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Checkpoint:
        """Copy a replica's state to the CPU, with ``buffers`` (name -> tensor) replacing its own."""
        state = {name: value.detach().to("cpu", copy=True) for name, value in replica.state_dict().items()}
        for name, value in (buffers or {}).items():
            if name in state:
                state[name] = value.detach().to("cpu", copy=True)
        # Copied straight to the CPU: a failure caused by device memory
        # pressure must still be able to take its checkpoint.
        return cls(
            step,
            state,
            _to_cpu(optimizer.state_dict()),
            None if scheduler is None else _to_cpu(scheduler.state_dict()),
            None if scaler is None else _to_cpu(scaler.state_dict()),
            optimizer_class=_class_name(type(optimizer)),
        )


def _class_name(cls: type) -> str:
    """``module.QualifiedName``: what a checkpoint records of its optimizer's class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _optional_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"optimizer_class {value!r}")


def _sized(state: Any) -> str:
    """``<12 tensors, 1,845 values, 7.4 KB on cpu>``: what a state holds, in a line."""
    tensors = list(_tensors_in(state))
    if not tensors:
        return "<no tensors>"
    values = sum(tensor.numel() for tensor in tensors)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    devices = ", ".join(sorted({str(tensor.device) for tensor in tensors}))
    return f"<{len(tensors)} tensor{'s' if len(tensors) != 1 else ''}, {values:,} values, {_bytes(nbytes)} on {devices}>"


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def _bytes(count: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _payload(checkpoint: Checkpoint) -> dict[str, Any]:
    """What a checkpoint file holds: what :meth:`Checkpoint.save` writes, and what an elastic handover sends."""
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "step": checkpoint.step,
        "model_state": checkpoint.model_state,
        "optimizer_state": checkpoint.optimizer_state,
        "scheduler_state": checkpoint.scheduler_state,
        "scaler_state": checkpoint.scaler_state,
        "rng_state": checkpoint.rng_state,
        "data_position": checkpoint.data_position,
        "optimizer_class": checkpoint.optimizer_class,
    }


def _fields(payload: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's fields from a payload whose marker and version were checked.

    :raises KeyError: or :class:`TypeError`, :class:`ValueError`, for a damaged payload.
    """
    return {
        "step": int(payload["step"]),
        "model_state": dict(payload["model_state"]),
        "optimizer_state": dict(payload["optimizer_state"]),
        "scheduler_state": payload.get("scheduler_state"),
        "scaler_state": payload.get("scaler_state"),
        "rng_state": payload.get("rng_state"),
        "data_position": _position(payload.get("data_position")),
        "optimizer_class": _optional_str(payload.get("optimizer_class")),
    }


def _position(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    epoch, batches = value
    return int(epoch), int(batches)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform without directory descriptors (Windows): the rename is what it can do
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
