"""Cross-field rules of the training extras: validation, profiling, loss spikes.

Part of ``RunPlan.build()``'s checks (every problem reported at once); the range of each
number is declared on its schema field (llmforge.config.ranges). No torch.
"""

from __future__ import annotations

from typing import List, Tuple

from llmforge.config.schema import RunConfig
from llmforge.errors import Problem


def check_training(config: RunConfig) -> List[Problem]:
    out: List[Problem] = []
    for check in (_check_validation, _check_profile, _check_spikes, _check_optimizer):
        out.extend(check(config))
    return out


def _check_validation(config: RunConfig) -> List[Problem]:
    t, d = config.train, config.data
    if _int(t.eval_interval) and t.eval_interval > 0 and d.val_fraction == 0:
        return [Problem("train.eval_interval", t.eval_interval, "validation needs held-out data, and data.val_fraction is 0", "also set data.val_fraction, e.g. data.val_fraction=0.01")]
    return []


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


def _check_spikes(config: RunConfig) -> List[Problem]:
    t = config.train
    if t.loss_spike_skip and t.loss_spike_window == 0:
        return [Problem("train.loss_spike_skip", True, "needs spike detection, and train.loss_spike_window is 0", "set train.loss_spike_window=128")]
    return []


def _check_optimizer(config: RunConfig) -> List[Problem]:
    if config.optim.name == "muon" and config.parallel.offload != "none":
        return [Problem("parallel.offload", config.parallel.offload, "optim.name=muon steps on the device: its gathers and scatters do not run on host-resident weights",
                        "set parallel.offload=none, or use optim.name=adamw")]
    return []


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
