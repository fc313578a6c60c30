"""Rehearse the most-loaded rank of a plan: build, parallelize and two steps on fake tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from llmforge.config.choices import Dtype, Norm, Optimizer
from llmforge.launch.run import runs_here
from llmforge.models.balanced import balanced_routing
from llmforge.models.masks import needs_eos
from llmforge.plan import RunPlan
from llmforge.rehearse.fake import FakeBatches, fake_process_group, fake_tensors
from llmforge.rehearse.tracker import PeakTracker
from llmforge.train import optim
from llmforge.train.build import build_components, distributed_rank
from llmforge.train.callbacks import Callbacks
from llmforge.train.components import RankInfo
from llmforge.train.loop import _unscale_and_clip

#: How the CPU rehearsal differs from the rank it stands for on an accelerator.
DIFFERENCES = (
    "fake CPU tensors: bytes of every tensor the program keeps, without the CUDA caching allocator's "
    "rounding and fragmentation, NCCL's buffers, the CUDA context and kernels' workspaces (the estimate's 'reserved')",
    "torch.compile is off (the rehearsal runs eager kernels; compiled blocks may keep fewer intermediates)",
    "parallel.async_tp is off with it (a compiler pass): the column-parallel linears keep their input's sequence shard, "
    "where async TP's keep the gathered input (the estimate counts it)",
    "AdamW is the fused one, as on GPU ranks (CPU ranks run the for-loop one, which reads its skip flag on the host)",
)
#: What differs on MoE plans.
MOE_DIFFERENCE = (
    "MoE routing is balanced (llmforge.models.balanced): every expert gets the same share of "
    "the assignments, at most the capacity, as the estimate assumes; a real router's busiest expert holds more"
)
#: What differs on RMSNorm models rehearsed for an accelerator.
RMSNORM_DIFFERENCE = (
    "RMSNorm runs torch's CPU kernel, which keeps an fp32 copy of its input and its fp32 normalised input (8h + 4 "
    "bytes a token) where the fused GPU kernel the estimate counts keeps the input and an fp32 statistic: the "
    "rehearsed activations (and the working set of each recomputed block) are that much larger for each norm that saves"
)


@dataclass
class Rehearsal:
    """What one rehearsal measured (bytes): the peak of the steady step (the second: AdamW
    makes its states in the first) by category, and the peaks of the build and the first step."""

    rank: int
    where: str
    peak_bytes: int
    step_peak_bytes: int
    first_step_peak_bytes: int
    build_peak_bytes: int
    categories: dict[str, int]
    seconds: float
    differences: list[str] = field(default_factory=lambda: list(DIFFERENCES))
    #: The most the steady step's activations held at once (its saved tensors in flight).
    activations_peak_bytes: int = 0

    def as_estimate_items(self, *, whole_compute_copy: bool) -> dict[str, int]:
        """The step's peak by the estimator's items: gathered compute copies count as
        weights where the estimate keeps a whole copy (ZeRO 1-2, pipelines), else as transient."""
        c = self.categories
        copies = c["compute_copies"]
        return {
            "weights": c["weights"] + (copies if whole_compute_copy else 0),
            "grads": c["grads"],
            "optimizer": c["optimizer"],
            "activations": c["activations"],
            "transient": c["transient"] + (0 if whole_compute_copy else copies),
        }

    def as_dict(self, *, whole_compute_copy: bool) -> dict:
        return {
            "rank": self.rank,
            "most_loaded": self.where,
            "peak_bytes": self.peak_bytes,
            "step_peak_bytes": self.step_peak_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "build_peak_bytes": self.build_peak_bytes,
            "memory_bytes": self.as_estimate_items(whole_compute_copy=whole_compute_copy),
            "categories": dict(self.categories),
            "seconds": self.seconds,
            "activations_peak_bytes": self.activations_peak_bytes,
            "differences": list(self.differences),
        }


def unsupported(plan: RunPlan) -> str:
    """Why the rehearsal cannot run ``plan`` ("" when it can): steps that read a tensor's value on
    the host, which fake tensors do not have."""
    cfg = plan.config
    if cfg.precision.param_dtype == Dtype.FP16:
        return (
            "fp16's dynamic loss scaling reads on the host whether the gradients are finite, every step; "
            "rehearse the plan with precision.param_dtype=bf16 (the same bytes)"
        )
    if cfg.optim.name != Optimizer.ADAMW:
        return (
            f"optim.name={cfg.optim.name} steps without fused AdamW's on-device skip flag: the step guard reads "
            "on the host whether to skip the step; rehearse the plan with optim=adamw (other optimizer states)"
        )
    return ""


def differences(plan: RunPlan) -> list[str]:
    """How the rehearsal of ``plan`` differs from its rank on an accelerator."""
    cfg = plan.config
    out = list(DIFFERENCES) + ([MOE_DIFFERENCE] if cfg.model.moe.num_experts > 0 else [])
    return out + ([RMSNORM_DIFFERENCE] if cfg.model.norm == Norm.RMSNORM and cfg.cluster.accelerator != "cpu" else [])


def most_loaded_rank(plan: RunPlan, *, stage: int) -> int:
    """The global rank of pipeline rank ``stage`` at every other coordinate 0 (the estimate's
    most-loaded rank: the fullest shards are the first ones). Ranks are ``pp`` outermost."""
    return stage * (plan.world_size // plan.layout.pp)


def rehearsal_plan(plan: RunPlan) -> RunPlan:
    """The plan the rehearsal runs: ``train.compile`` off, and ``parallel.async_tp`` with it (see ``DIFFERENCES``)."""
    cfg = plan.config
    if not cfg.train.compile:
        return plan
    parallel = dataclasses.replace(cfg.parallel, async_tp=False)
    return RunPlan.build(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False), parallel=parallel))


def rehearse(plan: RunPlan, *, stage: int, where: str = "", fake: bool = True) -> Rehearsal:
    """Run the build and two training steps of pipeline rank ``stage``'s first rank on fake
    tensors (``fake=False``: on real ones, for a tiny plan, to check the fake run against it)."""
    plan = rehearsal_plan(plan)
    rank = most_loaded_rank(plan, stage=stage)
    start = time.perf_counter()
    group = contextlib.nullcontext() if runs_here(plan) else fake_process_group(rank=rank, world_size=plan.world_size)
    with group:
        build, first, step = _program(plan, distributed=not runs_here(plan), fake=fake)
    return Rehearsal(
        rank=rank,
        where=where,
        peak_bytes=max(build.peak_bytes, first.peak_bytes, step.peak_bytes),
        step_peak_bytes=step.peak_bytes,
        first_step_peak_bytes=first.peak_bytes,
        build_peak_bytes=build.peak_bytes,
        categories=step.peak_by_category(),
        seconds=time.perf_counter() - start,
        differences=differences(plan),
        activations_peak_bytes=step.activations_peak_bytes,
    )


def _program(plan: RunPlan, *, distributed: bool, fake: bool) -> tuple[PeakTracker, PeakTracker, PeakTracker]:
    """The build and two steps of this process's rank, each under its own tracker."""
    device = torch.device("cpu")
    rank = RankInfo(device=device)
    if distributed:
        with warnings.catch_warnings():  # the fake group keeps no collective timeout, and says so
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            rank = distributed_rank(plan, device=device)  # the mesh reads real rank tables: made before the fake tensors
    cfg = plan.config
    batches = FakeBatches(
        global_batch=cfg.train.global_batch_size,
        seq_len=cfg.model.seq_len,
        vocab_size=cfg.model.vocab_size,
        eos_id=0 if needs_eos(cfg.model) else None,
    )
    with fake_tensors() if fake else contextlib.nullcontext(), _fused_adamw(), balanced_routing():
        with PeakTracker() as build:
            c = build_components(plan, rank=rank, sampler=batches)
        trackers = [build]
        for _ in range(2):
            with PeakTracker(modules=c.model_parts, optimizer=c.optimizer) as step:
                _one_step(c, tracker=step, grad_clip=cfg.optim.grad_clip)
            trackers.append(step)
    return tuple(trackers)  # type: ignore[return-value]


@contextlib.contextmanager
def _fused_adamw() -> Iterator[None]:
    """Build the fused AdamW of GPU ranks (``llmforge.train.optim.implementation``)."""
    original = optim.implementation
    optim.implementation = lambda params, offloaded=False: "fused"
    try:
        yield
    finally:
        optim.implementation = original


def _one_step(c, *, tracker: PeakTracker, grad_clip: float) -> None:
    """The loop's step (``llmforge.train.loop.train_loop``) without its reads of the device
    (the guard's read, the meter, logging)."""
    batch = c.sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size)
    out = c.step(batch)
    tracker.tag_grads(c.parameters())
    flags = c.guard.local_flags(out.loss)
    grad_norm = _unscale_and_clip(c, grad_clip, flags=flags)
    c.update(c.guard.verdict(step=1, loss=out.loss, grad_norm=grad_norm, flags=flags))
    Callbacks(c.callbacks).after_update(1)
    tracker.tag_optimizer(c.optimizer)
    c.optimizer.zero_grad(set_to_none=True)
    c.scheduler.step()
