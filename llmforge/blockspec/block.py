"""What a transformer block is made of, written down once.

A :class:`Block` lists a block's norms, its linears (with how tensor parallelism splits
each, the unfused parts a fused one holds, and their Hugging Face names) and, for an MoE
block, its stacked experts; ``attention`` and ``mlp`` name the kinds the modules implement.
From it come the torch modules' parameter names and shapes (``llmforge.models``), the tensor
parallel plan (``llmforge.parallel.tensor``), the estimator's parameter inventory
(``llmforge.estimate.params``) and the Hugging Face name map (``llmforge.checkpoint.hf_names``).
The per-op kernel and byte costs live beside it (``llmforge.blockspec.costs``).

Names are relative to the block (``attn.qkv_proj``); ``model_tensors`` lists what sits
outside the blocks (embeddings, final norm, output layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from llmforge.blockspec.dims import ModelDims, gate_up_groups, head_dim
from llmforge.config.choices import Activation, Position
from llmforge.config.choices import Norm as NormChoice

#: Each fused linear and the unfused linears it stands for, in order (``llmforge.models.fused``).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its name, shape, tensor-parallel split (``col`` output rows,
    ``row`` input columns, ``vocab`` vocabulary rows, ``rep`` replicated), and whether it is
    an expert weight (stacked ``[E, ...]``, split over expert-parallel ranks on dim 0)."""

    name: str
    shape: tuple[int, ...]
    split: str = "rep"
    expert: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of this tensor on one tensor-parallel rank."""
        if tp == 1 or self.split == "rep":
            return self.shape
        if self.split in ("col", "vocab"):
            return (self.shape[0] // tp,) + self.shape[1:]
        return self.shape[:-1] + (self.shape[-1] // tp,)  # row: input dim split


@dataclass(frozen=True)
class HFName:
    """A tensor's Hugging Face name(s) in one ``style`` (``llama`` or ``gpt2``), without the ``.weight``/``.bias``
    suffix: one per part of a fused linear, or one that concatenates the parts (GPT-2's
    ``c_attn``); ``transpose``: the weight is stored ``[in, out]`` (GPT-2's ``Conv1D``)."""

    style: str
    names: tuple[str, ...]
    transpose: bool = False


@dataclass(frozen=True)
class Linear:
    """``nn.Linear(in_features, out_features, bias)`` at ``name`` (e.g. ``attn.qkv_proj``).
    A fused linear holds ``parts`` (unfused name, rows) whose rows come in ``groups``
    blocks (``llmforge.models.fused``)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    split: str
    parts: tuple[tuple[str, int], ...] = ()
    groups: int = 1
    hf: tuple[HFName, ...] = ()

    def params(self) -> list[Param]:
        out = [Param(f"{self.name}.weight", (self.out_features, self.in_features), self.split)]
        if self.bias:  # a row-parallel layer adds its bias once, after the reduction
            out.append(Param(f"{self.name}.bias", (self.out_features,), "col" if self.split == "col" else "rep"))
        return out

    @property
    def parent(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass(frozen=True)
class Norm:
    """A LayerNorm (weight, and bias when the model has biases) or an RMSNorm (weight) of ``size``."""

    name: str
    kind: str
    size: int
    bias: bool
    hf: tuple[HFName, ...] = ()

    def params(self) -> list[Param]:
        out = [Param(f"{self.name}.weight", (self.size,))]
        if self.bias:
            out.append(Param(f"{self.name}.bias", (self.size,)))
        return out


@dataclass(frozen=True)
class Experts:
    """``num`` stacked expert MLPs at ``name``: ``w_gate`` (gated only) and ``w_up``
    ``[E, hidden, ffn]``, ``w_down`` ``[E, ffn, hidden]``; left whole by tensor parallelism."""

    name: str
    num: int
    hidden: int
    ffn: int
    gated: bool

    def params(self) -> list[Param]:
        e, h, f = self.num, self.hidden, self.ffn
        gate = [Param(f"{self.name}.w_gate", (e, h, f), expert=True)] if self.gated else []
        return gate + [Param(f"{self.name}.w_up", (e, h, f), expert=True), Param(f"{self.name}.w_down", (e, f, h), expert=True)]


@dataclass(frozen=True)
class Block:
    """One transformer block: pre-norm attention, then a pre-norm MLP (dense or MoE).

    ``attention``: ``mha`` or ``gqa``; ``position``: ``rope`` (rotated q and k) or ``none``;
    ``mlp``: ``gelu``, ``swiglu`` or ``moe`` (``activation`` is then the experts')."""

    norms: tuple[Norm, ...]
    linears: tuple[Linear, ...]
    attention: str
    position: str
    mlp: str
    activation: str
    experts: Experts | None = None
    #: Each parameter in the order the modules register it.
    params: tuple[Param, ...] = field(default=(), compare=False)

    def linear(self, name: str) -> Linear:
        return next(x for x in self.linears if x.name == name)

    def under(self, parent: str) -> list[Linear]:
        """The linears of the module at ``parent`` (``mlp``, ``mlp.shared``), in order."""
        return [x for x in self.linears if x.parent == parent]

    def sharded(self, split: str) -> list[Linear]:
        """The linears tensor parallelism splits ``split``-wise (``col`` or ``row``)."""
        return [x for x in self.linears if x.split == split]


def _norm(d: ModelDims, name: str, hf: dict[str, str]) -> Norm:
    bias = d.norm == NormChoice.LAYERNORM and d.bias
    return Norm(name, d.norm, d.hidden, bias, tuple(HFName(s, (n,)) for s, n in hf.items()))


def _mlp(d: ModelDims, name: str, *, ffn: int, split_in: str, split_out: str, hf: bool) -> list[Linear]:
    """A dense MLP of width ``ffn``: gelu (up, down) or swiglu (gate and up fused, down)."""
    h = d.hidden
    if d.activation == Activation.SWIGLU:
        parts = FUSED["gate_up_proj"]
        names = (HFName("llama", tuple(f"mlp.{p}" for p in parts)),) if hf else ()
        first = Linear(
            f"{name}.gate_up_proj", h, 2 * ffn, d.bias, split_in, ((parts[0], ffn), (parts[1], ffn)), gate_up_groups(d, ffn=ffn), names
        )
    else:
        names = (HFName("gpt2", ("mlp.c_fc",), transpose=True),) if hf else ()
        first = Linear(f"{name}.up_proj", h, ffn, d.bias, split_in, hf=names)
    down = (HFName("llama", ("mlp.down_proj",)), HFName("gpt2", ("mlp.c_proj",), transpose=True)) if hf else ()
    return [first, Linear(f"{name}.down_proj", ffn, h, d.bias, split_out, hf=down)]


def _attention(d: ModelDims) -> list[Linear]:
    """q, k and v fused in one column-parallel projection (rows grouped by KV head), o row-parallel."""
    h, kv = d.hidden, d.kv_heads * head_dim(d)
    q, k, v = FUSED["qkv_proj"]
    qkv_hf = (HFName("llama", (f"self_attn.{q}", f"self_attn.{k}", f"self_attn.{v}")), HFName("gpt2", ("attn.c_attn",), True))
    parts = ((q, h), (k, kv), (v, kv))
    o_hf = (HFName("llama", ("self_attn.o_proj",)), HFName("gpt2", ("attn.c_proj",), True))
    return [
        Linear("attn.qkv_proj", h, h + 2 * kv, d.bias, "col", parts, d.kv_heads, qkv_hf),
        Linear("attn.o_proj", h, h, d.bias, "row", hf=o_hf),
    ]


@lru_cache(maxsize=256)
def _describe(d: ModelDims, moe: bool) -> Block:
    attn_norm = _norm(d, "attn_norm", {"llama": "input_layernorm", "gpt2": "ln_1"})
    mlp_norm = _norm(d, "mlp_norm", {"llama": "post_attention_layernorm", "gpt2": "ln_2"})
    linears = _attention(d)
    experts = None
    if moe:
        linears.append(Linear("mlp.router", d.hidden, d.num_experts, False, "rep"))
        experts = Experts("mlp.experts", d.num_experts, d.hidden, d.moe_ffn, d.activation == Activation.SWIGLU)
        if d.shared_experts:
            linears += _mlp(d, "mlp.shared", ffn=d.moe_ffn * d.shared_experts, split_in="rep", split_out="rep", hf=False)
    else:
        linears += _mlp(d, "mlp", ffn=d.ffn, split_in="col", split_out="row", hf=True)
    block = Block(
        norms=(attn_norm, mlp_norm),
        linears=tuple(linears),
        attention="gqa" if d.kv_heads < d.heads else "mha",
        position="rope" if d.position == Position.ROPE else "none",
        mlp="moe" if moe else d.activation,
        activation=d.activation,
        experts=experts,
    )
    return _with_params(block)


def _with_params(block: Block) -> Block:
    """The block with its parameters listed in the modules' order: attn_norm, attn, mlp_norm, mlp."""
    attn_norm, mlp_norm = block.norms
    attn = [p for x in block.linears if x.parent == "attn" for p in x.params()]
    mlp = [p for x in block.linears if x.name == "mlp.router" for p in x.params()]
    mlp += block.experts.params() if block.experts else []
    mlp += [p for x in block.linears if x.parent != "attn" and x.name != "mlp.router" for p in x.params()]
    params = tuple(attn_norm.params() + attn + mlp_norm.params() + mlp)
    return Block(block.norms, block.linears, block.attention, block.position, block.mlp, block.activation, block.experts, params)


def describe(d: ModelDims, *, moe: bool = False) -> Block:
    """The block of a model with dims ``d``; ``moe``: an MoE block (``is_moe_layer``)."""
    return _describe(d, moe)


def final_norm(d: ModelDims) -> Norm:
    """The norm after the last block."""
    return _norm(d, "norm", {})


def model_tensors(d: ModelDims, *, separate_head: bool = False) -> tuple[list[Param], list[Param]]:
    """(before the blocks, after them): token embedding (vocab-parallel) and learned positions;
    final norm and output layer. A tied output layer owns no weight unless ``separate_head``
    (a copy on another pipeline stage)."""
    first = [Param("embed.weight", (d.vocab, d.hidden), "vocab")]
    if d.position == Position.LEARNED:
        first.append(Param("pos_embed.weight", (d.seq, d.hidden)))
    last = final_norm(d).params()
    if not d.tie_embeddings or separate_head:
        last.append(Param("head.weight", (d.vocab, d.hidden), "vocab"))
    return first, last


#: Hugging Face names of the tensors outside the blocks, by style; blocks sit under the prefix.
HF_MODEL = {
    "llama": {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"},
    "gpt2": {
        "embed.weight": "transformer.wte.weight",
        "pos_embed.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "head.weight": "lm_head.weight",
    },
}
HF_BLOCK_PREFIX = {"llama": "model.layers.{i}.", "gpt2": "transformer.h.{i}."}
