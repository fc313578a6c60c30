"""The parallel layout of a run, and the placement rules the backend and the estimator share.

``Layout`` holds the degrees (dp with its HSDP split, tp, pp with its virtual
stages, cp, ep) and the strategy the estimator and the backend need (ZeRO stage,
sequence parallel, pipeline schedule and split, recompute, micro batch). A
``RunPlan`` owns one (``plan.layout``); the estimator's search builds thousands.

``chunk_rank`` is the one rule placing pipeline chunks on pipeline ranks;
``expert_shard_dim`` the one rule choosing the dimension ZeRO shards an expert weight
on; ``selective_recompute_runs`` and ``selective_rebuilds`` say how the backend runs
selective recompute (the backend and the estimator all follow them). The rules that make
a layout valid are ``llmforge.layout_rules``.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmforge.config.choices import Offload, Recompute, Schedule
from llmforge.config.schema import RunConfig

# Groups of the pipeline schedules (llmforge.config.choices.Schedule) the rules use.
#: Schedules running one model chunk per pipeline rank.
SINGLE_STAGE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
#: Schedules running several chunks (virtual stages) per pipeline rank.
MULTI_CHUNK_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS, Schedule.ZB_INTERLEAVED, Schedule.ZBV)
#: Schedules that deadlock or refuse to run with fewer microbatches than pipeline ranks.
FILLING_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B, Schedule.ZB_INTERLEAVED, Schedule.ZBV)
#: Zero-bubble schedules: the backward splits into input- and weight-gradient steps.
ZERO_BUBBLE_SCHEDULES = (Schedule.ZB_INTERLEAVED, Schedule.ZBV)
#: Schedules whose two chunks per rank form a V: rank r holds chunks r and 2 pp - 1 - r.
V_SCHEDULES = (Schedule.ZBV,)


def chunk_rank(chunk: int, *, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank holding model chunk ``chunk`` of ``pp x virtual`` chunks:
    ``chunk % pp`` (looped schedules), or the V of ``V_SCHEDULES``."""
    if v_shape:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def expert_shard_dim(local_shape: Sequence[int], *, group: int) -> int:
    """The dimension FSDP2 shards a rank's stacked expert weight (``[E / ep, ...]``) on over the
    ``group`` ranks holding the same experts (ZeRO 1-3, llmforge.parallel.data). Dim 0, the local
    experts, when they split evenly; otherwise the first later dimension that does (FSDP2 shards
    dimensions other than 0 only evenly), as torchtitan shards experts on dim 1 when the group is
    larger than the local expert count: dim 0 would leave each rank a whole padded expert.
    Dim 0, padded, when no dimension splits evenly."""
    if local_shape[0] % group == 0:
        return 0
    return next((d for d in range(1, len(local_shape)) if local_shape[d] % group == 0), 0)


def stage_ids(*, pp_rank: int, pp: int, virtual: int, schedule: Schedule) -> list[int]:
    """The pipeline chunks pipeline rank ``pp_rank`` runs, in order."""
    v_shape = schedule in V_SCHEDULES
    return [c for c in range(pp * virtual) if chunk_rank(c, pp=pp, v_shape=v_shape) == pp_rank]


@dataclass(frozen=True)
class Layout:
    """One parallel layout plus the micro batch: what a plan fixes and the search varies."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    #: ``parallel.async_tp``: the sequence-parallel collectives overlap the matmuls they feed.
    async_tp: bool = False
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    pp_virtual_stages: int = 1
    recompute: Recompute = Recompute.NONE
    recompute_every: int = 1
    micro_batch_size: int = 1
    #: Layers of each chunk for an uneven split (``parallel.pp_layers``); None: even.
    pp_layers: tuple[int, ...] | None = None
    dp_replicate: int = 1
    #: ``parallel.offload``: ``states`` keeps the shard's fp32 model states in host memory.
    offload: Offload = Offload.NONE
    offload_activations: bool = False
    #: ``parallel.bucket_mb``: ZeRO-0 gradient bucket size in MB when the reduction overlaps backward.
    bucket_mb: float = 25.0

    @classmethod
    def from_config(cls, config: RunConfig, *, dp: int) -> Layout:
        """The layout ``config`` asks for, with the data-parallel degree resolved."""
        p = config.parallel
        return cls(
            dp=dp,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            zero=p.zero,
            sequence_parallel=p.sequence_parallel,
            async_tp=p.async_tp,
            pp_schedule=p.pp_schedule,
            pp_virtual_stages=p.pp_virtual_stages,
            recompute=p.recompute,
            recompute_every=p.recompute_every,
            micro_batch_size=config.train.micro_batch_size,
            pp_layers=tuple(p.pp_layers) if p.pp_layers else None,
            dp_replicate=p.dp_replicate,
            offload=p.offload,
            offload_activations=p.offload_activations,
            bucket_mb=p.bucket_mb,
        )

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks ZeRO shards over (dp / dp_replicate under HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def v_shape(self) -> bool:
        """The schedule places chunks in a V (``chunk_rank``)."""
        return self.pp_schedule in V_SCHEDULES

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline chunks pipeline rank ``pp_rank`` runs, in order."""
        return stage_ids(pp_rank=pp_rank, pp=self.pp, virtual=self.pp_virtual_stages, schedule=self.pp_schedule)

    def __str__(self) -> str:
        """Short name of the degrees: ``single``, ``dp2xtp2``, ``hsdp2x4xtp2``."""
        parts = [f"{n}{v}" for n, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.dp_replicate > 1:  # HSDP: replicas x shard group
            parts[0] = f"hsdp{self.dp_replicate}x{self.dp_shard}"
        return "x".join(parts) or "single"

    def overrides(self) -> str:
        """The command-line overrides that select this layout."""
        parts = [
            f"parallel.dp={self.dp}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.zero={self.zero}",
            *([f"parallel.dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []),
            f"parallel.sequence_parallel={'true' if self.sequence_parallel else 'false'}",
            f"parallel.recompute={self.recompute}",
        ]
        if self.pp > 1:
            parts += [f"parallel.pp_schedule={self.pp_schedule}", f"parallel.pp_virtual_stages={self.pp_virtual_stages}"]
        if self.offload != Offload.NONE:
            parts.append(f"parallel.offload={self.offload}")
        if self.offload_activations:
            parts.append("parallel.offload_activations=true")
        if self.async_tp:
            parts.append("parallel.async_tp=true")
        parts.append(f"train.micro_batch_size={self.micro_batch_size}")
        return " ".join(parts)


def selective_recompute_runs(*, ep: int, zero: int) -> bool:
    """Whether the backend runs selective recompute: not with each MoE layer's experts in their own
    FSDP2 unit inside the checkpointed block (ep > 1 under ZeRO 1-3), whose gathers and profiler
    annotations the recompute issues differently from the forward, which torch's selective
    checkpointing refuses."""
    return ep == 1 or zero == 0


def selective_rebuilds(*, tp: int, moe: bool, compiled: bool) -> bool:
    """How the backend runs selective recompute of one block (``llmforge.parallel.recompute``), which
    the estimator follows: an eager dense block without tensor parallelism rebuilds its cheap steps
    from recipes kept in forward (no dispatch mode, no weight cast again, its last matmul's output not
    kept); a compiled, MoE or tensor-parallel block runs torch's op-level selective checkpointing."""
    return not compiled and not moe and tp == 1
