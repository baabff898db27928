"""Gradient transports: the :class:`Collective` protocol every one implements, and the public ones.

:class:`LocalCollective` reduces across the devices of one process;
:class:`CompressionHook` (with :class:`LowPrecision`, what
``Engine(compression="bf16")`` builds) compresses every bucket on its way
through any transport. NCCL and ``torch.distributed`` process groups are
gsync's own to pick (``Engine(devices=..., process_group=...)``), in
:mod:`gsync._core.transports`.
"""

from .base import Collective as Collective
from .compressed import AllReduce as AllReduce
from .compressed import CompressionHook as CompressionHook
from .compressed import LowPrecision as LowPrecision
from .local import LocalCollective as LocalCollective

__all__ = ("AllReduce", "Collective", "CompressionHook", "LocalCollective", "LowPrecision")
