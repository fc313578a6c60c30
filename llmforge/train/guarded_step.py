"""The optimizer step the guard's verdict allows (``llmforge.train.anomaly.StepGuard`` judges
the step; this applies the verdict).

A step that is not ``ok`` changes neither the weights nor the optimizer state (moments and
step count). Fused AdamW skips it on the device: it takes ``grad_scale``/``found_inf`` as
``GradScaler`` passes them, set here for the one call and removed after. The for-loop AdamW
(parameters in host memory) skips it on the host, where the guard's flag lives with them.
Under fp16 the loss scaler reads the verdict every step, as its scaling always has.
"""

from __future__ import annotations

import torch

from llmforge.train.anomaly import StepGuard
from llmforge.train.precision import LossScaler


class GuardedOptimizerStep:
    """``step(ok)``: the optimizer step, or none of it when ``ok`` is false."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, scaler: LossScaler, guard: StepGuard) -> None:
        self.optimizer, self.scaler, self.guard = optimizer, scaler, guard

    @property
    def fused(self) -> bool:
        return bool(self.optimizer.defaults.get("fused"))

    def __call__(self, ok: torch.Tensor) -> None:
        if self.scaler.enabled:
            bad = not bool(ok)
            self.guard.excuse_last(bad and not self.scaler.at_floor)
            self.scaler.update(found_inf=bad)
            self._step_or_skip(skip=bad)
        elif self.fused:
            self._fused_step(found_inf=1.0 - self.guard.gate)
        else:
            self._step_or_skip(skip=not bool(self.guard.gate))

    def host_tensors(self) -> list[torch.Tensor]:
        """The flag, where the for-loop AdamW reads it every step from host memory, waiting for
        no device (for ``llmforge.train.syncs``); none where fused AdamW skips on the device."""
        gate = self.guard.gate
        return [gate] if gate.device.type == "cpu" and not self.fused else []

    def _fused_step(self, *, found_inf: torch.Tensor) -> None:
        optimizer = self.optimizer
        optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]

    def _step_or_skip(self, *, skip: bool) -> None:
        if skip:  # no gradients: the step updates nothing and counts nothing
            self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.step()
