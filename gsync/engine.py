"""The engine: the public entry point. It validates settings and input, then opens sessions and runs fits.

A session (:mod:`gsync.session`) builds a replica, optimizer and bucket
buffers per device and runs the sync server and one actor per device in one
task group, held open until it is closed; :meth:`Engine.fit` opens one, runs
its loop (:meth:`gsync.Session.fit`) and closes it. What the parts below the
engine receive of it is one frozen settings object, taken as a session opens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import Checkpoint
from ._core.transports.compressed import resolve_compression
from .comm.compressed import CompressionHook
from ._core.step.context import SiteHook
from ._core.arguments import uneven_setting
from ._core.arguments import check_shardable, checked_recipe, positive, resume_argument, settings_for_model
from ._core.devices import DeviceSpec, parse_devices, plan_device_threads
from ._core.session.cancelling import cancellation_kept
from ._core.session.service import SessionSlot
from ._core.settings import EngineSettings
from ._core.distributed import should_use_distributed
from .elastic import Elastic
from .errors import ConfigError, _raised_at_caller
from ._core.session.fit_settings import FitLoopSettings
from ._core.monitoring import monitor_for
from .result import FitResult, FitStats
from .session import SessionOpener
from ._core.trace_files import trace_setting
from .trace import Trace
from .types import LossFn, MetricFn, OptimizerFactory, SchedulerFactory


__all__ = ("Engine", "FitResult", "FitStats")

logger = logging.getLogger("gsync")

class Engine:
    """Data-parallel training over this process's devices, and over other processes' when it spans several.

    :param devices: device strings or ``torch.device`` objects; ``"cpu:N"`` is the
        N-th virtual CPU device. Default: every visible CUDA device, else ``["cpu"]``.
    :param bucket_cap_mb: largest gradient bucket, in MiB.
    :param first_bucket_mb: size of the first bucket, kept small so the first
        reduction starts early in backward.
    :param sync_timeout: seconds a step may take to synchronize (from the
        moment the sync server starts on it), and an optimizer step or a
        device's share of an evaluation batch may take, before
        :class:`~gsync.SyncTimeout` is raised (per device: devices that take
        turns, see ``device_threads``, give a step as many times that).
        Reading data is not timed.
    :param on_nonfinite: ``"raise"`` (default) to stop with
        :class:`~gsync.NonFiniteLoss` when a device's loss is NaN or infinite,
        ``"skip"`` to leave that step's update out on every device.
    :param check_replicas_every: compare a fingerprint of every local
        replica's parameters every N steps and raise
        :class:`~gsync.ReplicasDiverged` if they differ (one pass over the
        parameters per check). Off by default; needs two or more devices in
        this process (replicas are not compared across processes).
    :param trace: record a timeline of every phase and reduction in
        ``FitResult.trace`` and ``Session.trace`` (see :class:`gsync.Trace`);
        ``True`` for a fresh trace per fit or session, a ``Trace`` instance to
        record into, or a file path (``"run.json"``): a fresh trace per fit or
        session, written there as a Chrome/Perfetto trace whenever it ends,
        failed and cancelled ones included (a failure is marked on its track,
        and the error's message ends with ``(trace: PATH)``). Across processes
        each rank writes its own file: ``run.rank0.json``, ``run.rank1.json``.
        Missing directories are created.
    :param process_group: a ``torch.distributed`` group to synchronize over,
        across processes. Without one, gsync spans processes when
        ``WORLD_SIZE`` > 1 (as under ``torchrun``), joining the default group
        or initialising it from the environment (gloo for CPU devices, NCCL
        for CUDA). Each process lists only its own devices; under torchrun the
        default is ``cuda:LOCAL_RANK``, or ``["cpu"]`` without CUDA. gsync
        destroys only a group it created.
    :param store: the ``torch.distributed`` store for failure reports between
        processes, when ``process_group`` is not the default group's.
    :param compression: reduce gradient buckets compressed: ``"bf16"`` or
        ``"fp16"`` (half the bytes of fp32; each device's gradient is
        multiplied by its share of the batch in fp32, cast, the casts summed
        in that dtype, and the sum cast back into the fp32 gradients, so fp16
        cannot overflow where the mean does not), or a
        :class:`gsync.CompressionHook` of your own (compress, reduce,
        decompress). Every replica applies the same decompressed gradient,
        and two devices of one process give the same parameters as one
        device in each of two processes. ``None`` (default): the bucket's own dtype.
    :param device_threads: which OS threads run the devices' forward,
        backward and optimizer steps. ``"per_device"``: one thread per device,
        so devices compute at the same time (what GPUs need, to launch their
        kernels concurrently). On CPU the process's cores
        (``torch.get_num_threads()`` as the engine is built) are split among
        the device threads, as torchrun gives each of its processes one
        thread rather than every core: each device thread runs torch with
        ``cores // len(devices)`` intra-op threads and gsync's communication
        thread with the cores left over, at least one each
        (:attr:`intra_op_threads`). ``"shared"``: this process's CPU devices
        take turns on one thread, each kernel on every core, and no two
        device threads compete for the GIL, which pays where kernels are
        short: 8 CPU devices on a model of small tensors took 0.48-0.73x the
        time on one shared thread that they took on eight. ``"auto"``
        (default): on CPU, ``"per_device"`` while each device can have a
        core of its own (``len(devices) <= cores``) and ``"shared"`` beyond,
        or where torch's parallel backend is not OpenMP (its threads cannot
        be split per thread); on GPUs ``"per_device"``. (Two devices of a
        10M-parameter MLP on 2 cores took 0.84-1.00x the time with a thread
        and a core each that they took taking turns on both cores: torch
        splits one replica's kernels over two cores less well than two
        replicas split the cores: the performance page of the docs,
        docs/performance.md, has the figures.) Results do not depend on
        the setting beyond the last bit of kernels that torch splits over
        several threads, whose rounding can depend on the thread count.
        Sharing applies to CPU devices only. A device's wait for its turn
        counts against no timeout: each device gets ``sync_timeout`` for
        its own work. On a shared thread, code of yours that waits for
        another device inside a device's job (a ``loss_fn``, a hook, a
        custom autograd Function that waits on a peer) waits for a device
        that cannot run until it returns: use ``"per_device"`` for that.
    :param elastic: ``True``, or a :class:`gsync.Elastic`, to go on when a
        rank is lost: the survivors agree on a new membership, re-form the
        group on the same store and redo the interrupted step with the same
        global batch split over themselves; a process started again with the
        same command and environment joins at the next step boundary and is
        sent the state over the group (``FitResult.membership`` records each
        change; each is logged at WARNING). A rank whose own code raised still
        ends the run on every rank. Host the store outside the ranks
        (torchrun's agent store, or ``store=``) so any rank may be lost; see
        the elastic runs page of the docs.
    :param shard_optimizer: ``True`` to shard the optimizer's state over
        every device of the run (ZeRO stage 1): each device owns a
        contiguous shard of every gradient bucket, receives the reduced
        gradient of its shard only (a reduce-scatter), steps the optimizer
        on it, keeping state for it only (about 1/N of it on N devices),
        and the updated parameters are all-gathered back into every
        replica. The result equals the unsharded run's (within rounding),
        checkpoints hold the whole state as unsharded ones do (across
        processes a checkpoint gathers every rank's shards: a collective
        every rank takes at the same step), and ``elastic`` is refused with
        it. See the sharding page of the docs.
    :raises ~gsync.ConfigError: for any invalid value, before anything is built.
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        sync_timeout: float = 300.0,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        check_replicas_every: int | None = None,
        trace: bool | Trace | str | os.PathLike[str] = False,
        process_group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        compression: Literal["bf16", "fp16"] | CompressionHook | None = None,
        device_threads: Literal["auto", "shared", "per_device"] = "auto",
        elastic: bool | Elastic = False,
        shard_optimizer: bool = False,
    ) -> None:
        self.bucket_cap_mb = positive("bucket_cap_mb", bucket_cap_mb)
        self.first_bucket_mb = positive("first_bucket_mb", first_bucket_mb)
        self.sync_timeout = positive("sync_timeout", sync_timeout)
        if on_nonfinite not in ("raise", "skip"):
            raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.on_nonfinite: Literal["raise", "skip"] = on_nonfinite
        self.compression: CompressionHook | None = resolve_compression(compression)
        """The hook every bucket is reduced through (``"bf16"`` becomes ``LowPrecision(torch.bfloat16)``), or ``None``."""
        if check_replicas_every is not None and (
            isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) or check_replicas_every < 1
        ):
            raise ConfigError(f"check_replicas_every must be a positive int or None, got {check_replicas_every!r}")
        self.check_replicas_every = check_replicas_every
        self.process_group = process_group
        self.store = store
        self.elastic: Elastic | None = Elastic.of(elastic)
        """How the run changes membership when a rank is lost or joins (``None``: it does not; a loss ends it)."""
        _refuse_what_elastic_cannot_do(self.elastic, process_group, shard_optimizer)
        self.shard_optimizer = shard_optimizer
        """Whether each device keeps optimizer state for its own shard of every bucket only."""
        self.distributed = should_use_distributed(process_group) or self.elastic is not None
        if devices is None and self.distributed:
            devices = _default_devices_of_this_process()
        self.devices: list[DeviceSpec] = parse_devices(devices)
        if self.elastic is not None and any(spec.torch_device.type == "cuda" for spec in self.devices):
            logger.warning(
                "gsync: elastic=... on CUDA devices re-forms NCCL groups and aborts the old communicator after a "
                "loss; a world of one has trained on a GPU, but re-forming NCCL groups after a loss has not run on "
                "GPUs yet (see the elastic runs page of the docs)"
            )
        plan = plan_device_threads(self.devices, device_threads)
        self._device_threads_asked = device_threads
        self.device_threads: Literal["shared", "per_device"] = plan.device_threads
        """The threads that run this process's devices (``device_threads`` with ``"auto"`` resolved)."""
        self.intra_op_threads: tuple[int, int] | None = plan.intra_op_threads
        """Torch intra-op threads for each device thread and for the communication thread, when this process's
        CPU devices each have a thread and split its cores (``torch.get_num_threads()`` as the engine is built):
        an equal share per device, the cores left over (at least one) for the reduction. ``None``: each thread
        runs with the count of the thread that opens the session."""
        # How many of this process's devices may run one after another within a step, each given sync_timeout:
        # CPU devices always may (on a shared thread, or in the first step's turns).
        self._devices_in_turn = plan.devices_in_turn
        if check_replicas_every is not None and len(self.devices) < 2:
            raise ConfigError(
                "check_replicas_every compares the replicas of this process, and it has only one device; "
                "gsync does not compare replicas across processes yet: drop the option or list several devices"
            )
        self.trace_file = trace_setting(trace)
        """The file each fit or session writes its trace to (absolute; see ``trace``), or ``None``."""
        self.trace = trace
        # Called as hook(device_index, step, site, abort) in the worker thread as each site starts, by every
        # session of this engine, the open one included: a session reads this list itself, not a copy taken as it
        # opened, so a fault gsync.testing.inject arms while a session is open applies from its next site.
        self._site_hooks: list[SiteHook] = []
        self._slot = SessionSlot()

    def _settings(self) -> EngineSettings:
        """What a session opened now receives of this engine (with the engine's live list of site hooks)."""
        return EngineSettings(
            devices=tuple(self.devices),
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            sync_timeout=self.sync_timeout,
            on_nonfinite=self.on_nonfinite,
            check_replicas_every=self.check_replicas_every,
            compression=self.compression,
            device_threads=self.device_threads,
            intra_op_threads=self.intra_op_threads,
            devices_in_turn=self._devices_in_turn,
            distributed=self.distributed,
            process_group=self.process_group,
            store=self.store,
            elastic=self.elastic,
            trace=self.trace,
            trace_file=self.trace_file,
            site_hooks=self._site_hooks,
            shard_optimizer=self.shard_optimizer,
        )

    def __repr__(self) -> str:
        return f"Engine(devices={[d.name for d in self.devices]}, device_threads={self.device_threads!r})"

    @_raised_at_caller
    def session(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        scheduler: SchedulerFactory | None = None,
        clip_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
        resume: Checkpoint | str | os.PathLike[str] | None = None,
        process_local_data: bool = False,
        uneven: Literal["refuse", "join"] = "refuse",
        loggers: Sequence[Any] = (),
        log_all_ranks: bool = False,
    ) -> SessionOpener:
        """Open a session for your own loop: ``session = await engine.session(model, ...)``, or ``async with``.

        Awaited, it returns an open :class:`gsync.Session` you hold: use it
        from any task of this event loop (later notebook cells, a pytest
        fixture's test and teardown), then ``await session.aclose()``. As an
        async context manager it is the scoped form: ``async with
        engine.session(model, ...) as session:``, whose end is ``aclose()``
        (the only form on trio). ``await session.step(batch)`` is one
        optimizer step on every device (``session.step(b1, ..., bN)``
        accumulates N global batches into one step); ``session.fit``,
        ``session.evaluate``, ``session.all_reduce``, ``session.checkpoint``
        and ``session.model`` complete the loop. A clean close writes the
        trained weights into ``model``; after a failure (even one caught)
        ``model`` is left as it was, and the error's ``checkpoint`` holds the
        last consistent state. One session per engine is open at a time.

        The recipe features are the same as :meth:`fit`'s:

        - ``optimizer=lambda params: torch.optim.AdamW(params, ...)`` builds
          one optimizer per replica over its trainable parameters; a factory
          whose first parameter is named ``model`` (or ``module``) is given
          the replica itself (``lambda model: model.configure_optimizers(...)``),
          one named ``named_parameters`` its trainable ``(name, param)`` pairs.
        - ``scheduler=lambda optimizer: torch.optim.lr_scheduler.X(optimizer, ...)``
          (or a scheduler class whose other arguments have defaults, ``scheduler=LinearLR``)
          builds one LR scheduler per replica, stepped once after every step
          (applied or skipped), as a plain loop does; its state is in every checkpoint.
        - ``clip_grad_norm=max_norm`` clips the *reduced* gradient, as
          ``torch.nn.utils.clip_grad_norm_`` on one device would; replicas hold
          the same reduced gradient, so no extra collective is needed.
          ``clip_grad_norm=math.inf`` reports each step's ``grad_norm`` and
          clips nothing.
        - ``autocast=torch.bfloat16`` or ``torch.float16`` runs ``loss_fn``
          under ``torch.autocast`` for the device type; float16 adds one
          ``torch.amp.GradScaler`` per replica. Each replica's scaler looks at
          the *reduced* scaled gradients, identical everywhere, so every
          replica (on every process) skips or steps together and the scales
          stay equal.

        What a failure, a cancellation or a dropped session does is said in
        :mod:`gsync.session`: a call raises what failed while it ran, a
        failure while no call runs closes the session and is raised by the
        next call (or by ``aclose()``; in the scoped form it also cancels the
        block's code), and a cancelled call closes the session. Everything
        the session started has stopped once it is closed, and the engine
        can open another session.

        With ``process_local_data=True`` and ``uneven="join"`` every step
        starts with the ranks' row counts, so a rank whose data has ended
        says so with ``await session.step(None)`` (``step(None, None)`` when
        the others accumulate two batches: one ``None`` per batch it lacks):
        it joins the step with empty shards, and each step's gradient is the
        row-weighted mean over the rows that exist. Once no rank has a batch,
        ``step`` trains nothing and returns a result with ``rows == 0``: every
        rank's data has ended (see the multi-process page of the docs).

        ``loggers`` and ``log_all_ranks`` are :meth:`fit`'s: every step,
        whether by ``step`` or ``fit``, is logged, ``evaluate``'s results as
        ``eval/<name>``, and the loggers are finalized as the session ends.

        :raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError` for bad
            arguments, at this call, before anything is built; when opening
            while this engine has another session open (naming where it was
            opened); for ``with`` without ``async``; and for the held form on trio.
        """
        resume = resume_argument(resume)
        recipe = checked_recipe(model, optimizer, loss_fn, scheduler, clip_grad_norm, autocast, resume)
        if self.shard_optimizer:
            check_shardable(model)
        settings = settings_for_model(self._settings(), model, self._device_threads_asked)
        settings = uneven_setting(settings, uneven, process_local_data)
        monitor = monitor_for(
            self, model, loggers, log_all_ranks,
            _recipe_hparams(scheduler, clip_grad_norm, autocast, resume, process_local_data, uneven),
        )
        return SessionOpener(self._slot, settings, model, recipe, resume, bool(process_local_data), monitor=monitor)

    async def aclose(self) -> None:
        """Close the session this engine has open, if any, as :meth:`gsync.Session.aclose` does.

        A call of that session running in another task, a fit included, is
        ended with :class:`~gsync.SessionClosed` and the model left as it
        was. Finishes even if the calling task is cancelled meanwhile. A
        failure settled while no call ran is raised here; a membership change
        under way finishes first (see :meth:`gsync.Session.aclose`).

        :raises: what :meth:`gsync.Session.aclose` raises: a failure that no call has raised yet.
        """
        service = self._slot.service
        if service is not None:
            await service.close()

    @_raised_at_caller
    async def fit(
        self,
        model: nn.Module,
        data: Iterable[Any] | AsyncIterable[Any],
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        epochs: int = 1,
        resume: Checkpoint | str | os.PathLike[str] | None = None,
        process_local_data: bool = False,
        uneven: Literal["refuse", "join"] = "refuse",
        scheduler: SchedulerFactory | None = None,
        clip_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
        accumulate: int = 1,
        callbacks: Sequence[Any] = (),
        progress: bool | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep: int = 2,
        val_data: Iterable[Any] | AsyncIterable[Any] | None = None,
        eval_every: int | None = None,
        val_metric_fn: MetricFn | None = None,
        keep_best: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        loggers: Sequence[Any] = (),
        log_all_ranks: bool = False,
    ) -> FitResult:
        """Train ``model`` on ``data`` with one replica per device and return it trained.

        ``data`` yields *global* batches; each is split along dim 0 into one
        contiguous shard per device. ``loss_fn(model, shard)`` returns the mean
        loss of its shard; shards are weighted by their row counts, so every
        step equals one step of single-device training on the whole batch.
        ``fit`` is a loop over :meth:`session`, and takes the same recipe
        features (``scheduler``, ``clip_grad_norm``, ``autocast``), plus:

        - ``accumulate=N``: every N consecutive batches make one optimizer
          step (the mean of their gradients); the backward passes before the
          last of each group move no bytes. An epoch's trailing batches that
          do not fill a group are left out, with a warning.
        - ``callbacks``: objects with any of ``on_step_end(session, result)``,
          ``on_evaluate(session, evaluation)`` (with ``val_data``),
          ``on_epoch_end(session, epoch)`` and ``on_fit_end(session)``, sync or
          async, called on the event loop between steps (they may await
          ``session.evaluate(...)`` or take ``session.checkpoint()``). Raising
          :class:`~gsync.StopTraining` ends the fit early, normally; any other
          exception ends it and propagates unchanged.
        - ``progress``: a progress bar (``tqdm.auto`` when installed, else
          INFO lines on the ``gsync`` logger); by default on, except in tests
          and under CI.
        - ``loggers``: objects shaped like Lightning's ``Logger``
          (``log_metrics(metrics, step)``, and if they have them
          ``log_hyperparams(params)`` and ``finalize(status)``):
          :class:`gsync.loggers.CSVLogger`, :class:`gsync.loggers.TensorBoardLogger`,
          or Lightning's own. They get the run's settings once, each step's
          metrics (``loss``, ``lr``, ``step_seconds``, ... : the monitoring
          page of the docs names them) and ``"success"``, ``"failed"`` or
          ``"cancelled"`` at the end, on rank 0 only unless
          ``log_all_ranks=True``. A logger that raises is logged once on the
          ``gsync`` logger and left out from then on; training goes on.
        - ``checkpoint_dir``: write a checkpoint file (``step-00000041.pt``,
          see :meth:`Checkpoint.save`) every ``checkpoint_every`` steps and at
          the end, keeping the newest ``keep`` up to the one just written (a
          higher-numbered file is another run's, left alone); only rank 0 writes, in a thread
          of its own while training goes on (a step pays for copying the state;
          with ``shard_optimizer=True`` across processes, for gathering every
          rank's shards of the optimizer state as well, on every rank at the
          same step).
          With ``resume=checkpoint_dir`` the same command line serves the
          first run (no checkpoint yet: start from scratch) and every restart.
        - ``val_data``: validation batches (re-iterable: a list or a
          ``DataLoader``), evaluated with :meth:`Session.evaluate` (and
          ``metric_fn=val_metric_fn``) after every ``eval_every``-th global
          step and once at the end (not twice when the last step was just
          evaluated), on every rank. Each result is a
          :class:`~gsync.Evaluation` in ``FitResult.evaluations``, passed to
          the callbacks' ``on_evaluate(session, evaluation)`` (which may raise
          :class:`~gsync.StopTraining`: early stopping) and logged as
          ``eval/<name>``. ``keep_best="loss"`` (a metric the evaluation
          returns; ``best_mode="max"`` for one where higher is better) keeps
          the best evaluation's checkpoint as ``checkpoint_dir/best.pt``,
          beside the newest ``keep`` files and never rotated away; a resumed
          run goes on from the best its ``best.json`` records.

        The model passed in is only read until training succeeds; then it
        receives the first replica's parameters and buffers. If ``fit`` fails
        or is cancelled, the model is left as it was, and the error's
        ``checkpoint`` holds the last consistent state.

        ``resume`` continues from a checkpoint (an error's, a result's, a
        file written by :meth:`Checkpoint.save`, or the newest one in a
        directory; unreadable files there are skipped with a warning):
        replicas start from its state, ``data`` is replayed and the batches
        of its first ``checkpoint.step + 1`` steps (counted across epochs) are
        skipped, so ``data`` must yield the same batches in the same order as
        before. ``epochs`` counts every epoch of the run, including those
        before the checkpoint.

        Across processes, every process by default iterates the same global
        batches and keeps its own devices' shards (rank-major), so results do
        not depend on how devices are spread over processes. With
        ``process_local_data=True`` each process's ``data`` yields its own
        batches instead (e.g. a ``DataLoader`` with a ``DistributedSampler``
        and ``drop_last=True``), split over its own devices; every process's
        batches must then have the same size at each step (checked), and
        every process the same number of batches, unless ``uneven="join"``:
        then a rank whose data ends first steps on with empty shards until
        every rank's has ended (each epoch's, with ``epochs``), and every step
        equals one process training on every rank's batch of that step that
        exists, concatenated rank-major. By default (``"refuse"``) data of
        unequal length stops every rank with a ``ConfigError``.

        Cancelling the calling task (``anyio.move_on_after``, ``Task.cancel``,
        a notebook interrupt) stops every actor and worker thread and
        propagates the cancellation, within about half a second whatever the
        devices do (a thread stuck in native code is left behind, named in a
        warning); one that arrives while ``fit`` is already raising a failure
        is raised all the same, the failure its ``__context__``. The engine can ``fit``
        again. With ``Engine(elastic=...)`` a membership change mid-fit redoes
        the interrupted step over the new membership and the fit goes on.

        :raises ~gsync.ConfigError: or :class:`~gsync.InputTypeError` for bad
            input; for anything checkable up front, before any work starts.
        :raises ~gsync.WorkerFailed: when training code raises on a device.
        :raises ~gsync.SyncFailed: when a reduction raises.
        :raises ~gsync.SyncTimeout: when a step stalls for ``sync_timeout`` seconds.
        :raises ~gsync.NonFiniteLoss: when a loss is not finite (``on_nonfinite="raise"``).
        :raises ~gsync.DataFailed: when iterating ``data`` raises.
        :raises ~gsync.PeerFailed: when another process's fit failed.
        """
        resume = resume_argument(resume, checkpoint_dir)
        recipe = checked_recipe(model, optimizer, loss_fn, scheduler, clip_grad_norm, autocast, resume)
        if self.shard_optimizer:
            check_shardable(model)
        settings = FitLoopSettings.checked(
            data, epochs, accumulate, callbacks, progress, checkpoint_dir, checkpoint_every, keep, uneven=uneven,
            val_data=val_data, eval_every=eval_every, val_metric_fn=val_metric_fn, keep_best=keep_best,
            best_mode=best_mode,
        )
        engine_settings = settings_for_model(self._settings(), model, self._device_threads_asked)
        engine_settings = uneven_setting(engine_settings, uneven, process_local_data)
        monitor = monitor_for(
            self, model, loggers, log_all_ranks,
            _recipe_hparams(scheduler, clip_grad_norm, autocast, resume, process_local_data, uneven),
            {"epochs": epochs, "accumulate": accumulate, "checkpoint_every": checkpoint_every},
        )
        with cancellation_kept(
            "gsync: the fit was cancelled: every device stopped and the model is left as it was; fit again, with "
            "checkpoint_dir= and resume= to go on from the last checkpoint file"
        ):
            async with SessionOpener(
                self._slot, engine_settings, model, recipe, resume, bool(process_local_data), for_fit=True,
                monitor=monitor,
            ) as session:
                result = await session._fit(data, settings, result_model=model)
        return result


