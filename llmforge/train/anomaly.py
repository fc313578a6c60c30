"""Non-finite steps and loss spikes: checked on the device every step, acted on at reads.

Every step, each rank turns its loss into a flag (``loss * 0`` is 0, or NaN for a
non-finite loss) that rides on the gradient norm's all-reduce, so every rank of every
parallel dimension sees the same verdict: ``ok`` when the global gradient norm and every
rank's loss are finite (and, with ``spike_skip``, the loss is no spike). A step that is not
``ok`` changes neither the weights nor the optimizer state (moments and step count;
``llmforge.train.guarded_step`` applies the verdict): fused AdamW skips it on the device
(``found_inf``, as ``GradScaler`` does); the for-loop AdamW, which only runs where the
parameters live in host memory, skips it on the host, where reading the flag waits for
nothing. Nothing is read back on unlogged steps: the loop's one read at a logged (or
checkpointed) step brings every step's loss, norm and flags since the previous read, and
only then does the policy act (stop or roll back).

fp16 keeps its loss scaling: a non-finite step there is the scaler's business (it halves
the scale and skips) until the scale is at its floor; only then is it an anomaly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmforge.config.choices import AnomalyAction
from llmforge.parallel.dtensor import local_values


@dataclass(frozen=True)
class AnomalyPolicy:
    """What the run does about anomalies (``train.anomaly`` and friends, as plain values)."""

    action: str = "skip"
    max_skipped_steps: int = 5
    max_rollbacks: int = 3
    rollback_lr_factor: float = 1.0
    spike_window: int = 0
    spike_sigma: float = 6.0
    spike_skip: bool = False


class Anomaly(Exception):
    """Raised by the loop when the policy says stop or roll back: what went wrong, where.
    ``first_step``: the first anomalous step of the episode; ``step``: where it was acted on."""

    def __init__(self, *, action: str, first_step: int, step: int, what: str, reason: str) -> None:
        self.action, self.first_step, self.step, self.what, self.reason = action, first_step, step, what, reason
        super().__init__(f"at step {first_step} {what}; {reason}")


@dataclass
class _Row:
    """One step's device values, kept until the next read."""

    step: int
    loss: torch.Tensor
    norm: torch.Tensor
    flags: torch.Tensor
    spike: torch.Tensor | None
    excused: bool = False


@dataclass
class Reading:
    """What the read of a logged step says: that step's loss and gradient norm, and the
    counts the metrics carry."""

    loss: float
    grad_norm: float
    metrics: dict = field(default_factory=dict)


