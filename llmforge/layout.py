"""The parallel layout of a run, and every rule that makes a layout valid.

``Layout`` holds the degrees (dp with its HSDP split, tp, pp with its virtual
stages, cp, ep) and the strategy the estimator and the backend need (ZeRO stage,
sequence parallel, pipeline schedule and split, recompute, micro batch). A
``RunPlan`` owns one (``plan.layout``); the estimator's search builds thousands.

The ``check_*`` functions are the layout rules of ``RunPlan.build``, including
what the backend cannot run: a layout they accept can be planned, estimated,
searched and launched alike. ``chunk_rank`` is the one rule placing pipeline
chunks on pipeline ranks; ``expert_shard_dim`` the one rule choosing the dimension
ZeRO shards an expert weight on (the backend and the estimator both follow it).

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmforge.config.choices import Offload, Recompute, Schedule
from llmforge.config.schema import RunConfig
from llmforge.errors import Problem

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


def world_and_dp(config: RunConfig, *, world: int | None = None) -> tuple[int, int]:
    """World size and data-parallel degree (``parallel.dp=auto``: what the devices leave);
    ``world``: the ranks an elastic run got (llmforge.elastic) instead of nodes x devices_per_node."""
    p, c = config.parallel, config.cluster
    model_parallel = p.tp * p.pp * p.cp
    if world is not None:
        return world, world // model_parallel if p.dp == "auto" else int(p.dp)
    if c.devices_per_node is None:
        dp = 1 if p.dp == "auto" else int(p.dp)
        return dp * model_parallel, dp
    world = c.nodes * c.devices_per_node
    dp = world // model_parallel if p.dp == "auto" else int(p.dp)
    return world, dp


def ints(*values: Any) -> bool:
    """Whether every value is an int (not a bool): rules on values of the wrong type are skipped."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _dp(config: RunConfig) -> int | None:
    """The data-parallel degree, or None while the degrees themselves are invalid."""
    p = config.parallel
    if not ints(p.tp, p.pp, p.cp) or min(p.tp, p.pp, p.cp) < 1 or (p.dp != "auto" and not ints(p.dp)):
        return None
    return world_and_dp(config)[1]


def check_world(config: RunConfig) -> list[Problem]:
    """dp x tp x pp x cp fills the devices; tp stays inside a node."""
    p, c = config.parallel, config.cluster
    out: list[Problem] = []
    if not ints(p.tp, p.pp, p.cp) or (p.dp != "auto" and not ints(p.dp)):
        return out
    model_parallel = p.tp * p.pp * p.cp
    if c.devices_per_node is None:
        return out
    world = c.nodes * c.devices_per_node
    if p.dp == "auto":
        if world % model_parallel:
            out.append(
                Problem(
                    "parallel",
                    f"tp*pp*cp={model_parallel}",
                    f"does not divide the world size {world} (cluster.nodes x cluster.devices_per_node)",
                    "change tp/pp/cp or the number of devices",
                )
            )
    elif p.dp * model_parallel != world:
        out.append(
            Problem(
                "parallel.dp",
                p.dp,
                f"dp*tp*pp*cp = {p.dp * model_parallel} but the world size is {world} (cluster.nodes={c.nodes} x "
                f"cluster.devices_per_node={c.devices_per_node})",
                f"set parallel.dp=auto or cluster.devices_per_node={p.dp * model_parallel // max(c.nodes, 1)}",
            )
        )
    if p.tp > c.devices_per_node:
        out.append(
            Problem(
                "parallel.tp",
                p.tp,
                f"larger than cluster.devices_per_node={c.devices_per_node}: tensor parallel must stay inside a node",
                "lower tp and raise pp or dp",
            )
        )
    return out


