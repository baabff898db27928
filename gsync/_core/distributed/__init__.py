"""Multi-process runs: joining a ``torch.distributed`` group, and what gsync agrees on through it.

The engine uses these helpers when a fit spans processes (``torchrun``, or a
process group the user passes). Each one is collective where it says so:
every rank of the group must call it, in the same order, or it blocks until
the group's timeout.

- :func:`join` joins (or adopts) the group and the key/value store that comes
  with it, and agrees on a run id so a second fit in the same processes never
  reads the first fit's keys.
- :func:`gather_topology`, :func:`verify_same_parameters`, :func:`verify_same_start`
  and :func:`broadcast_module_state` run once at the start of a fit;
  :func:`agree_on_order` before the bucket plan is rebuilt after the first step.
- :class:`FailureBoard` is the failure side channel: a rank whose worker fails
  writes a :class:`FailureReport` to the store, and every other rank's watcher
  thread hears of it at once, so peers raise :class:`PeerFailed` naming the
  failed rank instead of waiting on a collective that will never complete.
- :class:`Heartbeat` names the ranks that cannot report: every rank beats its
  step and phase through the store, so when a collective fails or times out,
  the survivors raise :class:`~gsync.PeerLost` naming the rank that stopped
  (killed, crashed, hung) or is stuck outside the collective.

Nothing here imports the engine.
"""

from .agreement import agree_on_order as agree_on_order
from .agreement import broadcast_module_state as broadcast_module_state
from .agreement import gather_topology as gather_topology
from .agreement import verify_same_parameters as verify_same_parameters
from .agreement import verify_same_start as verify_same_start
from .failures import FailureBoard as FailureBoard
from .failures import FailureReport as FailureReport
from .failures import failure_report as failure_report
from .failures import peer_failed as peer_failed
from .heartbeat import Heartbeat as Heartbeat
from .membership import GroupMembership as GroupMembership
from .membership import join as join
from .membership import should_use_distributed as should_use_distributed

__all__ = (
    "GroupMembership",
    "FailureBoard",
    "FailureReport",
    "Heartbeat",
    "agree_on_order",
    "broadcast_module_state",
    "failure_report",
    "gather_topology",
    "join",
    "peer_failed",
    "should_use_distributed",
    "verify_same_parameters",
    "verify_same_start",
)
