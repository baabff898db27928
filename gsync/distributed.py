"""Multi-process runs: joining a ``torch.distributed`` group, and what gsync agrees on through it.

The engine uses these helpers when a fit spans processes (``torchrun``, or a
process group the user passes). Each one is collective where it says so:
every rank of the group must call it, in the same order, or it blocks until
the group's timeout.

- :func:`join` joins (or adopts) the group and the key/value store that comes
  with it, and agrees on a run id so a second fit in the same processes never
  reads the first fit's keys.
- :func:`gather_topology`, :func:`verify_same_parameters` and
  :func:`broadcast_module_state` run once at the start of a fit.
- :class:`FailureBoard` is the failure side channel: a rank whose worker fails
  writes a :class:`FailureReport` to the store, and every other rank's watcher
  thread hears of it at once, so peers raise :class:`PeerFailed` naming the
  failed rank instead of waiting on a collective that will never complete.

Nothing here imports the engine.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, FitError, GsyncError, SyncFailed, SyncTimeout, WorkerFailed
from .topology import Topology

__all__ = (
    "DistributedSession",
    "FailureBoard",
    "FailureReport",
    "PeerFailed",
    "broadcast_module_state",
    "failure_report",
    "gather_topology",
    "join",
    "should_use_distributed",
    "verify_same_parameters",
)

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_RUN_COUNTER = "gsync/runs"
# Module state is broadcast in byte buffers of at most this size, so a large
# model is not duplicated in memory all at once.
_STATE_CHUNK_BYTES = 128 * 2**20
# Offsets inside a byte buffer are aligned so every dtype can be viewed in place.
_ALIGN = 16
_MAX_MESSAGE_CHARS = 4000


# -- joining -------------------------------------------------------------------


def _env_int(name: str, default: int | None = None) -> int:
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
    return process_group is not None or _env_int("WORLD_SIZE", 1) > 1


@dataclass(eq=False)
class DistributedSession:
    """One process's membership in a multi-process run.

    ``rank`` and ``world_size`` are group ranks (a subgroup works too).
    ``created`` says whether :func:`join` initialised the group (and the
    TCPStore it runs on); only then does :meth:`close` destroy it. ``store``
    is the group's view of its store, where gsync keeps failure reports.
    ``backend`` is the group's torch.distributed backend. ``device``
    is where gsync's own small collectives (run id, topology, checks) put
    their tensors: the CPU for gloo, a CUDA device for NCCL. ``run_id`` is
    unique per store, so keys under :attr:`namespace` belong to this session
    alone.
    """

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    created: bool
    backend: str
    device: torch.device
    run_id: int
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def namespace(self) -> str:
        """Prefix of every store key this session writes."""
        return f"gsync/run{self.run_id}"

    @property
    def source_rank(self) -> int:
        """Global rank of group rank 0, the source of every broadcast."""
        return dist.get_global_rank(self.group, 0)

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


def _create_store(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
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
    port = _env_int("MASTER_PORT")
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
            f"{timeout.total_seconds():g} s ({error}); check MASTER_ADDR/MASTER_PORT and that every rank was started"
        ) from error


def join(
    process_group: dist.ProcessGroup | None,
    device_type: str,
    timeout_s: float,
    *,
    store: dist.Store | None = None,
    device: torch.device | str | None = None,
) -> DistributedSession:
    """Join the run's process group, or adopt the one given. Collective.

    - ``process_group`` given: it is used as is and never destroyed. Its
      store is ``store`` if given, else torch.distributed's default store
      (the default group's, which reaches every member of any subgroup).
    - no group, but torch.distributed is initialised: the default group is
      adopted the same way.
    - otherwise the default group is initialised from the environment as
      ``env://`` would (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
      ``WORLD_SIZE``, as torchrun sets them) on a ``dist.TCPStore`` gsync
      creates, with gloo for ``"cpu"`` and NCCL for ``"cuda"``; :meth:`DistributedSession.close`
      destroys it again.

    ``timeout_s`` bounds the rendezvous and every collective of a group gsync
    creates. ``device`` (CUDA only) is the device gsync's own collectives use;
    default: the current CUDA device.

    Blocks until every rank has joined. Ranks then agree on a run id (rank 0
    draws it from a counter in the store), so the keys of this session never
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
    created = False
    if process_group is not None:
        if process_group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(process_group, dist.ProcessGroup):
            raise ConfigError(
                f"process_group must be a torch.distributed.ProcessGroup this process belongs to, got {process_group!r}"
            )
        group = process_group
        _check_backend(group, device_type)
        group_store = store if store is not None else _default_store_for(group)
    elif dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
        _check_backend(group, device_type)
        group_store = store if store is not None else dist.distributed_c10d._get_default_store()
    else:
        world_size = _env_int("WORLD_SIZE")
        rank = _env_int("RANK")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} and WORLD_SIZE={world_size} do not fit: need 0 <= RANK < WORLD_SIZE")
        group_store = _fresh_prefix(store if store is not None else _create_store(rank, world_size, timeout), world_size)
        init_kwargs: dict[str, Any] = {}
        if backend == "nccl" and device is not None:
            # Binds the group to this device and sets up NCCL now, not at the first collective.
            init_kwargs["device_id"] = comm_device
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=world_size, timeout=timeout, **init_kwargs)
        group = dist.distributed_c10d._get_default_group()
        # The group's own view of the store (torch prefixes it with the group
        # name), so a later session adopting this group counts runs alike.
        group_store = dist.distributed_c10d._get_default_store()
        created = True
    try:
        run_id = _agree_run_id(group, group_store, comm_device)
    except BaseException:
        if created:
            dist.destroy_process_group(group)
        raise
    return DistributedSession(
        group=group,
        store=group_store,
        rank=group.rank(),
        world_size=group.size(),
        created=created,
        backend=backend if created else _backend_of(group),
        device=comm_device,
        run_id=run_id,
    )


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


