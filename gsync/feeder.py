"""The feeder: reads global batches, splits them, and hands each local device its shard.

Every process reads the same global batches; each batch is split across all
devices of all processes in rank-major order and this process keeps its own
shards (see :class:`~gsync.topology.Topology`).

It validates each batch before dispatching it, announces the step to the sync
server (``StepDispatched``, with every device's row count, from which the
reduction weights follow), then sends the shards. Device streams hold one
shard, so data for step ``s+1`` is prepared while step ``s`` trains.

With ``process_local`` (multi-process runs fed per-process data), each
batch is this process's own and is split over the local devices only.

Synchronous iterables other than lists and tuples (a ``DataLoader``, a
generator) are advanced in a worker thread, so slow data loading never blocks
the event loop. Async iterables are awaited directly.
"""

from __future__ import annotations

from contextlib import aclosing
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

from anyio.abc import ObjectSendStream

from ._threads import LoopHandle, WorkerThread
from .actor import Shard
from .batches import batch_rows, shard_rows, split_batch
from .errors import ConfigError, DataFailed, GsyncError, InputTypeError
from .mailbox import Mailbox
from .topology import Topology
from .messages import Close, ServerMessage, StepDispatched

__all__ = ("Feeder",)


_END = object()


class Feeder:
    def __init__(
        self,
        *,
        data: Iterable[Any] | AsyncIterable[Any],
        epochs: int,
        server: Mailbox[ServerMessage],
        shard_streams: Sequence[ObjectSendStream[Shard]],
        loop: LoopHandle,
        topology: Topology,
        first_step: int = 0,
        process_local: bool = False,
    ) -> None:
        self._data = data
        self._epochs = epochs
        self._server = server
        self._streams = shard_streams
        self._loop = loop
        self._first_step = first_step
        self._topology = topology
        self._process_local = process_local
        self.worker: WorkerThread | None = None
        self.steps_dispatched = 0
        self.deferred_error: GsyncError | None = None
        self._held: tuple[int, Any] | None = None

    async def run(self) -> None:
        """Dispatch every batch of every epoch, then post ``Close`` to the server.

        :raises ~gsync.ConfigError: for an epoch with no batch or an invalid batch.
        :raises ~gsync.DataFailed: when iterating ``data`` raises.

        Only a failure before the first dispatch is raised here. A later one
        ends the data as if it had run out, so the steps already dispatched
        complete on every device; it is kept in ``deferred_error`` for the
        engine to raise once they have.

        With ``first_step`` > 0 (resuming), the first ``first_step`` batches
        are read and dropped, so ``data`` must yield the same batches in the
        same order as in the run being resumed.

        Each batch is dispatched once the next one has been read (or the
        data has ended), so the last step is known as the last: across
        processes, ranks check that they all end at the same step.
        """
        try:
            error: GsyncError | None = None
            try:
                await self._feed()
            except (ConfigError, InputTypeError, DataFailed) as failure:
                error = failure
            if self._held is not None:
                step, batch = self._held
                self._held = None
                try:
                    # Marked last only if the data really ended: after a read
                    # failure the step still runs, and the failure is raised after it.
                    await self._dispatch(step, batch, last=error is None)
                except (ConfigError, InputTypeError) as failure:
                    error = failure  # the earlier step's problem comes first
            if error is not None:
                if self.steps_dispatched == 0:
                    raise error
                self.deferred_error = error
        finally:
            for stream in self._streams:
                stream.close()
            if self.worker is not None:
                self.worker.stop()
        self._server.post(Close("end of data"))

    async def _feed(self) -> None:
        step = 0
        for epoch in range(self._epochs):
            batches = 0
            async with aclosing(self._batches(step)) as batches_of_epoch:
                async for batch in batches_of_epoch:
                    # Resuming replays the data and skips the batches the
                    # checkpoint already includes.
                    if step >= self._first_step:
                        held, self._held = self._held, (step, batch)
                        if held is not None:
                            try:
                                await self._dispatch(*held, last=False)
                            except BaseException:
                                self._held = None  # nothing after a bad batch is dispatched
                                raise
                    step += 1
                    batches += 1
            if batches == 0:
                raise ConfigError(
                    "data yielded no batch" if epoch == 0
                    else f"data yielded no batch in epoch {epoch}: pass a re-iterable (a list or a DataLoader), not a one-shot iterator"
                )

    async def _dispatch(self, step: int, batch: Any, last: bool) -> None:
        rows = batch_rows(batch, step)
        topology = self._topology
        if self._process_local:
            # This process's own batch; every process's is as large (checked each step).
            counts = shard_rows(rows, topology.local_devices)
            shards = split_batch(batch, topology.local_devices)
            total_rows = rows * topology.world_size
        else:
            counts = shard_rows(rows, topology.world_devices)[topology.local_slice]
            shards = split_batch(batch, topology.world_devices)[topology.local_slice]
            total_rows = rows
        self._server.post(StepDispatched(step, tuple(counts), total_rows, last))
        self.steps_dispatched += 1
        for stream, shard, count in zip(self._streams, shards, counts):
            await stream.send(Shard(step, count, total_rows, shard))

    async def _batches(self, step: int) -> Any:
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
                raise DataFailed(step) from error
            yield batch
            step += 1
