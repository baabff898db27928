"""Joining a ``torch.distributed`` group (or adopting the user's) and the store that comes with it."""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from .waiting import GROUP_TYPES, broadcast_from, release_settled, wait_work

__all__ = ("GroupMembership", "join", "should_use_distributed")

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_RUN_COUNTER = "gsync/runs"


def env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        if default is None:
            raise ConfigError(
                f"environment variable {name} is not set: launch with torchrun (which sets MASTER_ADDR, "
                "MASTER_PORT, RANK and WORLD_SIZE), set them yourself, or pass process_group="
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def should_use_distributed(process_group: dist.ProcessGroup | None) -> bool:
    """Whether a fit spans processes: a group was given, or ``WORLD_SIZE`` > 1 (as under torchrun).

    :raises ~gsync.ConfigError: when ``WORLD_SIZE`` is set but not an integer.
    """
    return process_group is not None or env_int("WORLD_SIZE", 1) > 1


@dataclass(eq=False)
class GroupMembership:
    """One process's membership in a multi-process run.

    ``rank`` and ``world_size`` are group ranks (a subgroup works too).
    ``created`` says whether :func:`join` initialised the group (and the
    TCPStore it runs on); only then does :meth:`close` destroy it. ``store``
    is the group's view of its store, where gsync keeps failure reports.
    ``backend`` is the group's torch.distributed backend. ``device``
    is where gsync's own small collectives (run id, topology, checks) put
    their tensors: the CPU for gloo, a CUDA device for NCCL. ``run_id`` is
    unique per store, so keys under :attr:`namespace` belong to this membership
    alone. ``abort`` is the run's abort flag: every collective gsync runs on
    the group waits through :meth:`wait`, which leaves once it is set.
    """

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    created: bool
    backend: str
    device: torch.device
    run_id: int
    abort: threading.Event = field(default_factory=threading.Event)
    store_host: int | None = None
    """The group rank whose process hosts the store server, when gsync created it there (rank 0)."""
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def namespace(self) -> str:
        """Prefix of every store key this membership writes."""
        return f"gsync/run{self.run_id}"

    def wait(self, work: dist.Work) -> None:
        """Wait for a collective launched with ``async_op=True``; see :func:`~gsync._core.distributed.waiting.wait_work`.

        :raises ~gsync._core.threads.FitAborted: once :attr:`abort` is set.
        """
        wait_work(work, self.abort, blocking=self.device.type != "cuda")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy the group if :func:`join` created it; a user's group is left up. Idempotent.

        Blocks while the backend tears down (gloo waits for its in-flight
        work). The store is released when the last reference to it goes (a
        :class:`FailureBoard` holds one): stop boards before closing.
        """
        if self._closed:
            return
        self._closed = True
        if self.created and dist.is_initialized():
            dist.destroy_process_group(self.group)
        release_settled()


def _default_store_for(group: dist.ProcessGroup) -> dist.Store:
    if not dist.is_initialized():
        raise ConfigError(
            "a process group was given without a store, and torch.distributed has no default group whose store "
            "gsync could use for failure reports: pass store= (the Store the group was built on), or build the "
            "group with torch.distributed.init_process_group / new_group"
        )
    # Every member of a subgroup is a member of the default group, so the
    # default store reaches them all; keys are namespaced per run below.
    return dist.distributed_c10d._get_default_store()


def create_store(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The TCPStore env:// would build; gsync builds it itself so it can hold it for failure reports.

    Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) the
    agent hosts the server and every rank is a client; otherwise rank 0 hosts it.
    """
    address = os.environ.get("MASTER_ADDR", "")
    if not address:
        raise ConfigError(
            "environment variable MASTER_ADDR is not set: launch with torchrun (which sets MASTER_ADDR, "
            "MASTER_PORT, RANK and WORLD_SIZE), set them yourself, or pass process_group="
        )
    port = env_int("MASTER_PORT")
    if not 0 < port < 2**16:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        if agent:
            return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        return dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    except dist.DistError as error:
        raise ConfigError(
            f"rank {rank} of {world_size} could not reach the rendezvous store at {address}:{port} within "
            f"{timeout.total_seconds():g} s ({error}); check MASTER_ADDR/MASTER_PORT, that every rank was started, and "
            "that none failed before it joined (that rank's own error says why)"
        ) from error


def join(
    process_group: dist.ProcessGroup | None,
    device_type: str,
    timeout_s: float,
    *,
    store: dist.Store | None = None,
    device: torch.device | str | None = None,
    abort: threading.Event | None = None,
) -> GroupMembership:
    """Join the run's process group, or adopt the one given. Collective.

    - ``process_group`` given: it is used as is and never destroyed. Its
      store is ``store`` if given, else torch.distributed's default store
      (the default group's, which reaches every member of any subgroup).
    - no group, but torch.distributed is initialised: the default group is
      adopted the same way.
    - otherwise the default group is initialised from the environment as
      ``env://`` would (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
      ``WORLD_SIZE``, as torchrun sets them) on a ``dist.TCPStore`` gsync
      creates, with gloo for ``"cpu"`` and NCCL for ``"cuda"``; :meth:`GroupMembership.close`
      destroys it again.

    ``timeout_s`` bounds the rendezvous and every collective of a group gsync
    creates. ``device`` (CUDA only) is the device gsync's own collectives use;
    default: the current CUDA device. ``abort`` is the run's abort flag (see
    :class:`GroupMembership`).

    Blocks until every rank has joined. Ranks then agree on a run id (rank 0
    draws it from a counter in the store), so the keys of this membership never
    collide with an earlier one on the same store.

    :raises ~gsync.ConfigError: for an unknown device type, a missing or
        invalid environment variable, a group this process is not in, no
        store to use, or a rendezvous store that cannot be reached.
    """
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise ConfigError(f"device type {device_type!r} has no multi-process backend; gsync supports 'cpu' (gloo) and 'cuda' (nccl)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    timeout = timedelta(seconds=timeout_s)
    comm_device = _comm_device(device_type, device)
    created = process_group is None and not dist.is_initialized()
    store_host: int | None = None
    if process_group is not None:
        group, group_store = _adopted(process_group, store, device_type)
    elif not created:
        group = dist.distributed_c10d._get_default_group()
        _check_backend(group, device_type)
        group_store = store if store is not None else dist.distributed_c10d._get_default_store()
    else:
        if store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            store_host = 0
        group, group_store = _initialised(backend, store, timeout, comm_device if device is not None else None)
    abort = abort if abort is not None else threading.Event()
    try:
        run_id = _agree_run_id(group, group_store, comm_device, abort)
    except BaseException:
        if created:
            dist.destroy_process_group(group)
        raise
    return GroupMembership(
        group=group,
        store=group_store,
        rank=group.rank(),
        world_size=group.size(),
        created=created,
        backend=backend if created else _backend_of(group),
        device=comm_device,
        run_id=run_id,
        abort=abort,
        store_host=store_host,
    )


def _adopted(process_group: dist.ProcessGroup, store: dist.Store | None, device_type: str) -> tuple[dist.ProcessGroup, dist.Store]:
    """The group the user (or an elastic run's generation: a bare backend built on its store) gave, and its store."""
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(process_group, GROUP_TYPES):
        raise ConfigError(
            f"process_group must be a torch.distributed.ProcessGroup this process belongs to, got {process_group!r}"
        )
    _check_backend(process_group, device_type)
    return process_group, store if store is not None else _default_store_for(process_group)


def _initialised(
    backend: str, store: dist.Store | None, timeout: timedelta, nccl_device: torch.device | None
) -> tuple[dist.ProcessGroup, dist.Store]:
    """The default group, initialised from the environment as ``env://`` would, and its store."""
    world_size = env_int("WORLD_SIZE")
    rank = env_int("RANK")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world_size} do not fit: need 0 <= RANK < WORLD_SIZE")
    group_store = _fresh_prefix(store if store is not None else create_store(rank, world_size, timeout), world_size)
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as its functions' default arguments when it is
    # first imported, which torch.optim (through torch._dynamo) does at the first optimizer: imported after this
    # group exists, those defaults hold it for the rest of the process, and destroying it in close() no longer
    # frees it. Its gloo threads and the TCPStore server then outlive the run and still run while the interpreter
    # exits (where a rank was seen to abort now and then: "terminate called without an active exception").
    # Imported first, the defaults hold None and close() frees the group.
    importlib.import_module("torch.distributed.nn")
    init_kwargs: dict[str, Any] = {}
    if backend == "nccl" and nccl_device is not None:
        # Binds the group to this device and sets up NCCL now, not at the first collective.
        init_kwargs["device_id"] = nccl_device
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world_size, timeout=timeout, **init_kwargs)
    # The group's own view of the store (torch prefixes it with the group name), so a later membership adopting
    # this group counts runs alike.
    return dist.distributed_c10d._get_default_group(), dist.distributed_c10d._get_default_store()


