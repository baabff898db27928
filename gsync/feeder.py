"""The feeder: reads ``fit``'s global batches, epoch by epoch, ahead of training.

It runs as its own task and hands batches over a one-item stream, so the next
batch is read while the current step trains. Synchronous iterables other than
lists and tuples (a ``DataLoader``, a generator) are advanced in a worker
thread, so slow data loading never blocks the event loop; async iterables are
awaited directly.

A failure to read is handed over as an item too (:class:`ReadFailed`), after
the batches read before it, so ``fit`` runs the steps it already has before
raising it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ObjectSendStream

from ._threads import LoopHandle, WorkerThread
from .errors import ConfigError, DataFailed, GsyncError, InputTypeError

__all__ = ("BatchRead", "EpochEnded", "Feeder", "FeedItem", "ReadFailed")

_END = object()
# How long the feeder waits for its data thread to finish the current read at the end.
_THREAD_GRACE_S = 0.5


@dataclass(frozen=True)
class BatchRead:
    epoch: int
    batch: Any


@dataclass(frozen=True)
class EpochEnded:
    epoch: int
    batches: int


@dataclass(frozen=True)
class ReadFailed:
    error: GsyncError


FeedItem = BatchRead | EpochEnded | ReadFailed


class Feeder:
    """Reads every batch of every epoch of ``data`` into a stream.

    ``batches_per_step`` only names the step in a :class:`~gsync.DataFailed`
    (with accumulation, several batches make one step).
    """

    def __init__(
        self, data: Iterable[Any] | AsyncIterable[Any], epochs: int, loop: LoopHandle, batches_per_step: int = 1
    ) -> None:
        self._data = data
        self._epochs = epochs
        self._loop = loop
        self._batches_per_step = batches_per_step
        self.worker: WorkerThread | None = None

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
                if self.worker is not None:
                    self.worker.stop()
                    await self.worker.join(_THREAD_GRACE_S)

    async def _read_all(self, send: ObjectSendStream[FeedItem]) -> None:
        try:
            index = 0
            for epoch in range(self._epochs):
                count = 0
                async with aclosing(self._batches(index)) as batches:
                    async for batch in batches:
                        await send.send(BatchRead(epoch, batch))
                        index += 1
                        count += 1
                if count == 0:
                    raise ConfigError(
                        "data yielded no batch"
                        if epoch == 0
                        else f"data yielded no batch in epoch {epoch}: pass a re-iterable (a list or a "
                        "DataLoader), not a one-shot iterator"
                    )
                await send.send(EpochEnded(epoch, count))
        except (ConfigError, InputTypeError, DataFailed) as error:
            await send.send(ReadFailed(error))

    async def _batches(self, index: int) -> AsyncGenerator[Any, None]:
        """Yield the batches of one epoch; a failure of the user's iterable becomes :class:`DataFailed`."""
        data = self._data
        if isinstance(data, (list, tuple)):
            for batch in data:
                yield batch
            return
        if isinstance(data, AsyncIterable):
            iterator = aiter(data)
            pull = iterator.__anext__
        else:
            if self.worker is None:
                self.worker = WorkerThread("gsync-data", self._loop)
            worker = self.worker
            sync_iterator = await worker.run(lambda: iter(data))

            async def pull() -> Any:
                batch = await worker.run(lambda: next(sync_iterator, _END))
                if batch is _END:
                    raise StopAsyncIteration
                return batch

        while True:
            try:
                batch = await pull()
            except StopAsyncIteration:
                return
            except GsyncError:
                raise
            except Exception as error:
                raise DataFailed(index // self._batches_per_step) from error
            yield batch
            index += 1
