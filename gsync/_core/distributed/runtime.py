"""What a multi-process ``fit`` adds to a one-process one, in one object the engine drives.

Every method blocks (they are collectives or store round trips), so the
engine calls them from its own threads: setup and teardown from a dedicated
``gsync-dist`` worker thread, the per-step agreement from the communication
thread, right after that step's bucket reductions, so every rank issues the
same collectives in the same order.

On an NCCL group the small host-side collectives (the per-step agreement,
``all_reduce`` of CPU values) run on a gloo group over the same ranks
instead. On NCCL they would go through the GPU and back: ``.cpu()`` of the
result waits for the stream, so every step would drain the pipeline behind
the step's gradient reductions, and the host would block where the run's
abort flag cannot reach it (behind a reduction a dead peer never completes,
until ProcessGroupNCCL's watchdog kills the process). On gloo they wait on
the host in slices that read the abort flag (:mod:`gsync._core.distributed.waiting`),
for nothing but the other ranks' hosts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..base.agreement import AgreedStep, StepFacts
from ...errors import ConfigError, GsyncError, LostRank, PeerFailed, PeerLost, SyncTimeout
from ..topology import Topology
from .agreement import (
    agree_on_order,
    broadcast_module_state,
    gather_topology,
    union_of_names,
    verify_same_parameters,
    verify_same_start,
)
from .failures import FailureBoard, FailureReport, failure_report, peer_failed
from ..base.faults import PEER_GONE_KEY, MembershipBroken, abort_communicator, connection_lost
from .heartbeat import STALE_AFTER_S, Heartbeat, Whereabouts
from .membership import GroupMembership, join
from .waiting import wait_work

__all__ = ("ProcessGroupAgreement", "ProcessGroupRuntime")

# gloo's own timeout is set a little past gsync's, so gsync's SyncTimeout,
# which names what is missing, fires first.
GROUP_TIMEOUT_MARGIN_S = 30.0
# How long a rank whose collective timed out waits for a peer's own report
# before naming a live peer stuck from its heartbeat: a peer whose own timeout
# fired at about the same time reports within it, and its report says more.
# A failed peer publishes its report before it closes its group, so a
# collective that failed on a closed connection finds it at once.
_PEER_REPORT_GRACE_S = 0.5

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def host_group(membership: GroupMembership, timeout_s: float) -> dist.ProcessGroupGloo | None:
    """For a membership whose collectives run on CUDA (NCCL), a gloo group over the same ranks; else ``None``.

    Collective: every rank of the membership calls it, and it blocks until
    all have (up to ``timeout_s``). Its rendezvous keys live under the
    membership's namespace, so they are this run's alone.
    """
    if membership.device.type != "cuda":
        return None
    store = dist.PrefixStore(f"{membership.namespace}/host-group", membership.store)
    return dist.ProcessGroupGloo(store, membership.rank, membership.world_size, timedelta(seconds=timeout_s))


def host_all_reduce(
    group: dist.ProcessGroupGloo, values: torch.Tensor, op: str, abort: threading.Event | None
) -> torch.Tensor:
    """``values`` (a CPU tensor) reduced in place over ``group`` with ``op``; returns it. Collective.

    :raises ~gsync._core.threads.FitAborted: when ``abort`` is set while waiting.
    :raises RuntimeError: (from gloo) when a peer is gone or the group timed out.
    """
    options = dist.AllreduceOptions()
    options.reduceOp = _REDUCE_OPS[op]  # type: ignore[assignment]  # the stubs call the members RedOpType
    # A bare gloo backend, not a registered ProcessGroup: its own allreduce (which the stubs do not list).
    wait_work(group.allreduce([values], options), abort, blocking=True)  # type: ignore[attr-defined]
    return values


def agree_over(
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    world_size: int,
    num_params: int,
    facts: StepFacts,
    process_local_rows: bool,
    change_wanted: bool = False,
) -> AgreedStep:
    """One step's agreement over ``world_size`` ranks, whose sum of a CPU float64 tensor is ``all_reduce``.

    ``change_wanted``: this rank wants the membership to change after this
    step (an elastic run: a process knocked, or this rank leaves); the
    agreed step says whether any rank did.

    See :meth:`ProcessGroupRuntime.agree_step`.
    """
    step = facts.step
    values = torch.ones(num_params + 6, dtype=torch.float64)
    if facts.unused:
        values[list(facts.unused)] = 0.0
    rows = facts.rows if process_local_rows else 0
    tail = [1.0 if facts.skip else 0.0, rows, rows * rows, facts.loss, 1.0 if facts.last else 0.0, 1.0 if change_wanted else 0.0]
    values[num_params:] = torch.tensor(tail, dtype=torch.float64)
    values = all_reduce(values)
    if process_local_rows:
        total, squares = float(values[num_params + 1]), float(values[num_params + 2])
        # Equal sizes exactly when the sum of squares is world * mean^2.
        if abs(total * total - world_size * squares) > 0.5:
            raise ConfigError(
                f"ranks fed batches of different sizes at step {step} (mean {total / world_size:g} rows); with "
                "process-local data every rank's batch must have the same number of rows (use drop_last=True), "
                "unless the ranks join uneven data (uneven='join'), whose steps weigh each rank's rows"
            )
    ending = int(values[num_params + 4])
    if 0 < ending < world_size:
        raise ConfigError(
            f"{ending} of {world_size} ranks have no data after step {step} while the others "
            "do: every rank must run the same number of steps (same data length and epochs; with "
            "process-local data, equal-length shards such as a DistributedSampler with drop_last=True, or "
            "uneven='join' to let a rank whose data ended step on with empty shards until every rank's has)"
        )
    unused = tuple(int(p) for p in torch.nonzero(values[:num_params] == 0).flatten().tolist())
    return AgreedStep(unused, bool(values[num_params] > 0), float(values[num_params + 3]), bool(values[num_params + 5] > 0))


class ProcessGroupRuntime:
    def __init__(
        self,
        membership: GroupMembership,
        topology: Topology,
        heartbeat: Heartbeat,
        host: dist.ProcessGroupGloo | None = None,
        elastic: bool = False,
        names: Sequence[int] | None = None,
    ) -> None:
        self.membership = membership
        self.names = tuple(names) if names is not None else None
        """Each group rank's launch rank, in an elastic run (ranks are renumbered when the membership changes,
        but reports name a rank as it was launched)."""
        self.elastic = elastic
        """A generation of an elastic run: a peer that is gone is a membership change, not a failure to name."""
        self.change_wanted = False
        """This rank wants the membership changed after the current step (:meth:`want_change`)."""
        self.change_after: int | None = None
        """The step after which every rank agreed to change the membership (set in the communication thread)."""
        self.topology = topology
        self.board = FailureBoard(membership, None if names is None else tuple(names)[membership.rank])
        self.heartbeat = heartbeat
        self.host = host
        """The gloo group of an NCCL run's host-side collectives (see :func:`host_group`); ``None`` on gloo."""

    def want_change(self) -> None:
        """This rank wants the membership changed after the current step: the next step's agreement tells every
        rank. Safe from any thread (a signal handler, the membership watcher): one flag, read once per step."""
        self.change_wanted = True

    @classmethod
    def start(
        cls,
        process_group: dist.ProcessGroup | None,
        store: dist.Store | None,
        device_type: str,
        first_device: torch.device,
        local_devices: int,
        step_timeout: float,
        process_local_data: bool,
        abort: threading.Event,
        elastic: bool = False,
        names: Sequence[int] | None = None,
    ) -> ProcessGroupRuntime:
        """Join the group and agree on the topology. Collective; blocks until every rank joined.

        Every collective of the run leaves once ``abort`` is set (the run is
        ending), so no thread of this rank stays inside one.

        ``step_timeout``: the longest gsync itself waits for a step
        (``sync_timeout``, times the local devices that may take turns).

        :raises ~gsync.ConfigError: for a missing environment, a group or store
            gsync cannot use, or process-local data with unequal device counts.
        """
        membership = join(
            process_group,
            device_type,
            step_timeout + GROUP_TIMEOUT_MARGIN_S,
            store=store,
            device=first_device if device_type == "cuda" else None,
            abort=abort,
        )
        # An elastic run goes on without a silent peer as soon as its beat is stale; without elastic the run
        # ends, so it waits longer for a collective to name the peer first.
        heartbeat = Heartbeat(membership, lost_after_s=STALE_AFTER_S) if elastic else Heartbeat(membership)
        try:
            # Beating starts before the first collective, so once it completes
            # every rank's first beat is in the store.
            heartbeat.start()
            host = host_group(membership, step_timeout + GROUP_TIMEOUT_MARGIN_S)
            topology = gather_topology(membership, local_devices)
            if process_local_data and topology.world_devices != local_devices * topology.world_size:
                raise ConfigError(
                    "process-local data needs the same number of devices on every rank (the weights assume "
                    f"equal shares); this rank has {local_devices} of {topology.world_devices} over "
                    f"{topology.world_size} ranks"
                )
        except BaseException:
            heartbeat.stop()
            membership.close()
            raise
        return cls(membership, topology, heartbeat, host, elastic, names)

    def prepare(self, replicas: Sequence[nn.Module], first_step: int, broadcast: bool = True) -> None:
        """Check every rank trains the same parameters from the same step, and start every replica from rank 0's
        state (unless not ``broadcast``: an elastic generation whose ranks agreed on the state). Collective.

        :raises ~gsync.ConfigError: on every rank, naming the first parameter
            (and rank) that differs, or the ranks' steps when they resumed from different checkpoints.
        """
        first = replicas[0]
        verify_same_parameters(self.membership, [(n, p) for n, p in first.named_parameters() if p.requires_grad])
        verify_same_start(self.membership, first_step)
        if not broadcast:
            return
        broadcast_module_state(self.membership, first)
        state = first.state_dict()
        for replica in replicas[1:]:
            replica.load_state_dict(state)

    def agree_order(self, order: Sequence[int]) -> list[int]:
        """Rank 0's observed gradient order, so every rank rebuilds the same bucket plan. Collective."""
        return agree_on_order(self.membership, order)

    def agree_step(self, num_params: int, facts: StepFacts, process_local_rows: bool) -> AgreedStep:
        """Agree on one step's unused parameters, skip flag and loss (and row counts for local data). Collective.

        One small all-reduce carries them all, so no rank issues a collective
        after its last step that a failed peer would never match.

        :raises ~gsync.ConfigError: when ranks fed process-local batches of
            different sizes, or their data ends at different steps
            (``facts.last``: this rank has no further step).
        """
        agreed = agree_over(
            self._sum_on_host, self.membership.world_size, num_params, facts, process_local_rows, self.change_wanted
        )
        if agreed.change_membership:
            self.change_after = facts.step
        return agreed

    def _sum_on_host(self, values: torch.Tensor) -> torch.Tensor:
        if self.host is not None:
            return host_all_reduce(self.host, values, "sum", self.membership.abort)
        return self.all_reduce(values, "sum")

    def all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        """``values`` reduced over every rank with ``op`` (``"sum"``, ``"max"``, ``"min"``). Collective.

        CPU values of an NCCL run go over :attr:`host` (see the module docstring).
        """
        if self.host is not None and values.device.type == "cpu":
            return host_all_reduce(self.host, values.clone(memory_format=torch.contiguous_format), op, self.membership.abort)
        reduce_op = _REDUCE_OPS[op]
        moved = values.to(self.membership.device)
        self.membership.wait(dist.all_reduce(moved, op=reduce_op, group=self.membership.group, async_op=True))
        return moved.to(values.device)

    def watch(self, callback: Callable[[FailureReport], object]) -> None:
        self.board.start_watching(callback)

    def report(self, error: BaseException, fallback_site: str = "fit") -> None:
        """Tell the other ranks why this rank's run is ending (at ``fallback_site``, when ``error`` names no site).

        Not for :class:`~gsync.PeerFailed` (the peer told everyone itself),
        but for :class:`~gsync.PeerLost`: the lost rank cannot, and a stuck
        one learns that way that it was named.
        """
        if isinstance(error, PeerLost) or not isinstance(error, PeerFailed):
            rank = self.membership.rank if self.names is None else self.names[self.membership.rank]
            self.board.report(failure_report(rank, error, fallback_site))

    def union_of_names(self, names: Sequence[str]) -> list[str]:
        """Every rank's names, sorted. Collective."""
        return union_of_names(self.membership, names)

    def track(self, where: Callable[[], Whereabouts], on_lost: Callable[[list[LostRank]], object]) -> None:
        """Beat ``where()`` from now on, and call ``on_lost`` (from the heartbeat thread) once a peer falls silent."""
        self.heartbeat.where = where
        if not self.elastic:
            self.heartbeat.on_lost(on_lost)
            return
        group = self.membership.group

        def lost(ranks: list[LostRank]) -> object:
            # An elastic NCCL run's communicator is aborted first: NCCL would wait on the silent peer for ever.
            abort_communicator(group)
            return on_lost(ranks)

        self.heartbeat.on_lost(lost)

    def blame_peer(self, error: GsyncError) -> GsyncError:
        """For a failed or stalled collective, the peer that caused it: its own report, else its heartbeat.

        A peer's report (:class:`~gsync.PeerFailed`) wins. Without one, the
        heartbeats name the peers that stopped beating, or, for a timeout,
        the live peers that were not waiting in a collective
        (:class:`~gsync.PeerLost`). Blocks up to a few seconds (the time a
        killed peer's beat takes to go stale). A timeout that names a
        stalled local device is this rank's own diagnosis and is kept.
        """
        if isinstance(error, SyncTimeout) and (error.missing or error.stalled_devices):
            return error
        if self.elastic:
            return self._elastic_blame(error)
        reports: list[FailureReport] = []
        corroborations: list[FailureReport] = []

        def reported() -> bool:
            try:
                report = self.board.peer_report()
            except Exception:  # noqa: BLE001 - a store that is gone is handled below
                return False
            if report is not None and report.error_type == "PeerLost":
                # Another survivor's verdict, not a culprit: this rank names whom it finds itself.
                corroborations[:] = [report]
                return False
            if report is not None:
                reports.append(report)
            return report is not None

        heartbeat = self.heartbeat
        during = getattr(error, "step", -1)
        host = self.membership.store_host
        if heartbeat.store_trouble() is not None:
            # Without a store neither reports nor beats can be read (and a
            # frozen one would block this thread): the store's host rank is
            # the one suspect there is, when gsync put the store there.
            seen = heartbeat.last_seen(host, during=during) if host is not None and host != self.membership.rank else None
            if seen is None:
                return error
            blamed_host = PeerLost([seen])
            blamed_host.__cause__ = error
            return blamed_host
        lost = heartbeat.diagnose(
            heartbeat.stale_after_s + 2 * heartbeat.interval_s,
            reported,
            stuck_after_s=_PEER_REPORT_GRACE_S if isinstance(error, SyncTimeout) else None,
            during=during,
        )
        if not reports and not lost and heartbeat.store_trouble() is not None and host is not None and host != self.membership.rank:
            # The store went away while this rank looked: it lives in the host rank's process.
            seen = heartbeat.last_seen(host, during=during)
            lost = [seen] if seen is not None else []
        blamed: GsyncError
        if reports:
            blamed = peer_failed(reports[0])
        elif lost:
            blamed = PeerLost(lost)
        elif corroborations:
            blamed = peer_failed(corroborations[0])
        else:
            return error
        blamed.__cause__ = error
        return blamed

    def _elastic_blame(self, error: GsyncError) -> GsyncError:
        """An elastic run's blame: a peer's own failure ends the run as always; anything else changes the membership.

        A failed peer publishes its report before it closes its group, so a
        collective that failed on its closed connection finds the report at
        once: no wait for heartbeats, whose silence the change does not need.
        Without a report, a closed connection is a member gone, and the
        change is told so (:meth:`_note_peer_gone`).
        """
        try:
            report = self.board.peer_report()
        except Exception:  # noqa: BLE001 - a store that is gone: the membership change finds out
            report = None
        blamed: GsyncError
        if report is not None and report.error_type not in ("PeerLost", "MembershipBroken"):
            blamed = peer_failed(report)
        else:
            if connection_lost(error):
                self._note_peer_gone()
            step = getattr(error, "step", -1)
            blamed = MembershipBroken(step, getattr(error, "bucket", None), "a member of the elastic run is gone", site=getattr(error, "site", None))
        blamed.__cause__ = error
        return blamed

    def _note_peer_gone(self) -> None:
        """Tell the membership change to come that a member of this generation is gone (see ``connection_lost``).

        Written before this rank asks for the change, so the members deciding
        it go on as soon as everyone else answered, without waiting out
        ``answer_within`` for the one that never will.
        """
        try:
            self.membership.store.set(PEER_GONE_KEY, "1")
        except Exception:  # noqa: BLE001 - a store that is gone: the membership change finds out
            pass

    def store_unreachable(self) -> bool:
        """Whether the store looks gone or frozen (its calls fail, or one has not returned for seconds)."""
        return self.heartbeat.store_trouble() is not None

    def close(self) -> None:
        """Stop beating and watching, and destroy what gsync created (a user's group stays up)."""
        unreachable = self.store_unreachable()
        self.heartbeat.stop()
        # Waking the watcher is a store write: not to a store that does not answer.
        self.board.stop(wake=not unreachable)
        # Dropped here, in the thread that closes: gloo's teardown waits for its in-flight work, as the
        # membership's does.
        self.host = None
        self.membership.close()


class ProcessGroupAgreement:
    """The :class:`~gsync._core.base.agreement.StepAgreement` of a multi-process run: one small all-reduce per step."""

    local = False

    def __init__(self, runtime: ProcessGroupRuntime, num_params: int, process_local_rows: bool) -> None:
        self._runtime = runtime
        self._num_params = num_params
        self._process_local_rows = process_local_rows

    def agree(self, facts: StepFacts) -> AgreedStep:
        return self._runtime.agree_step(self._num_params, facts, self._process_local_rows)
