"""Every rule that makes a run's parallel layout valid: the ``check_*`` functions of
``RunPlan.build`` (and of an elastic run's node count), including what the backend cannot
run, so that a layout they accept can be planned, estimated, searched and launched alike.
Each returns its problems, every one naming the key and the fix.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from llmforge.config.choices import Offload, Recompute
from llmforge.config.schema import RunConfig
from llmforge.errors import Problem
from llmforge.layout import FILLING_SCHEDULES, MULTI_CHUNK_SCHEDULES, V_SCHEDULES, selective_recompute_runs
from llmforge.layout_fixes import global_batch_fix, world_fix


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
                world_fix(config),
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
                f"set parallel.pp_schedule={MULTI_CHUNK_SCHEDULES[0]} (or one of {', '.join(MULTI_CHUNK_SCHEDULES[1:])}), "
                "or parallel.pp_virtual_stages=1",
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
                _batch_fix(config),
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
                f"{_batch_fix(config)}, or lower train.micro_batch_size",
            )
        )
    elif p.pp > 1 and p.pp_schedule in MULTI_CHUNK_SCHEDULES and m % p.pp:
        out.append(
            Problem(
                "train.global_batch_size",
                t.global_batch_size,
                f"gives {m} microbatches, not a multiple of parallel.pp={p.pp} as {p.pp_schedule} needs",
                _batch_fix(config),
            )
        )
    return out


def _batch_fix(config: RunConfig) -> str:
    batch, multiple = global_batch_fix(config)
    return f"set train.global_batch_size={batch} (a multiple of {multiple})"


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
