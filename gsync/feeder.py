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

from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from anyio.abc import ObjectSendStream

from ._threads import LoopHandle, WorkerThread
from .errors import ConfigError, DataFailed, GsyncError, InputTypeError

__all__ = (
    "BatchRead",
    "BatchReader",
    "batches_per_epoch",
    "check_batch_source",
    "EpochEnded",
    "Feeder",
    "FeedItem",
    "ReadFailed",
    "set_sampler_epoch",
)

_END = object()
# How long a reader waits for its data thread to finish the current read at the end.
_THREAD_GRACE_S = 0.5


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


def set_sampler_epoch(data: object, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on a ``DataLoader``'s sampler (or its batch sampler's) where it has one.

    A ``DistributedSampler`` shuffles by epoch only when told the epoch; a
    plain loop calls ``set_epoch`` before each epoch, and so do Lightning and
    Accelerate. A resumed run replays the epochs before its checkpoint the same
    way, so it reads what the run it continues read.
    """
    samplers: dict[int, object] = {}
    for holder, name in ((data, "sampler"), (getattr(data, "batch_sampler", None), "sampler")):
        sampler = getattr(holder, name, None) if holder is not None else None
        if sampler is not None:
            samplers[id(sampler)] = sampler
    for sampler in samplers.values():
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


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
            await self._worker.join(_THREAD_GRACE_S)


class Feeder:
    """Reads every batch of every epoch of ``data`` into a stream.

    ``batches_per_step`` only names the step in a :class:`~gsync.DataFailed`
    (with accumulation, several batches make one step).
    """

    def __init__(
        self, data: Iterable[Any] | AsyncIterable[Any], epochs: int, loop: LoopHandle, batches_per_step: int = 1
    ) -> None:
        self._data = data
        self._reader = BatchReader(data, loop)
        self._epochs = epochs
        self._batches_per_step = batches_per_step
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
            steps_before = 0  # the steps of the epochs read so far; fit drops each epoch's partial step
            for epoch in range(self._epochs):
                if epoch > 0:
                    await self._next_epoch.wait()
                    self._next_epoch = anyio.Event()
                set_sampler_epoch(self._data, epoch)
                count = 0

                def failed(read: int, first: int = steps_before) -> DataFailed:
                    return DataFailed(first + read // per_step)

                async with aclosing(self._reader.batches(failed)) as batches:
                    async for batch in batches:
                        await send.send(BatchRead(epoch, batch))
                        count += 1
                if count == 0:
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
