"""Whether FP8 pays for a plan (no torch): which block linears run in float8, what each gains,
and what the step gains, against the same plan in bf16.

``llmforge plan``, ``estimate``, ``pretrain`` and ``resume`` show it and refuse an FP8 plan that
does not pay (``--force`` runs it anyway; emulated FP8 is for numerics and is never refused):

- no block linear is large enough for float8 (``llmforge.blockspec.fp8``);
- none of the float8 linears is estimated faster than in bf16;
- the step is estimated less than ``MIN_STEP_GAIN`` times faster than in bf16 (the estimate's
  error on one GPU is about that; a smaller promise is no promise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmforge.errors import Problem
from llmforge.estimate.core import Estimate, estimate
from llmforge.estimate.fp8_gain import LinearGain, linear_gains

MIN_STEP_GAIN = 1.05


@dataclass(frozen=True)
class Fp8Verdict:
    """A plan's float8 linears (per block kind) and its step time with and without FP8."""

    recipe: str
    dense: tuple[LinearGain, ...]
    moe: tuple[LinearGain, ...]
    bf16_step_s: float
    fp8_step_s: float

    @property
    def speedup(self) -> float:
        """The step's estimated gain: bf16 step time over FP8 step time."""
        return self.bf16_step_s / self.fp8_step_s

    @property
    def float8(self) -> tuple[LinearGain, ...]:
        return tuple(g for g in self.dense + self.moe if g.linear.float8)

    def problems(self) -> list[Problem]:
        """Why FP8 does not pay here (empty: it does)."""
        widths = ", ".join(
            dict.fromkeys(f"{g.linear.name} {g.linear.in_features} -> {g.linear.out_features}" for g in self.dense + self.moe)
        )
        fix = "use precision=bf16, or pass --force to run FP8 anyway"
        if not self.float8:
            rule = f"no block linear is large enough for {self.recipe} float8 to pay ({widths})"
        elif not any(g.speedup > 1 for g in self.float8):
            names = ", ".join(f"{g.linear.name} {g.speedup:.2f}x" for g in self.float8)
            rule = f"no float8 linear is estimated faster than in bf16 ({names}; block linears {widths})"
        elif self.speedup < MIN_STEP_GAIN:
            rule = (
                f"the estimate says the FP8 step is {self.speedup:.2f}x the bf16 one (under {MIN_STEP_GAIN:.2f}x: "
                f"no gain to count on at these widths, {widths})"
            )
        else:
            return []
        return [Problem("precision.fp8", True, rule, fix)]

    def lines(self) -> list[str]:
        """The decisions as text, one line per linear."""
        out = [f"FP8 ({self.recipe}): estimated step {self.speedup:.2f}x of bf16's ({len(self.float8)} float8 linears per block)"]
        for kind, gains in (("", self.dense), ("MoE block: ", self.moe)):
            for g in gains:
                x = g.linear
                verdict = f"float8 {g.speedup:.2f}x" if x.float8 else f"bf16 ({x.why}; float8 would be {g.speedup:.2f}x)"
                out.append(f"  {kind}{x.name:<22} {x.in_features:>6} -> {x.out_features:<6} {verdict}")
        return out

    def as_dict(self) -> dict[str, Any]:
        def linear(g: LinearGain) -> dict[str, Any]:
            x = g.linear
            return {"name": x.name, "in": x.in_features, "out": x.out_features, "float8": x.float8, "why": x.why, "speedup": g.speedup}

        return {
            "recipe": self.recipe,
            "step_speedup": self.speedup,
            "bf16_step_s": self.bf16_step_s,
            "fp8_step_s": self.fp8_step_s,
            "dense": [linear(g) for g in self.dense],
            "moe": [linear(g) for g in self.moe],
            "problems": [dataclasses.asdict(p) for p in self.problems()],
        }


def fp8_verdict(est: Estimate) -> Fp8Verdict | None:
    """The FP8 verdict of an estimate of an FP8 plan (None: not FP8, or a profile without FP8)."""
    shape, layout, job = est.shape, est.layout, est.job
    if not job.fp8 or not job.profile.has_fp8:
        return None
    bf16 = estimate(shape, layout, dataclasses.replace(job, fp8=False, fp8_all_gather=False), every_stage=False)
    return Fp8Verdict(
        recipe=shape.fp8_recipe,
        dense=linear_gains(shape, layout, job),
        moe=linear_gains(shape, layout, job, moe=True) if shape.num_experts else (),
        bf16_step_s=bf16.step_s,
        fp8_step_s=est.step_s,
    )
