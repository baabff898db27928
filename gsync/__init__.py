"""gsync: an asyncio, actor-style gradient synchronization engine for PyTorch data-parallel training."""

from .checkpoint import Checkpoint as Checkpoint
from .comm.base import Collective as Collective
from .comm.local import LocalCollective as LocalCollective
from .elastic import Elastic as Elastic
from .elastic import MembershipChange as MembershipChange
from .engine import Engine as Engine
from .engine import FitResult as FitResult
from .engine import FitStats as FitStats
from .errors import CheckpointError as CheckpointError
from .errors import ConfigError as ConfigError
from .errors import DataFailed as DataFailed
from .errors import Departed as Departed
from .errors import FitError as FitError
from .errors import GsyncError as GsyncError
from .errors import InputTypeError as InputTypeError
from .errors import MailboxClosed as MailboxClosed
from .errors import NonFiniteLoss as NonFiniteLoss
from .errors import PeerFailed as PeerFailed
from .errors import PeerLost as PeerLost
from .errors import LostRank as LostRank
from .errors import ReplicasDiverged as ReplicasDiverged
from .errors import SessionClosed as SessionClosed
from .errors import SessionLeftOpenWarning as SessionLeftOpenWarning
from .errors import StopTraining as StopTraining
from .errors import SyncFailed as SyncFailed
from .errors import SyncTimeout as SyncTimeout
from .errors import WorkerFailed as WorkerFailed
from .result import Evaluation as Evaluation
from .result import StepRecord as StepRecord
from .session import Session as Session
from .session import StepResult as StepResult
from .trace import Trace as Trace
from .trace import TraceEvent as TraceEvent
from .comm.compressed import CompressionHook as CompressionHook
from .comm.compressed import AllReduce as AllReduce
from .comm.compressed import LowPrecision as LowPrecision
from .session import SessionOpener as SessionOpener
from .types import LossFn as LossFn
from .types import MetricFn as MetricFn
from .types import OptimizerFactory as OptimizerFactory
from .types import SchedulerFactory as SchedulerFactory

__all__ = (
    "AllReduce",
    "Checkpoint",
    "CheckpointError",
    "Collective",
    "ConfigError",
    "DataFailed",
    "Departed",
    "Elastic",
    "Engine",
    "Evaluation",
    "FitError",
    "FitResult",
    "FitStats",
    "GsyncError",
    "InputTypeError",
    "LocalCollective",
    "MailboxClosed",
    "NonFiniteLoss",
    "PeerFailed",
    "PeerLost",
    "LostRank",
    "MembershipChange",
    "ReplicasDiverged",
    "Session",
    "SessionClosed",
    "SessionLeftOpenWarning",
    "StepRecord",
    "StepResult",
    "StopTraining",
    "SyncFailed",
    "SyncTimeout",
    "Trace",
    "TraceEvent",
    "WorkerFailed",
    "CompressionHook",
    "LossFn",
    "LowPrecision",
    "MetricFn",
    "OptimizerFactory",
    "SchedulerFactory",
    "SessionOpener",
)