def _agree_run_id(group: dist.ProcessGroup, store: dist.Store, device: torch.device) -> int:
    # One broadcast: it both hands out the id and proves the group works
    # before any training state depends on it.
    value = torch.zeros(1, dtype=torch.int64, device=device)
    if group.rank() == 0:
        value.fill_(store.add(_RUN_COUNTER, 1))
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())


# -- agreeing at the start of a fit ---------------------------------------------


def _all_gather(session: DistributedSession, tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(session.world_size)]
    dist.all_gather(gathered, tensor, group=session.group)
    return gathered


def _all_gather_bytes(session: DistributedSession, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order. Collective.

    torch's ``all_gather_object`` needs numpy (not a gsync dependency) and
    unpickles what peers send; this moves plain bytes in two gathers, sizes
    first, on the session's device.
    """
    device = session.device
    sizes = _all_gather(session, torch.tensor([len(payload)], dtype=torch.int64, device=device))
    lengths = [int(size.item()) for size in sizes]
    longest = max(lengths)
    if longest == 0:
        return [b""] * session.world_size
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buffer[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return [bytes(chunk[:length].tolist()) for chunk, length in zip(_all_gather(session, buffer), lengths)]


def gather_topology(session: DistributedSession, local_devices: int) -> Topology:
    """Where this rank's devices sit among all devices, rank-major. Collective.

    :raises ~gsync.ConfigError: when ``local_devices`` is not a positive int.
    """
    if isinstance(local_devices, bool) or not isinstance(local_devices, int) or local_devices < 1:
        raise ConfigError(f"local_devices must be a positive int, got {local_devices!r}")
    mine = torch.tensor([local_devices], dtype=torch.int64, device=session.device)
    counts = [int(count.item()) for count in _all_gather(session, mine)]
    return Topology(
        local_devices=local_devices,
        rank=session.rank,
        world_size=session.world_size,
        device_offset=sum(counts[: session.rank]),
        world_devices=sum(counts),
    )


_Signature = list[tuple[str, tuple[int, ...], str]]


def _signature(named: Sequence[tuple[str, torch.Tensor]]) -> _Signature:
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named]


def _decode_signature(raw: bytes) -> _Signature:
    return [(name, tuple(shape), dtype) for name, shape, dtype in msgspec.msgpack.decode(raw)]


def _describe_difference(reference: _Signature, other: _Signature, rank: int, noun: str) -> str | None:
    """How ``rank``'s signature differs from rank 0's, naming the first differing entry; None if equal."""
    for index, ((name0, shape0, dtype0), (name, shape, dtype)) in enumerate(zip(reference, other)):
        if name != name0:
            return f"{noun} {index} is {name!r} on rank {rank} but {name0!r} on rank 0"
        parts = []
        if shape != shape0:
            parts.append(f"shape {shape} on rank {rank} but {shape0} on rank 0")
        if dtype != dtype0:
            parts.append(f"dtype {dtype} on rank {rank} but {dtype0} on rank 0")
        if parts:
            return f"{noun} {name!r} has " + " and ".join(parts)
    if len(other) < len(reference):
        return (
            f"rank {rank} has {len(other)} {noun}s, rank 0 has {len(reference)}: "
            f"{reference[len(other)][0]!r} (and any after it) is missing on rank {rank}"
        )
    if len(other) > len(reference):
        return (
            f"rank {rank} has {len(other)} {noun}s, rank 0 has {len(reference)}: "
            f"{other[len(reference)][0]!r} (and any after it) exists only on rank {rank}"
        )
    return None


def _verify_same(session: DistributedSession, signature: _Signature, noun: str) -> None:
    # Gather digests first: the full lists travel only when something differs.
    # Every rank sees the same gathered values, so every rank takes the same
    # branch and raises the same error.
    payload = msgspec.msgpack.encode(signature)
    digest = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8).to(session.device)
    digests = _all_gather(session, digest)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    signatures = [_decode_signature(raw) for raw in _all_gather_bytes(session, payload)]
    differences = [
        (rank, text)
        for rank in range(1, session.world_size)
        if (text := _describe_difference(signatures[0], signatures[rank], rank, noun)) is not None
    ]
    if not differences:  # the digests differed but the lists match: nothing to report
        return
    rank, text = differences[0]
    also = f" (ranks {', '.join(str(r) for r, _ in differences)} all differ from rank 0)" if len(differences) > 1 else ""
    raise ConfigError(
        f"the model differs across ranks: {text}{also}. Every process must build the same model (same code, "
        "same constructor arguments, same requires_grad settings) before fit"
    )


def verify_same_parameters(session: DistributedSession, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Check that every rank has the same parameter names, shapes and dtypes, in the same order. Collective.

    :raises ~gsync.ConfigError: on every rank alike when any rank differs from
        rank 0, naming the first differing rank, the first differing parameter
        and what differs (name, shape, dtype, or the number of parameters).
    """
    _verify_same(session, _signature(named_params), "parameter")


def _module_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # named_parameters/named_buffers skip shared tensors after their first
    # name, so a tied weight is sent once.
    return list(module.named_parameters()) + list(module.named_buffers())


def broadcast_module_state(session: DistributedSession, module: nn.Module) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank 0's, in place. Collective.

    The state travels as raw bytes, coalesced into a few flat buffers (one
    collective per ~128 MiB, whatever the dtypes), so it is exact for every
    dtype and costs a handful of collectives instead of one per tensor.

    :raises ~gsync.ConfigError: on every rank alike when the parameters or
        buffers differ across ranks (checked first, as in
        :func:`verify_same_parameters`).
    """
    named = _module_state(module)
    _verify_same(session, _signature(named), "parameter or buffer")
    tensors = [tensor for _, tensor in named if tensor.numel() > 0]
    with torch.no_grad():
        for chunk in _chunks(tensors):
            _broadcast_bytes(session, chunk)


def _padded_bytes(tensor: torch.Tensor) -> int:
    size = tensor.numel() * tensor.element_size()
    return -(-size // _ALIGN) * _ALIGN


def _chunks(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = _padded_bytes(tensor)
        if chunk and size + nbytes > _STATE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        yield chunk


def _broadcast_bytes(session: DistributedSession, tensors: list[torch.Tensor]) -> None:
    offsets = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += _padded_bytes(tensor)
    flat = torch.empty(total, dtype=torch.uint8, device=session.device)
    source = session.rank == 0
    if source:
        for tensor, offset in zip(tensors, offsets):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
    dist.broadcast(flat, src=session.source_rank, group=session.group)
    if not source:
        for tensor, offset in zip(tensors, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))


# -- failures across processes --------------------------------------------------


class FailureReport(msgspec.Struct, frozen=True, tag=True):
    """What one rank tells the others when its fit failed; msgpack-encoded in the store.

    ``device`` is empty (and ``device_index`` -1) for a failure not tied to
    one device; ``step`` is -1 when no step was involved.
    """

    rank: int
    device: str
    device_index: int
    step: int
    site: str
    error_type: str
    message: str


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(FailureReport)


def failure_report(rank: int, error: BaseException) -> FailureReport:
    """The report a rank publishes for the error that ends its fit.

    ``WorkerFailed`` reports its device, step and site with its cause's type
    and message; ``SyncFailed`` and ``SyncTimeout`` report the step and the
    collective; anything else is reported as it is. A :class:`PeerFailed` is a
    consequence of another rank's report: do not report it again.
    """
    root: BaseException = error
    device, device_index, step, site = "", -1, int(getattr(error, "step", -1)), "fit"
    if isinstance(error, WorkerFailed):
        device, device_index, site = error.device, error.device_index, error.site
        root = error.__cause__ or error
    elif isinstance(error, SyncFailed):
        site = "buffer broadcast" if error.bucket is None else f"all-reduce of bucket {error.bucket}"
        root = error.__cause__ or error
    elif isinstance(error, SyncTimeout):
        site = "gradient sync"
    message = str(root)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " [truncated]"
    return FailureReport(rank, device, device_index, step, site, type(root).__name__, message)


class PeerFailed(FitError):
    """Another rank's fit failed; this rank stopped instead of waiting on it.

    ``rank``, ``device``, ``step`` and ``site`` say where it failed;
    ``error_type`` and ``remote_message`` are its original exception's type
    name and message (the exception itself lives in the other process).
    """

    def __init__(
        self,
        rank: int,
        device: str,
        step: int,
        site: str,
        error_type: str,
        remote_message: str,
        device_index: int = -1,
    ) -> None:
        if device:
            where = f"worker on device {device} failed at step {step} during {site}"
        elif step >= 0:
            where = f"{site} failed at step {step}"
        else:
            where = f"{site} failed"
        super().__init__(f"rank {rank} failed: {where}: {error_type}: {remote_message}")
        self.rank = rank
        self.device = device
        self.device_index = device_index
        self.step = step
        self.site = site
        self.error_type = error_type
        self.remote_message = remote_message
        self.others: tuple[FitError, ...] = ()

    @classmethod
    def from_report(cls, report: FailureReport) -> PeerFailed:
        return cls(
            report.rank, report.device, report.step, report.site, report.error_type, report.message, report.device_index
        )


# The watcher blocks in store.wait for this long per call when it has its own
# store connection; stop() wakes it through the store at once, so the slice
# only bounds how often TCPStore logs its "wait timed out" warning. Without
# its own connection (a store that cannot be cloned) the watcher would hold
# the shared connection's lock while waiting, so it waits in short slices.
_WATCH_SLICE = timedelta(seconds=3600)
_SHARED_WATCH_SLICE = timedelta(seconds=0.2)
_STOP = b"stop"


class FailureBoard:
    """The failure side channel of one session, over its store.

    Keys live under the session's namespace:
    ``<ns>/failures`` counts reports, ``<ns>/failure/<n>`` holds the n-th
    (msgpack), and ``<ns>/wake/<rank>`` is set to wake ``rank``'s watcher.
    """

    def __init__(self, session: DistributedSession) -> None:
        self._store = session.store
        self._rank = session.rank
        self._world_size = session.world_size
        self._namespace = session.namespace
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.report_error: BaseException | None = None
        """Why the last :meth:`report` could not be published, if it could not."""
        self.watch_error: BaseException | None = None
        """Why the watcher ended without a report (the store went away, or the callback raised)."""

    def _key(self, *parts: object) -> str:
        return "/".join((self._namespace, *(str(p) for p in parts)))

    def report(self, report: FailureReport) -> bool:
        """Publish ``report`` to every other rank; ``False`` if the store could not be reached.

        Blocks for ``world_size + 1`` small store writes. It never raises for
        store trouble: the local failure is what the caller is raising, and a
        store that is gone means the peers are ending anyway (the error is
        kept in :attr:`report_error`).

        :raises ~gsync.ConfigError: when ``report.rank`` is not this session's rank.
        """
        if report.rank != self._rank:
            raise ConfigError(f"a FailureReport for rank {report.rank} cannot be published by rank {self._rank}")
        try:
            sequence = self._store.add(self._key("failures"), 1)
            self._store.set(self._key("failure", sequence), _ENCODER.encode(report))
            # Wake keys go last: a woken watcher always finds the report.
            for rank in range(self._world_size):
                if rank != self._rank:
                    self._store.set(self._key("wake", rank), str(sequence))
        except Exception as error:  # noqa: BLE001 - kept for the caller, see docstring
            self.report_error = error
            return False
        return True

    def peer_report(self, timeout_s: float = 0.0) -> FailureReport | None:
        """The first report of another rank, waiting up to ``timeout_s`` for one; ``None`` if none.

        Blocks up to ``timeout_s`` (call it from a worker thread, not the
        event loop). Use it to name the root cause when a collective failed
        or timed out: a peer that failed may have closed its connections
        before this rank's watcher heard of the report.
        """
        found = self._scan(self._store)
        if found is not None or timeout_s <= 0:
            return found
        try:
            self._store.wait([self._key("wake", self._rank)], timedelta(seconds=timeout_s))
        except dist.DistError:
            return None
        return self._scan(self._store)

    def _scan(self, store: dist.Store) -> FailureReport | None:
        count = store.add(self._key("failures"), 0)
        for sequence in range(1, count + 1):
            key = self._key("failure", sequence)
            # The counter is bumped before the report is written.
            if not store.check([key]):
                continue
            report = _DECODER.decode(store.get(key))
            if report.rank != self._rank:
                return report
        return None

    def start_watching(self, callback: Callable[[FailureReport], object]) -> None:
        """Start the ``gsync-failure-watch`` daemon thread; it calls ``callback(report)`` once.

        The callback runs in the watcher thread, for the first report from
        another rank (never for this rank's own); hand it to the event loop
        from there, and tolerate a call that races with :meth:`stop`. The
        thread ends after the callback, on :meth:`stop`, or when the store
        goes away (see :attr:`watch_error`).

        The watcher blocks in ``store.wait`` on its own store connection and
        is woken through the store (by a report, or by :meth:`stop`) rather
        than polling: TCPStore logs two C++ warnings for every wait that
        times out, so waking every 0.2 s would flood stderr.

        :raises ~gsync.GsyncError: if this board is already watching or was stopped.
        """
        if self._thread is not None or self._stopping.is_set():
            raise GsyncError("this FailureBoard is already watching or was stopped; make a new board per session")
        store, slice_ = _own_connection(self._store)
        self._thread = threading.Thread(
            target=self._watch, args=(store, slice_, callback), name="gsync-failure-watch", daemon=True
        )
        self._thread.start()

    def _watch(self, store: dist.Store, slice_: timedelta, callback: Callable[[FailureReport], object]) -> None:
        wake = self._key("wake", self._rank)
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    store.wait([wake], slice_)
                except dist.DistStoreError:
                    # A wait that ran its slice is a timeout: wait again. One
                    # that failed early is the store failing: give up below.
                    if time.monotonic() - started < slice_.total_seconds() / 2:
                        raise
                    continue
                if self._stopping.is_set():
                    return
                report = self._scan(store)
                if report is not None:
                    callback(report)
                # Woken means a peer's report exists (or stop() woke us): either way, done.
                return
        except Exception as error:  # noqa: BLE001 - a watcher has no caller; the board keeps the error
            if not self._stopping.is_set():
                self.watch_error = error

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the watcher and join it for up to ``timeout_s``; whether it has ended. Idempotent.

        Wakes the watcher through the store (one write, which blocks only as
        long as the store takes to answer), so it ends at once rather than at
        its next timeout. If the store server is gone, the watcher's wait has
        already failed and it has ended; only a server that is alive but
        unresponsive leaves the daemon thread waiting, and then this returns
        ``False`` after ``timeout_s``.
        """
        self._stopping.set()
        thread = self._thread
        if thread is None:
            return True
        if thread.is_alive():
            try:
                self._store.set(self._key("wake", self._rank), _STOP)
            except Exception:  # noqa: BLE001 - a store that is gone has already ended the watcher's wait
                pass
            thread.join(timeout_s)
        return not thread.is_alive()


def _own_connection(store: dist.Store) -> tuple[dist.Store, timedelta]:
    # A TCPStore client serialises its operations; a watcher blocked on the
    # shared client would stall report() and everyone else using the store.
    try:
        return store.clone(), _WATCH_SLICE
    except Exception:  # noqa: BLE001 - stores that cannot clone raise various errors
        return store, _SHARED_WATCH_SLICE
