"""Gradient transports: every one implements :class:`Collective`."""

from .base import Collective as Collective
from .local import LocalCollective as LocalCollective
from .nccl import NcclCollective as NcclCollective

__all__ = ("Collective", "LocalCollective", "NcclCollective")