def _recipe_hparams(
    scheduler: object, clip_grad_norm: object, autocast: object, resume: Checkpoint | None, process_local_data: object,
    uneven: object,
) -> dict[str, object]:
    return {
        "scheduler": scheduler, "clip_grad_norm": clip_grad_norm, "autocast": autocast,
        "resume_step": None if resume is None else resume.step, "process_local_data": bool(process_local_data),
        "uneven": uneven,
    }


def _refuse_what_elastic_cannot_do(elastic: Elastic | None, process_group: object, shard_optimizer: object) -> None:
    """Engine options that contradict ``elastic=`` (or are not options at all), refused as the engine is built."""
    if elastic is not None and process_group is not None:
        raise ConfigError(
            "elastic=... builds each membership's group itself on the run's store, so it cannot use a "
            "process_group you made: drop process_group= (pass store= to say where the store is)"
        )
    if not isinstance(shard_optimizer, bool):
        raise ConfigError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
    if shard_optimizer and elastic is not None:
        raise ConfigError(
            "shard_optimizer=True cannot be elastic: each rank holds the only copy of its devices' optimizer "
            "shard, so a lost rank would take part of the optimizer state with it and the survivors could not "
            "go on exactly; drop elastic= (resume from a checkpoint instead) or drop shard_optimizer="
        )


def _default_devices_of_this_process() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"]
    return ["cpu"]
