"""Reading the user's data.

:class:`BatchReader` reads ``data`` pass by pass. Synchronous iterables other
than lists and tuples (a ``DataLoader``, a generator) are advanced in a
worker thread, so slow data loading never blocks the event loop; async
iterables are awaited directly. :meth:`gsync.Session.evaluate` reads with it.

:class:`Feeder` reads ``fit``'s global batches with it, epoch by epoch, as
its own task, and hands them over a one-item stream, so the next batch is
read while the current step trains. A failure to read is handed over as an
item too (:class:`ReadFailed`), after the batches read before it, so ``fit``
runs the steps it already has before raising it.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from anyio.abc import ObjectSendStream

from ..threads import THREAD_GRACE_S, LoopHandle, WorkerThread
from ...errors import ConfigError, DataFailed, GsyncError, InputTypeError

__all__ = (
    "BatchRead",
    "BatchReader",
    "batches_per_epoch",
    "check_batch_source",
    "EpochEnded",
    "Feeder",
    "FeedItem",
    "ReadFailed",
    "epoch_setters",
)

_END = object()


@dataclass(frozen=True)
class BatchRead:
    epoch: int
    batch: Any


@dataclass(frozen=True)
class EpochEnded:
    epoch: int
    batches: int
    final: bool = False
    """The run's last epoch. Before any other, the feeder waits for :meth:`Feeder.next_epoch`."""


@dataclass(frozen=True)
class ReadFailed:
    error: GsyncError


FeedItem = BatchRead | EpochEnded | ReadFailed


def batches_per_epoch(data: object) -> int | None:
    """``len(data)``, or ``None`` for data without one (a generator, a loader over an iterable dataset)."""
    try:
        return len(data)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a __len__ that cannot tell (NotImplementedError, ...) leaves it unknown
        return None


def epoch_setters(data: object, from_zero: bool = False) -> list[tuple[Callable[[int], object], int]]:
    """The ``set_epoch`` methods of what shuffles ``data`` by epoch, each with the epoch ``fit`` counts from.

    A ``DistributedSampler`` shuffles by epoch only when told the epoch; a
    plain loop calls ``set_epoch`` before each epoch, and so do Lightning and
    Accelerate. Looked for on ``data.sampler``, ``data.batch_sampler`` (and
    its ``sampler``) and ``data.dataset`` (a streaming dataset's). The epoch
    they are at when ``fit`` starts is the base ``fit`` counts from, so a loop
    that calls ``fit(epochs=1)`` once per epoch after its own ``set_epoch(e)``
    keeps its numbering; ``from_zero`` (a resumed run, whose epochs are the
    run's from its start, as the checkpoint counts them) counts from 0.
    """
    batch_sampler = getattr(data, "batch_sampler", None)
    candidates = (
        getattr(data, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(data, "dataset", None),
    )
    found: dict[int, tuple[Callable[[int], object], int]] = {}
    for candidate in candidates:
        set_epoch = getattr(candidate, "set_epoch", None)
        if candidate is not None and callable(set_epoch) and id(candidate) not in found:
            found[id(candidate)] = (set_epoch, 0 if from_zero else _epoch_of(candidate))
    return list(found.values())


def _epoch_of(sampler: object) -> int:
    """The epoch a sampler is at (an int, a NumPy integer, a 0-d tensor), or 0 when it does not say."""
    epoch = getattr(sampler, "epoch", 0)
    if isinstance(epoch, bool):
        return 0
    try:
        return operator.index(epoch)
    except TypeError:
        return 0


def check_batch_source(data: object) -> None:
    """:raises ~gsync.InputTypeError: unless ``data`` is an iterable or async iterable (of batches).

    Type checks only: calling ``iter()`` here would run a ``DataLoader``'s
    sampler (consuming RNG state) or start its workers on the event loop.
    """
    if isinstance(data, torch.Tensor):
        raise InputTypeError("data is a single tensor; pass an iterable of batches, e.g. [tensor] or a DataLoader")
    if isinstance(data, Mapping):
        raise InputTypeError(
            "data is a dict (one batch?), and iterating it gives its keys; pass an iterable of batches, e.g. [batch]"
        )
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, (Iterable, AsyncIterable)):
        # A map-style dataset (indexed, with no __iter__) holds samples, not batches.
        raise InputTypeError(
            f"data is a {type(data).__name__}, a dataset of single samples; gsync takes an iterable of batches: "
            f"wrap it in a DataLoader, e.g. data=torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)"
        )
    if not isinstance(data, (Iterable, AsyncIterable)):
        raise InputTypeError(f"data must be an iterable or async iterable of batches, got {type(data).__name__}")


