"""Gradient transports: every one implements :class:`Collective`."""

from .base import Collective as Collective
from .local import LocalCollective as LocalCollective
from .nccl import NcclCollective as NcclCollective
from .process_group import ProcessGroupCollective as ProcessGroupCollective

__all__ = ("Collective", "LocalCollective", "NcclCollective", "ProcessGroupCollective")
