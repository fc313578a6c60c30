"""What the model needs after every optimizer step, as run parts (``after_update``): the MoE
routing bias (``model.moe.balance=bias``) and the float8 weight scales of FSDP's float8
all-gather. They run whether the step updated or was skipped (a skipped step leaves the bias
as it is: its move is multiplied by the guard's gate)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmforge.models.moe import update_expert_bias
from llmforge.parallel.float8 import precompute_scales
from llmforge.train.callbacks import Callback


@dataclass(frozen=True)
class ExpertBiasUpdate(Callback):
    """Auxiliary-loss-free balancing: each expert's routing bias moves toward an even load
    (``llmforge.models.moe.update_expert_bias``); ``reduce`` sums the loads over the ranks that
    route other tokens; ``gate`` is the guard's 1.0 (updated) or 0.0 (skipped) on the device."""

    model_parts: tuple[nn.Module, ...]
    rate: float
    gate: torch.Tensor
    reduce: Callable[[torch.Tensor], None] | None = None

    def after_update(self, step: int) -> None:
        update_expert_bias(self.model_parts, rate=self.rate, reduce=self.reduce, step_scale=self.gate)


class Fp8ScaleUpdate(Callback):
    """The next forward's float8 weight scales, for every float8 weight in one all-reduce
    (tensorwise float8 with FSDP's float8 all-gather)."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self._precompute = precompute_scales(model_parts)

    def after_update(self, step: int) -> None:
        self._precompute()