def check_tp(config: RunConfig) -> list[Problem]:
    """tp divides heads, kv heads, ffn and vocab; sequence parallel and cp split the sequence evenly."""
    m, p = config.model, config.parallel
    out: list[Problem] = []
    kv = m.num_kv_heads or m.num_heads
    if not ints(p.tp, p.cp) or p.tp < 1 or p.cp < 1:
        return out
    if m.num_heads % p.tp:
        out.append(
            Problem("parallel.tp", p.tp, f"does not divide model.num_heads={m.num_heads}", "pick tp among the divisors of num_heads")
        )
    if kv % p.tp:
        out.append(Problem("parallel.tp", p.tp, f"does not divide model.num_kv_heads={kv}", "pick tp among the divisors of num_kv_heads"))
    if m.ffn_hidden_size % p.tp:
        out.append(
            Problem("parallel.tp", p.tp, f"does not divide model.ffn_hidden_size={m.ffn_hidden_size}", "pick tp dividing ffn_hidden_size")
        )
    if m.vocab_size % p.tp:
        out.append(
            Problem(
                "model.vocab_size",
                m.vocab_size,
                f"not divisible by parallel.tp={p.tp} (vocab-parallel embedding)",
                "pad vocab_size to a multiple of tp",
            )
        )
    if p.sequence_parallel and p.tp == 1:
        out.append(
            Problem(
                "parallel.sequence_parallel",
                True,
                "sequence parallel splits activations over tp ranks, and tp=1",
                "set parallel.tp>1 or parallel.sequence_parallel=false",
            )
        )
    if p.sequence_parallel and m.seq_len % p.tp:
        out.append(
            Problem(
                "model.seq_len", m.seq_len, f"not divisible by parallel.tp={p.tp} with sequence parallel", "make seq_len a multiple of tp"
            )
        )
    if p.cp > 1 and m.seq_len % (2 * p.cp):  # only context parallelism splits a sequence
        out.append(
            Problem(
                "model.seq_len",
                m.seq_len,
                f"not a multiple of {2 * p.cp}: context parallelism (parallel.cp={p.cp}) splits each sequence into 2 x cp equal chunks",
                f"make model.seq_len a multiple of {2 * p.cp}, or lower parallel.cp",
            )
        )
    return out


def check_pipeline(config: RunConfig) -> list[Problem]:
    """The layers split over pp x virtual stages; the schedule fits the virtual stages."""
    m, p = config.model, config.parallel
    out: list[Problem] = []
    if not ints(p.pp, p.pp_virtual_stages) or p.pp < 1 or p.pp_virtual_stages < 1:
        return out
    chunks = p.pp * p.pp_virtual_stages
    if p.pp_layers:
        if len(p.pp_layers) != chunks or sum(p.pp_layers) != m.num_layers or min(p.pp_layers) < 1:
            out.append(
                Problem(
                    "parallel.pp_layers",
                    list(p.pp_layers),
                    f"needs {chunks} positive entries (pp x virtual stages) summing to model.num_layers={m.num_layers}",
                    "list the layers of each stage, e.g. [3,5]",
                )
            )
    elif m.num_layers % chunks:
        out.append(
            Problem(
                "model.num_layers",
                m.num_layers,
                f"not divisible by pp x virtual stages = {chunks}",
                "change pp or pp_virtual_stages, or set parallel.pp_layers for an uneven split",
            )
        )
    multi = p.pp_schedule in MULTI_CHUNK_SCHEDULES
    if p.pp_virtual_stages > 1 and not multi:
        out.append(
            Problem(
                "parallel.pp_virtual_stages",
                p.pp_virtual_stages,
                f"schedule {p.pp_schedule} runs one stage per rank",
                f"use one of {', '.join(MULTI_CHUNK_SCHEDULES)} or pp_virtual_stages=1",
            )
        )
    if multi and p.pp_virtual_stages < 2 and p.pp > 1:
        out.append(
            Problem(
                "parallel.pp_schedule",
                p.pp_schedule,
                "this schedule needs at least 2 virtual stages per rank",
                "set parallel.pp_virtual_stages=2",
            )
        )
    if p.pp_schedule in V_SCHEDULES and p.pp_virtual_stages != 2 and p.pp > 1:
        out.append(
            Problem(
                "parallel.pp_virtual_stages",
                p.pp_virtual_stages,
                "the ZBV schedule uses exactly 2 stages per rank (V shape)",
                "set parallel.pp_virtual_stages=2",
            )
        )
    return out


