"""What one training step of a rank issues: collectives and DTensor operations, by phase.

The rank's real program (as ``llmforge.rehearse.run``: build, parallel transforms, the step
runner, clipping, the optimizer as CPU ranks run it) on small real tensors over torch's fake
process group. Under a dispatch mode, an operator call with a DTensor among its arguments is
one DTensor dispatch (the host work DTensor adds: sharding propagation, wrapping and
unwrapping), and the Python-level calls are counted (what each dispatch brings with it, which
the calibration's host probe is held to); under torch.profiler, a call of one of the process group's ``c10d::`` operators
is one collective. The estimator's host terms for CPU ranks (``llmforge.estimate.host``) are held to
these counts by the tests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from llmforge.parallel.dtensor import DTensorCalls, PythonCalls
from llmforge.plan import RunPlan
from llmforge.rehearse.fake import FakeBatches, fake_process_group
from llmforge.train.build import build_components, distributed_rank
from llmforge.train.callbacks import Callbacks
from llmforge.train.loop import _unscale_and_clip

#: The process group's own operators (``c10d::``), which every collective ends in, whoever issued it
#: (a ParallelStyle's hook, a redistribution inside an operator, loss_parallel, the clip).
COLLECTIVES = (
    "allreduce_",
    "allgather_",
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "broadcast_",
    "send",
    "recv_",
)


@dataclass
class StepOps:
    """Counts of one steady step by phase (``step``: forward and backward over the microbatches;
    ``clip``; ``optimizer``): DTensor dispatches, Python-level calls and collectives by operator name."""

    dtensor: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, Counter] = field(default_factory=dict)
    python_calls: dict[str, int] = field(default_factory=dict)

    def collective_count(self, phase: str) -> int:
        return sum(self.collectives.get(phase, Counter()).values())


def counted(fn) -> tuple[int, Counter]:
    """(top-level DTensor dispatches, collectives by name) of ``fn()``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, DTensorCalls() as mode:
        fn()
    names = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("c10d::") and not _inside_itself(e))
    return mode.dtensor, Counter({n: k for n, k in names.items() if n in COLLECTIVES})


def _inside_itself(event) -> bool:
    """Whether a profiler event runs inside another of its name: a process group's operator
    called directly (``dist.all_reduce``) passes through the dispatch mode and reaches the
    profiler twice, the second time under the first."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == event.name:
            return True
        parent = parent.cpu_parent
    return False


def _phases(c, batch: torch.Tensor, *, grad_clip: float) -> dict:
    """One step of ``c`` on ``batch`` as its phases, to be run in order."""
    holder = {}
    return {
        "step": lambda: holder.update(out=c.step(batch)),
        "clip": lambda: holder.update(norm=_unscale_and_clip(c, grad_clip, flags=c.guard.local_flags(holder["out"].loss))),
        "optimizer": lambda: (c.optimizer.step(), Callbacks(c.callbacks).after_update(1), c.optimizer.zero_grad(set_to_none=True)),
    }


def count_step(plan: RunPlan) -> StepOps:
    """Build ``plan``'s rank 0 over a fake process group, run one step, then count the next
    two (the second's Python calls, apart from the profiler's and the dispatch mode's)."""
    cfg = plan.config
    torch.manual_seed(0)
    with fake_process_group(rank=0, world_size=plan.world_size):
        rank = distributed_rank(plan, device=torch.device("cpu"))
        batches = FakeBatches(global_batch=cfg.train.global_batch_size, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
        c = build_components(plan, rank=rank, sampler=batches)
        out = StepOps()
        for round_ in ("warm-up", "operators", "python"):
            batch = batches.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size)
            phases = _phases(c, batch, grad_clip=cfg.optim.grad_clip)
            for phase, fn in phases.items():
                if round_ == "python":
                    with PythonCalls() as python:
                        fn()
                    out.python_calls[phase] = python.calls
                    continue
                dtensor, collectives = counted(fn)
                if round_ == "operators":
                    out.dtensor[phase], out.collectives[phase] = dtensor, collectives
    return out
