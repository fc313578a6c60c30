"""Cross-field rules of the training extras: validation, profiling, loss spikes.

Part of ``RunPlan.build()``'s checks (every problem reported at once); the range of each
number is declared on its schema field (llmforge.config.ranges). No torch.
"""

from __future__ import annotations

from llmforge.config.choices import MemorySnapshot, Offload, Optimizer
from llmforge.config.schema import RunConfig
from llmforge.errors import Problem


def check_training(config: RunConfig) -> list[Problem]:
    out: list[Problem] = []
    for check in (_check_validation, _check_profile, _check_spikes, _check_optimizer):
        out.extend(check(config))
    return out


def _check_validation(config: RunConfig) -> list[Problem]:
    t, d = config.train, config.data
    if _int(t.eval_interval) and t.eval_interval > 0 and d.val_fraction == 0:
        return [
            Problem(
                "train.eval_interval",
                t.eval_interval,
                "validation needs held-out data, and data.val_fraction is 0",
                "also set data.val_fraction, e.g. data.val_fraction=0.01",
            )
        ]
    return []


def parse_steps(text: str) -> tuple[int, int]:
    """``"N"`` or ``"START-END"`` -> (first, last) step, 1-based and inclusive; ValueError if malformed."""
    parts = str(text).strip().split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(text)
    first, last = int(parts[0]), int(parts[-1])
    if first < 1 or last < first:
        raise ValueError(text)
    return first, last


#: ``RANK:STEP[:KIND]``, on the first attempt of a job only: how restarts and the anomaly
#: policies are drilled (tests, drills). STEP is one optimizer step N or a range N-M. KIND:
#: ``exit`` (the default): that rank exits abruptly (exit code 1) after step N;
#: ``nan-loss``: that rank's loss of those steps is NaN (its gradients stay finite);
#: ``nan-grad``: one element of that rank's gradients of those steps is NaN;
#: ``hang``: at step N that rank blocks in a receive no rank answers (a collective that never ends);
#: ``slow``: that rank sleeps ``SLOW_FAULT_S`` in the forward of each of those steps (a straggler).
#: Several faults are separated by commas (``1:1-3:slow,1:4:hang``).
FAULT_ENV = "LLMFORGE_FAULT"
FAULT_KINDS = ("exit", "nan-loss", "nan-grad", "hang", "slow")
SLOW_FAULT_S = 0.3


def parse_faults(spec: str) -> list[tuple[int, int, int, str]]:
    """Comma-separated ``parse_fault`` specs; ValueError if one is malformed."""
    return [parse_fault(part) for part in spec.split(",")]


def parse_fault(spec: str) -> tuple[int, int, int, str]:
    """``RANK:STEP[:KIND]`` -> (rank, first step, last step, kind); ValueError if malformed."""
    parts = spec.strip().split(":")
    kind = parts[2] if len(parts) == 3 else "exit"
    if len(parts) not in (2, 3) or kind not in FAULT_KINDS or not parts[0].isdigit():
        raise ValueError(spec)
    first, last = parse_steps(parts[1])
    return int(parts[0]), first, last, kind


def fault_problem(spec: str) -> Problem:
    """The message for a ``LLMFORGE_FAULT`` that ``parse_fault`` refuses."""
    return Problem(
        FAULT_ENV,
        spec,
        "not a fault to inject",
        f"write RANK:STEP[:KIND] (several separated by commas), STEP being N or N-M (N <= M, from 1) and KIND one of "
        f"{', '.join(FAULT_KINDS)}, e.g. {FAULT_ENV}=0:3 or {FAULT_ENV}=1:4:nan-grad; or unset it",
    )


def _check_profile(config: RunConfig) -> list[Problem]:
    t, out = config.train, []
    if t.profile is not None:
        try:
            first, _ = parse_steps(t.profile)
            if first > t.steps:
                out.append(
                    Problem(
                        "train.profile",
                        t.profile,
                        f"starts after the last step ({t.steps})",
                        f"profile steps inside 1-{t.steps}, e.g. train.profile={min(3, t.steps)}-{min(5, t.steps)}",
                    )
                )
        except ValueError:
            out.append(
                Problem(
                    "train.profile",
                    t.profile,
                    "not a step range",
                    "write START-END (1-based, inclusive) or one step, e.g. train.profile=3-5",
                )
            )
    if t.memory_snapshot == MemorySnapshot.PROFILE and t.profile is None:
        out.append(
            Problem(
                "train.memory_snapshot",
                t.memory_snapshot,
                "writes its snapshot at the end of the train.profile range, and none is set",
                "also set train.profile=START-END, e.g. train.profile=3-5",
            )
        )
    return out


def _check_spikes(config: RunConfig) -> list[Problem]:
    t = config.train
    if t.loss_spike_skip and t.loss_spike_window == 0:
        return [
            Problem(
                "train.loss_spike_skip", True, "needs spike detection, and train.loss_spike_window is 0", "set train.loss_spike_window=128"
            )
        ]
    return []


def _check_optimizer(config: RunConfig) -> list[Problem]:
    if config.optim.name == Optimizer.MUON and config.parallel.offload != Offload.NONE:
        return [
            Problem(
                "parallel.offload",
                config.parallel.offload,
                "optim.name=muon steps on the device: its gathers and scatters do not run on host-resident weights",
                "set parallel.offload=none, or use optim.name=adamw",
            )
        ]
    return []


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