def check_batch(config: RunConfig) -> list[Problem]:
    """The global batch splits into whole microbatches per data-parallel rank, enough to fill the pipe."""
    t, p = config.train, config.parallel
    out: list[Problem] = []
    if not ints(t.micro_batch_size, t.global_batch_size) or t.micro_batch_size < 1:
        return out
    dp = _dp(config)
    if dp is None or dp < 1:
        return out
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        out.append(
            Problem(
                "train.global_batch_size",
                t.global_batch_size,
                f"not divisible by micro_batch_size x dp = {t.micro_batch_size} x {dp}",
                f"use a multiple of {per_step}, e.g. {max(per_step, t.global_batch_size // per_step * per_step)}",
            )
        )
        return out
    m = t.global_batch_size // per_step
    if p.pp > 1 and p.pp_schedule in FILLING_SCHEDULES and m < p.pp:
        out.append(
            Problem(
                "train.global_batch_size",
                t.global_batch_size,
                f"gives {m} microbatches per pipeline, fewer than parallel.pp={p.pp} stages that {p.pp_schedule} must fill",
                f"raise global_batch_size to {p.pp * per_step} or lower micro_batch_size",
            )
        )
    elif p.pp > 1 and p.pp_schedule in MULTI_CHUNK_SCHEDULES and m % p.pp:
        out.append(
            Problem(
                "train.global_batch_size",
                t.global_batch_size,
                f"gives {m} microbatches, not a multiple of parallel.pp={p.pp} as {p.pp_schedule} needs",
                f"use a multiple of {p.pp * per_step}",
            )
        )
    return out


def check_ep(config: RunConfig) -> list[Problem]:
    """ep needs an MoE model, divides its experts and the dp x cp ranks of a model replica."""
    moe, p = config.model.moe, config.parallel
    out: list[Problem] = []
    if moe.num_experts < 0 or not ints(p.ep):
        return out
    if moe.num_experts == 0:
        if p.ep > 1:
            out.append(
                Problem(
                    "parallel.ep",
                    p.ep,
                    "expert parallel needs an MoE model (model.moe.num_experts=0)",
                    "set parallel.ep=1 or pick an MoE model",
                )
            )
        return out
    if p.ep < 1:
        return out
    if moe.num_experts % p.ep:
        out.append(
            Problem(
                "parallel.ep", p.ep, f"does not divide model.moe.num_experts={moe.num_experts}", "pick ep among the divisors of num_experts"
            )
        )
    dp = _dp(config)
    if dp is not None and dp >= 1 and (dp * p.cp) % p.ep:
        out.append(
            Problem(
                "parallel.ep",
                p.ep,
                f"experts are split over the dp x cp = {dp * p.cp} ranks of a model replica's group, which ep does not divide",
                "choose ep dividing dp x cp",
            )
        )
    if ints(p.zero) and p.recompute == Recompute.SELECTIVE and not selective_recompute_runs(ep=p.ep, zero=p.zero):
        out.append(
            Problem(
                "parallel.recompute",
                p.recompute,
                f"selective recompute does not run with expert parallelism under ZeRO 1-3 (parallel.ep={p.ep}, parallel.zero={p.zero}): "
                "torch's selective checkpointing stops on the experts' own FSDP2 unit inside each block",
                "set parallel.recompute=full (or none), or parallel.zero=0",
            )
        )
    return out


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


def check_hsdp(config: RunConfig) -> list[Problem]:
    """parallel.dp_replicate splits the FSDP (ZeRO 1-3) data-parallel group into replicas of a shard group."""
    p = config.parallel
    out: list[Problem] = []
    if not ints(p.dp_replicate) or p.dp_replicate <= 1 or not ints(p.tp, p.pp, p.cp) or min(p.tp, p.pp, p.cp) < 1:
        return out
    if p.zero == 0:
        out.append(
            Problem(
                "parallel.dp_replicate",
                p.dp_replicate,
                "HSDP replicates ZeRO shard groups, and parallel.zero=0 shards nothing",
                "set parallel.zero=3 (or 1, 2), or parallel.dp_replicate=1",
            )
        )
    dp = _dp(config)
    if dp is None:
        return out
    if dp >= 1 and dp % p.dp_replicate:
        out.append(
            Problem(
                "parallel.dp_replicate",
                p.dp_replicate,
                f"does not divide the data-parallel size dp={dp}",
                "pick a divisor of dp, e.g. cluster.nodes (one shard group per node)",
            )
        )
    if p.ep > 1 or p.cp > 1:
        key, value = ("parallel.ep", p.ep) if p.ep > 1 else ("parallel.cp", p.cp)
        out.append(
            Problem(
                key,
                value,
                "HSDP (parallel.dp_replicate > 1) is not combined with expert or context parallelism",
                f"set {key}=1 or parallel.dp_replicate=1",
            )
        )
    return out


