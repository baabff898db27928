"""A whole checkpoint of a ``shard_optimizer=True`` session across processes: every rank's slices gathered.

Each process holds only its own devices' slices of the optimizer state
(:mod:`gsync._core.sharding.step`); a checkpoint in the unsharded format needs
all of them. :func:`gather_whole_state` is a collective: every rank calls it at
the same point between steps (``session.checkpoint()`` on every rank, ``fit``'s
checkpoints, due at the same step on every rank), and each gets the whole state.

It runs in the session's communication thread, after anything that thread
already holds (every rank submits its collectives there in the same order),
while the caller waits, each collective within ``sync_timeout``:

1. a description of what each rank holds of every parameter's state: its
   range of the elements, the names and dtypes of its per-element values
   (``exp_avg``, ``momentum_buffer``, ...), and the values that are not per
   element (a step count, alike on every device), as bytes that
   ``torch.load(weights_only=True)`` reads back, so nothing a peer sends runs
   as code;
2. the per-element values: one flat CPU buffer per dtype on each rank, all-gathered
   in chunks of at most ``_CHUNK_BYTES`` per rank (padded to the longest rank's),
   each chunk copied straight into its place in the whole tensors.

Bytes moved: each rank's slices reach every other rank once, so each rank
receives the state it does not hold ((N-1)/N of the whole optimizer state over
N equal ranks) and the whole state crosses the network once per receiving rank;
nothing else moves (the parameters are already whole on every rank). Memory on
each rank: the whole state on the CPU (the checkpoint itself), this rank's
slices once more, and one chunk per rank in flight. Over NCCL the gather runs on
the run's gloo host group: the state goes to the CPU anyway.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...errors import CheckpointError, GsyncError, SyncFailed, SyncTimeout
from ..distributed.waiting import DIST_TEARDOWN_S, wait_work
from ..threads import WorkerThread

if TYPE_CHECKING:
    from ..distributed.runtime import ProcessGroupRuntime
    from .step import ReplicaShard, ShardedStep

__all__ = ("gather_whole_state",)

# The most one rank sends in one all-gather: the buffers in flight are this times the ranks.
_CHUNK_BYTES = 64 * 2**20

_Described = dict[str, Any]
"""What one rank holds of the optimizer state: ``problem`` (why its devices' state cannot be part of a whole one,
or ``None``) and ``parts``, per parameter in the optimizer's order: ``None`` for nothing, else ``start``/``stop``
(its range of the flattened elements), ``tensors`` (``[name, dtype]`` of each per-element value), ``values`` (the
other values) and ``order`` (every name, in the state's order)."""


def gather_whole_state(
    sharding: ShardedStep, runtime: ProcessGroupRuntime, setup: WorkerThread | None, step: int
) -> dict[int, dict[str, Any]]:
    """The optimizer state every rank's devices hold together, whole (the ``state`` of an unsharded
    ``state_dict()``, on the CPU). Collective: every rank calls it between the same steps; it blocks until all have.

    ``step``: the last step applied (for errors). ``setup``: the session's ``gsync-dist`` thread, where a failed
    collective's culprit is looked for.

    :raises ~gsync.CheckpointError: when the ranks' states do not make a whole one (every rank raises it,
        and the session can go on).
    :raises ~gsync.SyncFailed: ``site="checkpoint"``, when a collective failed, or
        :class:`~gsync.SyncTimeout` when one did not complete within ``sync_timeout``, or
        :class:`~gsync.PeerFailed` / :class:`~gsync.PeerLost` naming the peer that caused either: the ranks'
        collectives no longer match, and the session must fail.
    """
    shards = sharding.shards
    # Copied to the CPU here, in the calling thread, as a checkpoint in one process copies its state.
    described, flats = _local_parts(shards)
    first = shards[0]
    shapes = [first.params[first._position(piece)].shape for piece in _pieces(first)]
    progress = [time.monotonic()]

    def progressed() -> None:
        progress[0] = time.monotonic()

    def exchange() -> dict[int, dict[str, Any]]:
        return _exchange(runtime, described, flats, shapes, progressed)

    failure: GsyncError
    try:
        return _run_in(sharding.comm, exchange, sharding.timeout, progress)
    except CheckpointError:
        raise
    except TimeoutError:
        runtime.membership.abort.set()  # the communication thread leaves its wait
        failure = SyncTimeout(step, sharding.timeout, site="checkpoint")
    except Exception as error:  # noqa: BLE001 - the transport's error becomes gsync's, chained
        failure = SyncFailed(step, None, site="checkpoint")
        failure.__cause__ = error
    if setup is None:
        raise failure
    blamed = failure
    try:
        named = _run_in(setup, lambda: runtime.blame_peer(blamed), DIST_TEARDOWN_S, [time.monotonic()])
    except Exception:  # noqa: BLE001 - the collective's own failure is what is left to say
        named = failure
    raise named


def _pieces(shard: ReplicaShard) -> list[torch.nn.Parameter]:
    if shard.optimizer is None:
        raise RuntimeError("a sharded checkpoint before the optimizers were sharded")
    return [piece for group in shard.optimizer.param_groups for piece in group["params"]]


def _local_parts(shards: Sequence[ReplicaShard]) -> tuple[_Described, dict[str, torch.Tensor]]:
    """What this process's devices hold of each parameter's state, and their per-element values as one flat CPU
    tensor per dtype: parameter by parameter, each value's slices in device order (one contiguous range of the
    parameter, since a process's devices are consecutive in the run).

    A state that cannot be part of a whole one is described as a problem, which every rank raises once the
    descriptions are exchanged (raised here, it would leave the other ranks waiting in the exchange).
    """
    lists = [_pieces(shard) for shard in shards]
    parts: list[dict[str, Any] | None] = []
    flats: dict[str, list[torch.Tensor]] = {}
    for key in range(len(lists[0])):
        owners = [(shard, pieces[key]) for shard, pieces in zip(shards, lists) if pieces[key].numel() > 0]
        found = [shard.optimizer.state.get(piece) if shard.optimizer is not None else None for shard, piece in owners]
        if not any(found):
            parts.append(None)
            continue
        if not all(found):
            problem = f"parameter {key}'s optimizer state exists on some of its devices' shards only"
            return {"problem": problem, "parts": []}, {}
        first_shard, first_piece = owners[0]
        last_shard, last_piece = owners[-1]
        start = first_shard.ranges[first_shard._position(first_piece)][0]
        stop = last_shard.ranges[last_shard._position(last_piece)][1]
        if stop - start != sum(piece.numel() for _, piece in owners):
            raise RuntimeError(f"this process's slices of parameter {key} are not one range")
        states: list[dict[str, Any]] = [values for values in found if values is not None]
        tensors: list[list[str]] = []
        values: dict[str, Any] = {}
        for name, value in states[0].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == first_piece.numel():
                dtype = str(value.dtype).removeprefix("torch.")
                tensors.append([name, dtype])
                flats.setdefault(dtype, []).extend(each[name].detach().reshape(-1).to("cpu") for each in states)
            else:
                values[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        parts.append({"start": start, "stop": stop, "tensors": tensors, "values": values, "order": list(states[0])})
    return {"problem": None, "parts": parts}, {dtype: torch.cat(values) for dtype, values in flats.items()}


def _exchange(
    runtime: ProcessGroupRuntime,
    described: _Described,
    flats: dict[str, torch.Tensor],
    shapes: Sequence[torch.Size],
    progressed: Callable[[], None],
) -> dict[int, dict[str, Any]]:
    """In the communication thread: every rank's description, then its per-element values, into whole tensors."""
    every = [_decode(raw) for raw in _all_gather_bytes(runtime, _encode(described))]
    progressed()
    for rank, rank_described in enumerate(every):
        if rank_described["problem"] is not None:
            raise CheckpointError(f"rank {rank} cannot take part in a whole checkpoint: {rank_described['problem']}")
    ranks: list[list[dict[str, Any] | None]] = [rank_described["parts"] for rank_described in every]
    whole: dict[int, dict[str, Any]] = {}
    # Per rank and dtype: the whole tensors its flat buffer fills, in order: (target, first element, count).
    places: list[dict[str, list[tuple[torch.Tensor, int, int]]]] = [{} for _ in ranks]
    for key, shape in enumerate(shapes):
        held = [(rank, part) for rank, parts in enumerate(ranks) if key < len(parts) and (part := parts[key]) is not None]
        if not held:
            continue  # no state anywhere (not stepped yet, or never used)
        _check_whole(key, shape.numel(), held)
        tensors = held[0][1]["tensors"]
        merged: dict[str, Any] = {}
        targets = {name: torch.empty(shape.numel(), dtype=getattr(torch, dtype)) for name, dtype in tensors}
        for name in held[0][1]["order"]:
            merged[name] = targets[name].view(shape) if name in targets else held[0][1]["values"][name]
        for rank, part in held:
            for name, dtype in tensors:
                places[rank].setdefault(dtype, []).append((targets[name], part["start"], part["stop"] - part["start"]))
        whole[key] = merged
    for dtype in sorted({dtype for per_rank in places for dtype in per_rank}):
        sizes = [sum(count for _, _, count in per_rank.get(dtype, [])) for per_rank in places]
        mine = flats.get(dtype, torch.empty(0, dtype=getattr(torch, dtype)))
        if mine.numel() != sizes[runtime.membership.rank]:
            raise RuntimeError(f"this rank's {dtype} optimizer state has {mine.numel()} elements, its description {sizes}")
        longest = max(sizes)
        chunk = max(1, _CHUNK_BYTES // mine.element_size())
        cursors = [_Cursor(per_rank.get(dtype, [])) for per_rank in places]
        for offset in range(0, longest, chunk):
            length = min(chunk, longest - offset)
            send = torch.zeros(length, dtype=mine.dtype)
            own = mine[offset : offset + length]
            send[: own.numel()].copy_(own)
            for cursor, size, received in zip(cursors, sizes, _all_gather(runtime, send)):
                cursor.fill(received[: max(0, min(length, size - offset))])
            progressed()
    return whole


def _check_whole(key: int, numel: int, held: list[tuple[int, dict[str, Any]]]) -> None:
    """The ranks' ranges of parameter ``key``'s state follow one another, in rank order, over all its elements,
    with the same per-element values.

    :raises ~gsync.CheckpointError: when they do not.
    """
    expected = 0
    for rank, part in held:
        if part["start"] != expected:
            raise CheckpointError(
                f"parameter {key}'s optimizer state is not whole across the ranks: elements {expected} to "
                f"{part['start']} are on no rank's shard (rank {rank}'s starts at {part['start']}); the ranks' "
                "optimizers differ in which parameters have state"
            )
        if part["tensors"] != held[0][1]["tensors"]:
            raise CheckpointError(
                f"parameter {key}'s optimizer state has per-element values {part['tensors']} on rank {rank} and "
                f"{held[0][1]['tensors']} on rank {held[0][0]}: every rank must build the same optimizer"
            )
        expected = part["stop"]
    if expected != numel:
        raise CheckpointError(
            f"parameter {key}'s optimizer state covers {expected} of its {numel} elements across the ranks; the "
            "ranks' optimizers differ in which parameters have state"
        )


class _Cursor:
    """Where the next elements of one rank's flat buffer go: the whole tensors it fills, in order."""

    def __init__(self, places: list[tuple[torch.Tensor, int, int]]) -> None:
        self._places = places
        self._index = 0
        self._done = 0  # elements of the current place already filled

    def fill(self, received: torch.Tensor) -> None:
        taken = 0
        while taken < received.numel():
            target, start, count = self._places[self._index]
            n = min(count - self._done, received.numel() - taken)
            target[start + self._done : start + self._done + n].copy_(received[taken : taken + n])
            taken += n
            self._done += n
            if self._done == count:
                self._index += 1
                self._done = 0


def _all_gather(runtime: ProcessGroupRuntime, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (CPU, the same size on every rank), in rank order. Collective.

    Over gloo (an NCCL run's host group), waited on in slices that leave once the run's abort flag is set.
    """
    outputs = [torch.empty_like(tensor) for _ in range(runtime.membership.world_size)]
    host = runtime.host
    if host is not None:
        # A bare gloo backend: its own allgather (which the stubs do not list).
        work = host.allgather([outputs], [tensor])  # type: ignore[attr-defined]
    else:
        work = dist.all_gather(outputs, tensor, group=runtime.membership.group, async_op=True)
    wait_work(work, runtime.membership.abort)
    return outputs


def _all_gather_bytes(runtime: ProcessGroupRuntime, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order: sizes first, then the bytes padded to the longest. Collective."""
    lengths = [int(size.item()) for size in _all_gather(runtime, torch.tensor([len(payload)], dtype=torch.int64))]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        buffer[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return [bytes(chunk[:length].tolist()) for chunk, length in zip(_all_gather(runtime, buffer), lengths)]


def _encode(described: _Described) -> bytes:
    file = io.BytesIO()
    torch.save(described, file)
    return file.getvalue()


def _decode(raw: bytes) -> _Described:
    # Tensors and plain values only: a peer's bytes cannot run code here.
    described = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(described, dict) or "parts" not in described:
        raise CheckpointError("a rank's description of its optimizer state is damaged")
    return described


def _run_in(worker: WorkerThread, job: Callable[[], Any], timeout: float, progress: list[float]) -> Any:
    """Run ``job`` in ``worker`` and wait for it here, blocking this thread (the loop's, for a call that is not
    awaited); ``TimeoutError`` once ``progress[0]`` (the job's last sign of progress) is ``timeout`` old.

    The job's own exception is raised here; its report to the loop is dropped (nobody awaits it there).
    """
    done = threading.Event()
    box: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            box.append((job(), None))
        except BaseException as error:  # noqa: BLE001 - raised in the waiting thread
            box.append((None, error))
        finally:
            done.set()

    progress[0] = time.monotonic()
    worker.submit(run, lambda _: None, report_success=False)
    while not done.wait(max(0.0, progress[0] + timeout - time.monotonic())):
        if time.monotonic() - progress[0] >= timeout:
            raise TimeoutError
    value, error = box[0]
    if error is not None:
        raise error
    return value