class StepGuard:
    """The policy that judges each step: the per-step check (device side) and the policy's
    bookkeeping (host side, at reads). The optimizer step it allows is
    ``llmforge.train.guarded_step.GuardedOptimizerStep``, which reads ``gate``."""

    def __init__(self, policy: AnomalyPolicy, *, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        #: 1.0 while the current step updates, 0.0 when it is skipped (device).
        self.gate = torch.ones((), dtype=torch.float32, device=device)
        self._window = torch.full((policy.spike_window,), float("nan"), dtype=torch.float64, device=device) if policy.spike_window else None
        self._seen = 0
        self._rows: list[_Row] = []
        self.skipped = 0
        self.rollbacks = 0
        self.rollback_batches = 0
        self.lr_scale = 1.0
        self.first_anomaly: int | None = None
        self._streak: list[tuple[int, str]] = []  # the current run of anomalous steps: (step, what)
        self._seen_since_read: list[tuple[int, str]] = []
        self._over: list[tuple[int, str]] | None = None  # a run of skips longer than allowed
        self._spikes = 0
        self._spike: torch.Tensor | None = None

    # -- every step, on the device ------------------------------------------------------------

    def local_flags(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's flags for the norm's all-reduce: [loss * 0] (+ [spike as NaN] with spike_skip)."""
        value = loss.detach()
        self._spike = self._spike_test(value)
        poison = (value * 0).reshape(1)
        if not self.policy.spike_skip:
            return poison
        spike = torch.where(self._spike, float("nan"), 0.0) if self._spike is not None else value.new_zeros(())  # a slot every step
        return torch.cat([poison, spike.reshape(1).to(poison.dtype)])

    def verdict(self, *, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """``ok`` (a device bool): every rank's loss, the global norm (and spike test) passed."""
        ok = (grad_norm + flags.sum()).isfinite()
        self.gate.copy_(ok)
        self._rows.append(_Row(step=step, loss=loss, norm=grad_norm, flags=flags, spike=self._spike))
        return ok

    def excuse_last(self, excused: bool) -> None:
        """Whether the newest step, if not ``ok``, is the fp16 loss scaler's to handle (its scale
        was above the floor): then it is no anomaly (``llmforge.train.guarded_step``)."""
        self._rows[-1].excused = excused

    def _spike_test(self, loss: torch.Tensor) -> torch.Tensor | None:
        """loss > mean + sigma * std of the finite losses of the previous ``spike_window`` steps."""
        window = self._window
        if window is None:
            return None
        spike = None
        if self._seen >= window.numel():
            mean = window.nanmean()
            std = (window - mean).square().nanmean().sqrt()
            spike = loss > mean + self.policy.spike_sigma * std
        window[self._seen % window.numel()] = torch.where(loss.isfinite(), loss, float("nan"))
        self._seen += 1
        return spike

    # -- at a read, on the host ---------------------------------------------------------------

    def read(self) -> Reading:
        """The one read of the device: every step since the last read, then the bookkeeping."""
        rows, self._rows = self._rows, []
        columns = [
            torch.cat(
                [
                    r.loss.detach().double().reshape(1),
                    r.norm.double().reshape(1),
                    r.flags.reshape(-1),
                    (r.spike if r.spike is not None else torch.zeros((), dtype=torch.bool, device=r.norm.device)).double().reshape(1),
                ]
            )
            for r in rows
        ]
        values = torch.stack(columns).tolist()
        for row, (loss, norm, *flags, spike) in zip(rows, values, strict=False):
            self._account(row, loss=loss, norm=norm, flags=flags, spike=bool(spike))
        last = values[-1]
        metrics = {"skipped_steps": self.skipped, "loss_spike": self._spikes}
        if self.rollbacks:
            metrics.update(rollbacks=self.rollbacks, rollback_skipped_batches=self.rollback_batches)
        self._spikes = 0
        return Reading(loss=last[0], grad_norm=last[1], metrics=metrics)

    def _account(self, row: _Row, *, loss: float, norm: float, flags: list[float], spike: bool) -> None:
        self._spikes += int(spike)
        what = _what(loss=loss, norm=norm, flags=flags, spike=spike and self.policy.spike_skip)
        if not what or row.excused:
            self._streak = []
            return
        self.skipped += 1
        self.first_anomaly = row.step if self.first_anomaly is None else self.first_anomaly
        self._streak.append((row.step, what))
        self._seen_since_read.append((row.step, what))
        if len(self._streak) > self.policy.max_skipped_steps and self.policy.action != AnomalyAction.STOP:
            self._over = list(self._streak)

    def decide(self, step: int) -> None:
        """Raise ``Anomaly`` when the policy says stop or roll back (call after a read)."""
        seen, self._seen_since_read = self._seen_since_read, []
        over, self._over = self._over, None
        p = self.policy
        if p.action == AnomalyAction.STOP and seen:
            first, what = seen[0]
            raise Anomaly(
                action="stop", first_step=first, step=step, what=what, reason="train.anomaly=stop ends the run at the first non-finite step"
            )
        if not over:
            return
        first, what = over[0]
        count = (
            f"{len(over)} steps in a row were skipped (steps {first}-{over[-1][0]}), "
            f"more than train.max_skipped_steps={p.max_skipped_steps}"
        )
        if p.action == AnomalyAction.SKIP:
            raise Anomaly(action="stop", first_step=first, step=step, what=what, reason=f"{count}, and train.anomaly=skip then stops")
        if self.rollbacks >= p.max_rollbacks:
            raise Anomaly(
                action="stop",
                first_step=first,
                step=step,
                what=what,
                reason=f"{count}, after the {self.rollbacks} rollbacks train.max_rollbacks={p.max_rollbacks} allows",
            )
        raise Anomaly(action="rollback", first_step=first, step=step, what=what, reason=count)

    def weights_anomaly(self, step: int) -> Anomaly:
        """What to raise when the weights themselves are non-finite before a save: they cannot be skipped."""
        first = self._streak[0][0] if self._streak else step
        what = "the weights were non-finite before the checkpoint"
        if self.policy.action == AnomalyAction.ROLLBACK and self.rollbacks < self.policy.max_rollbacks:
            return Anomaly(action="rollback", first_step=first, step=step, what=what, reason="no checkpoint is written from them")
        return Anomaly(action="stop", first_step=first, step=step, what=what, reason="no checkpoint is written from them")

    def protected(self) -> list[int]:
        """Steps whose newest older checkpoint rotation must keep: the first anomaly of the run,
        and the first of an ongoing run of skipped steps."""
        return sorted({s for s in (self.first_anomaly, self._streak[0][0] if self._streak else None) if s is not None})

    def rolled_back(self, *, batches: int) -> None:
        """Start afresh after a rollback that skipped ``batches``: no pending rows, an empty
        spike window, a lower learning rate."""
        self.rollbacks += 1
        self.rollback_batches += batches
        self.lr_scale *= self.policy.rollback_lr_factor
        self._rows, self._streak, self._seen_since_read, self._over = [], [], [], None
        if self._window is not None:
            self._window.fill_(float("nan"))
        self._seen = 0
        self.gate.fill_(1.0)

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped, "first_anomaly": self.first_anomaly, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped_steps", 0))
        self.first_anomaly = state.get("first_anomaly")
        self.lr_scale = float(state.get("lr_scale", 1.0))


def _what(*, loss: float, norm: float, flags: list[float], spike: bool) -> str:
    """What was wrong with a step, in words ('' when nothing)."""
    import math

    parts = []
    if not math.isfinite(flags[0]):
        parts.append(f"the loss was {loss:g}" if not math.isfinite(loss) else "the loss was non-finite on another rank")
    if not math.isfinite(norm):
        parts.append(f"the gradient norm was {norm:g}")
    if spike or (len(flags) > 1 and not math.isfinite(flags[1])):
        parts.append(f"the loss spiked to {loss:.4g}")
    return " and ".join(parts)


def check_weights(guard: StepGuard, params: list[torch.nn.Parameter], *, step: int, distributed: bool, device: torch.device) -> None:
    """Raise the guard's anomaly unless every rank's parameters are all finite (collective when
    ``distributed``): run before a checkpoint is written."""
    flags = [local_values(p.detach()).isfinite().all() for p in params]
    bad = torch.stack(flags).logical_not().any().double().reshape(1) if flags else torch.zeros(1, dtype=torch.float64, device=device)
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(bad)
    if float(bad) != 0.0:
        raise guard.weights_anomaly(step)