class BatchReader:
    """Reads a user's ``data``, pass after pass: lists and tuples directly,
    async iterables awaited, other iterables advanced in a worker thread
    (started at the first such read, ended by :meth:`close`).

    Every failure to read, starting a pass included (an ``__iter__`` that
    opens files or starts a ``DataLoader``'s workers), becomes the
    :class:`~gsync.DataFailed` that the caller makes of it.
    """

    def __init__(self, data: Iterable[Any] | AsyncIterable[Any], loop: LoopHandle) -> None:
        self._data = data
        self._loop = loop
        self._worker: WorkerThread | None = None

    async def batches(self, failed: Callable[[int], DataFailed]) -> AsyncGenerator[Any, None]:
        """Yield one pass's batches; ``failed(n)`` is raised, the cause chained, when reading its ``n``-th (from 0) fails."""
        data = self._data
        if isinstance(data, (list, tuple)):
            for batch in data:
                yield batch
            return
        pull: Callable[[], Awaitable[Any]] | None = None
        read = 0
        while True:
            try:
                if pull is None:
                    pull = await self._start(data)
                batch = await pull()
            except StopAsyncIteration:
                return
            except Exception as error:
                # Only the user's code runs here: even a gsync error it raises (from a
                # session of its own) is a failure of its data, not of this session.
                raise failed(read) from error
            yield batch
            read += 1

    async def _start(self, data: Iterable[Any] | AsyncIterable[Any]) -> Callable[[], Awaitable[Any]]:
        """Begin a pass over ``data``; the function that reads its next batch (``StopAsyncIteration`` at the end)."""
        if isinstance(data, AsyncIterable):
            return aiter(data).__anext__
        if self._worker is None:
            self._worker = WorkerThread("gsync-data", self._loop)
        worker = self._worker
        iterator = await worker.run(lambda: iter(data))

        async def pull() -> Any:
            batch = await worker.run(lambda: next(iterator, _END))
            if batch is _END:
                raise StopAsyncIteration
            return batch

        return pull

    async def close(self) -> None:
        """End the worker thread, if one was started, after the read it may be in (waited for briefly)."""
        if self._worker is not None:
            self._worker.stop()
            await self._worker.join(THREAD_GRACE_S)


class Feeder:
    """Reads every batch of every epoch of ``data`` into a stream.

    ``batches_per_step`` only names the step in a :class:`~gsync.DataFailed`
    (with accumulation, several batches make one step).
    """

    def __init__(
        self,
        data: Iterable[Any] | AsyncIterable[Any],
        epochs: int,
        loop: LoopHandle,
        batches_per_step: int = 1,
        resuming: bool = False,
        first_step: int = 0,
        empty_epochs: bool = False,
    ) -> None:
        """``first_step``: the global index of the data's first step, for the step numbers of its errors (a
        resumed fit's data counts from 0: it is replayed up to the checkpoint). ``empty_epochs``: an epoch
        without a batch is allowed (``uneven="join"``: this rank joins the others' steps with empty shards)."""
        self._empty_epochs = empty_epochs
        self._epoch_setters = epoch_setters(data, from_zero=resuming)
        self._reader = BatchReader(data, loop)
        self._epochs = epochs
        self._batches_per_step = batches_per_step
        self._first_step = 0 if resuming else first_step
        self._next_epoch = anyio.Event()

    def next_epoch(self) -> None:
        """Let the next epoch be read: the consumer has run the last one's steps and callbacks.

        What a callback changes at an epoch's end (a curriculum, a sampler's
        epoch) is then what the next epoch reads, as in a plain loop.
        """
        self._next_epoch.set()

    async def run(self, send: ObjectSendStream[FeedItem]) -> None:
        """Send every batch, an :class:`EpochEnded` after each epoch, and at most one :class:`ReadFailed` last.

        Reading ``data`` fails with :class:`~gsync.DataFailed` (the cause
        chained) and an epoch with no batch with :class:`~gsync.ConfigError`.
        """
        async with send:
            try:
                await self._read_all(send)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the loop stopped reading (it ended early, failed or was cancelled)
            finally:
                await self._reader.close()

    async def _read_all(self, send: ObjectSendStream[FeedItem]) -> None:
        per_step = self._batches_per_step
        try:
            steps_before = self._first_step  # and the epochs read so far; fit drops each epoch's partial step
            for epoch in range(self._epochs):
                if epoch > 0:
                    await self._next_epoch.wait()
                    self._next_epoch = anyio.Event()
                for set_epoch, base in self._epoch_setters:
                    try:
                        set_epoch(base + epoch)
                    except Exception as error:
                        raise DataFailed(steps_before) from error
                count = 0

                def failed(read: int, first: int = steps_before) -> DataFailed:
                    return DataFailed(first + read // per_step)

                async with aclosing(self._reader.batches(failed)) as batches:
                    async for batch in batches:
                        await send.send(BatchRead(epoch, batch))
                        count += 1
                if count == 0 and not self._empty_epochs:
                    raise ConfigError(
                        "data yielded no batch"
                        if epoch == 0
                        else f"data yielded no batch in epoch {epoch}: pass a re-iterable (a list or a "
                        "DataLoader), not a one-shot iterator"
                    )
                await send.send(EpochEnded(epoch, count, final=epoch == self._epochs - 1))
                steps_before += count // per_step
        except (ConfigError, InputTypeError, DataFailed) as error:
            await send.send(ReadFailed(error))
