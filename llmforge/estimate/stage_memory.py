"""The memory of one pipeline rank by part (llmforge.estimate.memory computes it,
llmforge.estimate.offload moves parts of it to the host)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the most-loaded rank of one pipeline stage."""

    stage: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    reserved: float
    #: When the step peaks (llmforge.estimate.phases): the items are what is live then.
    peak: str = "start of the backward"

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.reserved
