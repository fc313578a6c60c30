"""The inputs of every estimate, as small frozen dataclasses that need no Hydra.

``Shape`` is the transformer (from ``model.*``), ``Layout`` the parallel
strategy and micro batch (from ``parallel.*`` and ``train.micro_batch_size``),
``Job`` the rest: global batch, precision, cluster and hardware. The search
builds thousands of ``Layout`` values for one ``Shape`` and ``Job``; a
``RunPlan`` converts with :func:`from_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from llmforge.estimate.hardware import Profile, get_profile

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Shape:
    """Transformer shape and flavour, with the MoE settings flattened in."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    norm: str = "layernorm"
    activation: str = "gelu"
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    num_experts: int = 0
    top_k: int = 2
    moe_ffn: int = 0
    shared_experts: int = 0
    capacity_factor: Optional[float] = None
    moe_every: int = 1

    def __hash__(self) -> int:
        # hashed on every cache lookup of the estimator: computed once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f) for f in self.__dataclass_fields__))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) is an MoE block (``model.moe.every``)."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


@dataclass(frozen=True)
class Layout:
    """One parallel layout plus the micro batch: what the search varies."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch: int = 1
    pp_layers: Optional[Tuple[int, ...]] = None
    dp_replicate: int = 1

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks ZeRO shards over (dp / dp_replicate under HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def overrides(self) -> str:
        """The command-line overrides that select this layout."""
        parts = [
            f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}", f"parallel.zero={self.zero}",
            *([f"parallel.dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []),
            f"parallel.sequence_parallel={'true' if self.sequence_parallel else 'false'}",
            f"parallel.recompute={self.recompute}",
        ]
        if self.pp > 1:
            parts += [f"parallel.pp_schedule={self.schedule}", f"parallel.pp_virtual_stages={self.virtual_stages}"]
        parts.append(f"train.micro_batch_size={self.micro_batch}")
        return " ".join(parts)


@dataclass(frozen=True)
class Job:
    """Everything besides the layout: batch, precision, cluster, hardware."""

    global_batch: int
    param_dtype: str
    reduce_dtype: str
    profile: Profile
    nodes: int = 1
    devices_per_node: Optional[int] = None
    #: None: the profile's kernel model (llmforge.estimate.kernels); a number: every FLOP at that share of peak.
    efficiency: Optional[float] = None
    overlap_grad_reduce: bool = True
    #: precision.fp8: the blocks' linear layers run float8 matmuls (llmforge.estimate.fp8)
    fp8: bool = False
    #: ZeRO 1-3 gather those layers' weights in float8 (tensorwise, precision.fp8_all_gather)
    fp8_all_gather: bool = False

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def mixed(self) -> bool:
        """Autocast mixed precision: fp32 weights, 16-bit compute."""
        return self.param_dtype != "fp32"

    @property
    def node_size(self) -> int:
        return self.devices_per_node or self.profile.devices_per_node


def shape_from_config(model) -> Shape:
    """A Shape from a ``ModelConfig``."""
    moe = model.moe
    return Shape(
        num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_heads,
        kv_heads=model.num_kv_heads or model.num_heads, ffn=model.ffn_hidden_size, vocab=model.vocab_size,
        seq=model.seq_len, norm=model.norm, activation=model.activation, position=model.position,
        tie_embeddings=model.tie_embeddings, bias=model.bias, dropout=model.dropout,
        num_experts=moe.num_experts, top_k=moe.top_k, moe_ffn=moe.ffn_hidden_size or model.ffn_hidden_size,
        shared_experts=moe.num_shared_experts, capacity_factor=moe.capacity_factor, moe_every=moe.every,
    )


def layout_from_plan(plan) -> Layout:
    """The Layout of a built RunPlan."""
    p = plan.config.parallel
    return Layout(
        dp=plan.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, sequence_parallel=p.sequence_parallel,
        schedule=p.pp_schedule, virtual_stages=p.pp_virtual_stages, recompute=p.recompute,
        recompute_every=p.recompute_every, micro_batch=plan.config.train.micro_batch_size,
        pp_layers=tuple(plan.layers_per_stage) if p.pp_layers else None, dp_replicate=p.dp_replicate,
    )


def job_from_plan(plan) -> Job:
    """The Job of a built RunPlan (hardware profile resolved)."""
    c = plan.config
    return Job(
        global_batch=c.train.global_batch_size, param_dtype=c.precision.param_dtype,
        reduce_dtype=c.precision.reduce_dtype, profile=get_profile(c.cluster.accelerator),
        nodes=c.cluster.nodes, devices_per_node=c.cluster.devices_per_node, efficiency=c.cluster.efficiency,
        overlap_grad_reduce=plan.overlap_grad_reduce, fp8=c.precision.fp8,
        fp8_all_gather=c.precision.fp8 and c.precision.fp8_recipe == "tensorwise" and c.precision.fp8_all_gather,
    )


def from_plan(plan) -> Tuple[Shape, Layout, Job]:
    """Shape, Layout and Job of a built RunPlan."""
    return shape_from_config(plan.config.model), layout_from_plan(plan), job_from_plan(plan)
