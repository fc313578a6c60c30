"""Mixed precision: autocast for bf16/fp16 compute, the residual stream's dtype,
dynamic loss scaling for fp16. The loss is computed in fp32 from 16-bit logits
(``llmforge.train.loss``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from llmforge.config.choices import Dtype
from llmforge.config.dtypes import TORCH_NAMES

#: The smallest dynamic loss scale (fp16).
MIN_LOSS_SCALE = 1.0

#: Precision name -> torch dtype.
DTYPES = {name: getattr(torch, torch_name) for name, torch_name in TORCH_NAMES.items()}


def autocast(*, param_dtype: str, device: torch.device):
    """Autocast context for the forward pass; a no-op in fp32. Master weights stay fp32:
    autocast casts them for each matmul (the compute copies where FSDP2 does not gather them)."""
    if param_dtype == Dtype.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[param_dtype])


def residual_dtype(*, param_dtype: str, fp32_residual: bool) -> torch.dtype:
    """The residual stream's dtype: the compute dtype, or fp32 under fp32 compute or
    ``precision.fp32_residual`` (``llmforge.parallel.residual``)."""
    return torch.float32 if fp32_residual else DTYPES[param_dtype]


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: scale the loss, skip steps whose gradients
    overflow and halve the scale; double it after ``growth_interval`` clean steps."""

    scale: float
    growth_interval: int
    enabled: bool
    clean_steps: int = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_factor(self) -> float:
        return 1.0 / self.scale if self.enabled else 1.0

    @property
    def at_floor(self) -> bool:
        """The scale cannot shrink further: an overflow now is no longer the scaler's to absorb."""
        return self.scale <= MIN_LOSS_SCALE

    def update(self, *, found_inf: bool) -> bool:
        """Record one step; returns True if the optimizer step should run."""
        if not self.enabled:
            return True
        if found_inf:
            self.scale = max(self.scale / 2.0, MIN_LOSS_SCALE)
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
