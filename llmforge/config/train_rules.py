"""Rules of the training extras: validation, learning-rate schedule, profiling, restarts, anomalies.

Part of ``RunPlan.build()``'s checks (every problem reported at once). No torch.
"""

from __future__ import annotations

from typing import List, Tuple

from llmforge.config.schema import ANOMALY_POLICIES, RunConfig
from llmforge.errors import Problem


def check_training(config: RunConfig) -> List[Problem]:
    out: List[Problem] = []
    for check in (_check_validation, _check_schedule, _check_profile, _check_restarts, _check_anomaly):
        out.extend(check(config))
    return out


def _check_validation(config: RunConfig) -> List[Problem]:
    t, d, out = config.train, config.data, []
    if not 0.0 <= d.val_fraction < 1.0:
        out.append(Problem("data.val_fraction", d.val_fraction, "must be in [0, 1)", "hold out a small share, e.g. data.val_fraction=0.01, or 0 for none"))
    if not _int(t.eval_interval) or t.eval_interval < 0:
        out.append(Problem("train.eval_interval", t.eval_interval, "must be 0 or a positive integer", "e.g. train.eval_interval=100 (0 = only at the end)"))
    elif t.eval_interval > 0 and d.val_fraction == 0:
        out.append(Problem("train.eval_interval", t.eval_interval, "validation needs held-out data, and data.val_fraction is 0", "also set data.val_fraction, e.g. data.val_fraction=0.01"))
    if not _int(t.eval_steps) or t.eval_steps < 1:
        out.append(Problem("train.eval_steps", t.eval_steps, "must be a positive integer", "e.g. train.eval_steps=10"))
    return out


def _check_schedule(config: RunConfig) -> List[Problem]:
    o, out = config.optim, []
    if not 0.0 < o.decay_fraction <= 1.0:
        out.append(Problem("optim.decay_fraction", o.decay_fraction, "must be in (0, 1]", "e.g. optim.decay_fraction=0.2 (the last 20% of the steps)"))
    if o.warmup_steps < 0:
        out.append(Problem("optim.warmup_steps", o.warmup_steps, "must be 0 or more", "e.g. optim.warmup_steps=10"))
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        out.append(Problem("optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]", "e.g. optim.min_lr_ratio=0.1"))
    return out


def parse_steps(text: str) -> Tuple[int, int]:
    """``"N"`` or ``"START-END"`` -> (first, last) step, 1-based and inclusive; ValueError if malformed."""
    parts = str(text).strip().split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(text)
    first, last = int(parts[0]), int(parts[-1])
    if first < 1 or last < first:
        raise ValueError(text)
    return first, last


def _check_profile(config: RunConfig) -> List[Problem]:
    t, out = config.train, []
    if t.profile is not None:
        try:
            first, _ = parse_steps(t.profile)
            if first > t.steps:
                out.append(Problem("train.profile", t.profile, f"starts after the last step ({t.steps})", f"profile steps inside 1-{t.steps}, e.g. train.profile={min(3, t.steps)}-{min(5, t.steps)}"))
        except ValueError:
            out.append(Problem("train.profile", t.profile, "not a step range", "write START-END (1-based, inclusive) or one step, e.g. train.profile=3-5"))
    if t.memory_snapshot == "profile" and t.profile is None:
        out.append(Problem("train.memory_snapshot", t.memory_snapshot, "writes its snapshot at the end of the train.profile range, and none is set", "also set train.profile=START-END, e.g. train.profile=3-5"))
    return out


def _check_restarts(config: RunConfig) -> List[Problem]:
    n = config.cluster.max_restarts
    if not _int(n) or n < 0:
        return [Problem("cluster.max_restarts", n, "must be 0 or a positive integer", "e.g. cluster.max_restarts=3 (0 = a failure ends the run)")]
    return []


def _check_anomaly(config: RunConfig) -> List[Problem]:
    t, out = config.train, []
    if t.anomaly not in ANOMALY_POLICIES:
        out.append(Problem("train.anomaly", t.anomaly, f"must be one of {', '.join(ANOMALY_POLICIES)}", "e.g. train.anomaly=skip"))
    for key in ("max_skipped_steps", "max_rollbacks"):
        value = getattr(t, key)
        if not _int(value) or value < 0:
            out.append(Problem(f"train.{key}", value, "must be 0 or a positive integer", f"e.g. train.{key}=3"))
    if not 0.0 < t.rollback_lr_factor <= 1.0:
        out.append(Problem("train.rollback_lr_factor", t.rollback_lr_factor, "must be in (0, 1]", "e.g. train.rollback_lr_factor=0.5 (1.0 keeps the learning rate)"))
    if not _int(t.loss_spike_window) or t.loss_spike_window < 0 or 0 < t.loss_spike_window < 4:
        out.append(Problem("train.loss_spike_window", t.loss_spike_window, "must be 0 (off) or at least 4 steps", "e.g. train.loss_spike_window=128"))
    if not t.loss_spike_sigma > 0:
        out.append(Problem("train.loss_spike_sigma", t.loss_spike_sigma, "must be positive", "e.g. train.loss_spike_sigma=6"))
    if t.loss_spike_skip and t.loss_spike_window == 0:
        out.append(Problem("train.loss_spike_skip", True, "needs spike detection, and train.loss_spike_window is 0", "set train.loss_spike_window=128"))
    return out


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
