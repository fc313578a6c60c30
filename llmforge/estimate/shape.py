"""The inputs of every estimate, as small frozen dataclasses that need no Hydra.

``Shape`` is the transformer (from ``model.*``), ``Job`` the rest besides the
layout (``llmforge.layout.Layout``: parallel strategy and micro batch): global
batch, precision, cluster and hardware. The search builds thousands of
``Layout`` values for one ``Shape`` and ``Job``; a ``RunPlan`` converts with
:func:`from_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from llmforge.blockspec.dims import dims_of
from llmforge.config.choices import Dtype, Fp8Recipe
from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.config.schema import ModelConfig, PrecisionConfig
from llmforge.estimate.attention import Documents, attention_cost, mask_fraction
from llmforge.hardware import Profile, get_profile, machine_memory
from llmforge.layout import Layout
from llmforge.plan import RunPlan

FP32 = 4


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
    capacity_factor: float | None = None
    moe_every: int = 1
    #: share of causal attention's (query, key) pairs the attention mask keeps (llmforge.estimate.attention)
    attention_fraction: float = 1.0
    #: precision.fp8_recipe and precision.fp8_linears: which block linears float8 would run (llmforge.blockspec.fp8)
    fp8_recipe: str = "tensorwise"
    fp8_linears: str = "auto"

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
    def attention_span(self) -> float:
        """Keys per query in the full-score FLOP convention: ``seq``, less what the mask saves."""
        return self.seq * self.attention_fraction

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
class Job:
    """Everything besides the layout: batch, precision, cluster, hardware."""

    global_batch: int
    param_dtype: str
    reduce_dtype: str
    profile: Profile
    nodes: int = 1
    devices_per_node: int | None = None
    #: None: the profile's kernel model (llmforge.estimate.kernels); a number: every FLOP at that share of peak.
    efficiency: float | None = None
    overlap_grad_reduce: bool = True
    #: precision.fp8: the blocks' linear layers run float8 matmuls (llmforge.estimate.fp8)
    fp8: bool = False
    #: ZeRO 1-3 gather those layers' weights in float8 (tensorwise, precision.fp8_all_gather)
    fp8_all_gather: bool = False
    #: train.compile: each block is compiled, its memory-bound chains fused (llmforge.estimate.kernels)
    compile: bool = False
    #: parallel.bucket_mb in bytes: ZeRO 0's gradient bucket cap (llmforge.parallel.data)
    bucket_bytes: int = 25 * 2**20
    #: precision.fp32_residual: the residual stream stays fp32 under 16-bit compute
    fp32_residual: bool = False
    #: Host memory of one node, bytes (None: the profile's ``host_memory_gib``; llmforge.estimate.node)
    host_memory: int | None = None
    #: checkpoint.async_save: each rank stages a copy of its states in host memory
    async_checkpoint: bool = False
    #: optim.name, and Muon's Newton-Schulz iterations and their dtype (llmforge.estimate.muon)
    optimizer: str = "adamw"
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "fp32"

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def residual_bytes(self) -> int:
        """Bytes of one element of the residual stream (and of the block inputs recompute saves):
        the compute dtype, or fp32 under fp32 compute or ``precision.fp32_residual``."""
        return FP32 if self.fp32_residual else self.compute_bytes

    @property
    def mixed(self) -> bool:
        """Autocast mixed precision: fp32 weights, 16-bit compute."""
        return self.param_dtype != Dtype.FP32

    @property
    def on_cpu(self) -> bool:
        """The ranks run on the host's CPU (the ``cpu`` profile): device memory is host memory."""
        return self.profile.name == "cpu"

    @property
    def node_size(self) -> int:
        return self.devices_per_node or self.profile.devices_per_node


def shape_from_config(model: ModelConfig, *, attention_fraction: float | None = None, precision: PrecisionConfig | None = None) -> Shape:
    """A Shape from a ``ModelConfig``; ``attention_fraction`` None: from the config alone
    (sliding windows; a document mask counted as one document per window); ``precision``: the
    float8 keys that choose the linears float8 runs (None: their defaults)."""
    dims = dims_of(model)
    shape = Shape(
        **{f.name: getattr(dims, f.name) for f in fields(dims)},
        dropout=model.dropout,
        attention_fraction=mask_fraction(model, streams=None) if attention_fraction is None else attention_fraction,
    )
    if precision is None:
        return shape
    return replace(shape, fp8_recipe=str(precision.fp8_recipe), fp8_linears=str(precision.fp8_linears))


def job_from_plan(plan: RunPlan) -> Job:
    """The Job of a built RunPlan (hardware profile resolved)."""
    c = plan.config
    profile = get_profile(c.cluster.accelerator, ranks_per_node=ranks_per_node(plan))
    return Job(
        global_batch=c.train.global_batch_size,
        param_dtype=c.precision.param_dtype,
        reduce_dtype=c.precision.reduce_dtype,
        profile=profile,
        nodes=c.cluster.nodes,
        devices_per_node=c.cluster.devices_per_node,
        efficiency=c.cluster.efficiency,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        fp8=c.precision.fp8,
        fp8_all_gather=c.precision.fp8 and c.precision.fp8_recipe == Fp8Recipe.TENSORWISE and c.precision.fp8_all_gather,
        compile=c.train.compile,
        bucket_bytes=max(1, int(c.parallel.bucket_mb * 2**20)),
        fp32_residual=c.precision.fp32_residual,
        async_checkpoint=c.checkpoint.async_save,
        host_memory=_host_memory(profile),
        optimizer=c.optim.name,
        muon_ns_steps=c.optim.muon_ns_steps,
        muon_ns_dtype=c.optim.muon_ns_dtype,
    )


def _host_memory(profile: Profile) -> int | None:
    """CPU ranks whose profile gives no ``host_memory_gib`` share this machine's memory."""
    if profile.name != "cpu" or profile.host_memory is not None:
        return None
    return machine_memory()


def ranks_per_node(plan: RunPlan) -> int:
    """Ranks the plan starts on each node (on a CPU they share its cores)."""
    c = plan.config.cluster
    return int(c.devices_per_node or max(1, plan.world_size // c.nodes))


def from_plan(plan: RunPlan, *, documents: Documents | None = None) -> tuple[Shape, Layout, Job]:
    """Shape, Layout and Job of a built RunPlan; ``documents``: the prepared data's document
    lengths, read by the caller (None: one document per window, llmforge.estimate.attention)."""
    fraction = attention_cost(plan.config, documents=documents).fraction
    shape = shape_from_config(plan.config.model, attention_fraction=fraction, precision=plan.config.precision)
    return shape, plan.layout, job_from_plan(plan)