def check_backend(config: RunConfig) -> list[Problem]:
    """Layouts the backend cannot run: context parallelism with pipelines or MoE models."""
    p = config.parallel
    out: list[Problem] = []
    if not ints(p.cp, p.pp) or p.cp <= 1:
        return out
    if p.pp > 1:
        out.append(
            Problem(
                "parallel.cp",
                p.cp,
                f"context parallelism is not supported with pipeline parallelism (parallel.pp={p.pp})",
                "set parallel.cp=1 or parallel.pp=1",
            )
        )
    if config.model.moe.num_experts > 0:
        out.append(
            Problem(
                "parallel.cp",
                p.cp,
                "context parallelism is not supported with MoE models (model.moe.num_experts > 0): routing and the router losses would "
                "see only a slice of each sequence",
                "set parallel.cp=1 or model.moe.num_experts=0",
            )
        )
    return out


def check_async_tp(config: RunConfig) -> list[Problem]:
    """parallel.async_tp runs torch's micro-pipelined TP: symmetric memory on CUDA, found in
    compiled graphs, over the sequence-parallel all-gathers and reduce-scatters."""
    p = config.parallel
    out: list[Problem] = []
    if not p.async_tp:
        return out
    needs = [
        (
            config.cluster.accelerator == "cpu",
            "runs on CUDA symmetric memory, and cluster.accelerator=cpu runs gloo on CPU",
            "set parallel.async_tp=false on CPU",
        ),
        (not config.train.compile, "is a torch.compile pass, and train.compile=false", "set train.compile=true or parallel.async_tp=false"),
        (
            ints(p.tp) and p.tp == 1,
            "overlaps tensor-parallel collectives, and parallel.tp=1",
            "set parallel.tp>1 or parallel.async_tp=false",
        ),
        (
            not p.sequence_parallel,
            "overlaps sequence parallel's all-gathers and reduce-scatters, and parallel.sequence_parallel=false",
            "set parallel.sequence_parallel=true or parallel.async_tp=false",
        ),
    ]
    reasons = [(why, fix) for failed, why, fix in needs if failed]
    if reasons:
        out.append(Problem("parallel.async_tp", True, "; ".join(why for why, _ in reasons), "; ".join(fix for _, fix in reasons)))
    return out


def check_offload(config: RunConfig) -> list[Problem]:
    """CPU offload runs on FSDP2 (ZeRO 1-3) and not with float8 training or compiled blocks' saved activations."""
    p = config.parallel
    out: list[Problem] = []
    if p.offload == Offload.STATES and p.zero == 0:
        out.append(
            Problem(
                "parallel.offload",
                p.offload,
                "offloaded states are FSDP2's CPUOffloadPolicy, and parallel.zero=0 does not shard with FSDP2",
                "set parallel.zero=1 (compute weights and gradients stay whole on the device: one copy each way per step) or 3 (least "
                "device memory)",
            )
        )
    dp = _dp(config)
    if p.offload == Offload.STATES and p.zero > 0 and dp is not None and ints(p.cp) and dp * p.cp == 1 and world_and_dp(config)[0] > 1:
        out.append(
            Problem(
                "parallel.offload",
                p.offload,
                "FSDP2 shards over the data-parallel ranks, and this layout has dp x cp = 1 on several ranks, so nothing carries the "
                "offload",
                "use data parallelism (parallel.dp > 1) with ZeRO, or parallel.offload=none",
            )
        )
    if p.offload == Offload.STATES and config.precision.fp8:
        out.append(
            Problem(
                "parallel.offload",
                p.offload,
                "is not combined with precision.fp8 (float8 weight scales are computed on the device from the sharded weights)",
                "set parallel.offload=none or precision.fp8=false",
            )
        )
    if p.offload_activations and config.train.compile:
        out.append(
            Problem(
                "parallel.offload_activations",
                True,
                "saved-tensor hooks and torch.compile'd blocks are not combined",
                "set train.compile=false or parallel.offload_activations=false",
            )
        )
    return out
