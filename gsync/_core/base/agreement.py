"""The per-step agreement: what every replica must share about a step before applying it.

After a step's last reduction the sync server settles, for every device of
every process, which parameters got no gradient anywhere (the optimizer must
skip exactly those), whether any device skips the step, and the step's global
mean loss. In one process that is arithmetic on what the local devices
reported (:class:`LocalAgreement`); across processes it is one small
collective (:class:`~gsync._core.distributed.runtime.ProcessGroupAgreement`). Both
implement :class:`StepAgreement`, so the server treats them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ("AgreedStep", "LocalAgreement", "StepAgreement", "StepFacts")


@dataclass(frozen=True)
class StepFacts:
    """What this process knows of a step once its reductions are done."""

    step: int
    unused: tuple[int, ...]
    """Parameters that got no gradient on any local device."""
    skip: bool
    """A local device's loss was not finite (``on_nonfinite="skip"``)."""
    rows: int
    """This process's rows in the step (ranks fed process-local data must agree)."""
    loss: float
    """The local devices' share of the step's global mean loss."""
    last: bool
    """No step follows in this process's data (``fit`` reads one batch ahead)."""


@dataclass(frozen=True)
class AgreedStep:
    unused: tuple[int, ...]
    skip: bool
    loss: float
    change_membership: bool = False
    """An elastic run changes its membership after this step (every rank agreed)."""


class StepAgreement(Protocol):
    local: bool
    """True when :meth:`agree` needs no communication (and so no thread of its own)."""

    def agree(self, facts: StepFacts) -> AgreedStep:
        """What every process agrees on for this step. Collective across processes, in the comm thread.

        :raises ~gsync.ConfigError: when processes cannot agree (data of
            different lengths or batch sizes): on every rank alike.
        """
        ...


class LocalAgreement:
    """One process: the local facts are the global ones."""

    local = True

    def agree(self, facts: StepFacts) -> AgreedStep:
        return AgreedStep(facts.unused, facts.skip, facts.loss)
