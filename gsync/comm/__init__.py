"""Gradient transports: every one implements :class:`Collective`."""

from .base import Collective as Collective
from .compressed import CompressedCollective as CompressedCollective
from .compressed import CompressionHook as CompressionHook
from .compressed import LowPrecision as LowPrecision
from .local import LocalCollective as LocalCollective
from .nccl import NcclCollective as NcclCollective
from .process_group import ProcessGroupCollective as ProcessGroupCollective

__all__ = (
    "Collective",
    "CompressedCollective",
    "CompressionHook",
    "LocalCollective",
    "LowPrecision",
    "NcclCollective",
    "ProcessGroupCollective",
)