def _fresh_prefix(store: dist.Store, world_size: int) -> dist.Store:
    """A view of ``store`` under a prefix no earlier join on it used.

    The server may outlive a group (torchrun's agent store always does, and
    rank 0's multi-tenant server lives while anything references it). A
    group initialised again on it would find the previous group's gloo/NCCL
    rendezvous keys, and ranks would connect to addresses that are gone.
    Every rank bumps one counter once per join; since each join is a
    rendezvous of all ranks, the N bumps of one join all happen before any
    bump of the next, so ``(value - 1) // N`` is the same on every rank and
    new for each join.
    """
    # torchrun sets TORCHELASTIC_RESTART_COUNT; a restarted worker group
    # counts afresh, whatever a failed attempt left in the agent's store.
    scope = f"gsync/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    generation = (store.add(f"{scope}/joins", 1) - 1) // world_size
    return dist.PrefixStore(f"{scope}/join{generation}", store)


def _backend_of(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group torch.distributed did not register
        return "unknown"


def _check_backend(group: dist.ProcessGroup, device_type: str) -> None:
    backend = _backend_of(group)
    if device_type == "cpu" and "nccl" in backend and "gloo" not in backend:
        raise ConfigError(
            f"the process group uses {backend}, which cannot reduce CPU tensors: pass a gloo group "
            "(torch.distributed.new_group(backend='gloo')) or train on CUDA devices"
        )


def _comm_device(device_type: str, device: torch.device | str | None) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device())


def _agree_run_id(group: dist.ProcessGroup, store: dist.Store, device: torch.device, abort: threading.Event) -> int:
    # One broadcast: it both hands out the id and proves the group works
    # before any training state depends on it.
    value = torch.zeros(1, dtype=torch.int64, device=device)
    if group.rank() == 0:
        value.fill_(store.add(_RUN_COUNTER, 1))
    work = broadcast_from(value, group)
    wait_work(work, abort, blocking=device.type != "cuda")
    return int(value.item())
