"""The numbers a block description is made from, whoever asks: the torch model reads them
from a ``ModelConfig`` (:func:`dims_of`), the estimator passes its ``Shape``, which has the
same fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from llmforge.config.schema import ModelConfig


class ModelDims(Protocol):
    """What a description needs of a model (``llmforge.estimate.shape.Shape`` is one); hashable,
    as descriptions are kept per model."""

    def __hash__(self) -> int: ...

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def ffn(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def norm(self) -> str: ...
    @property
    def activation(self) -> str: ...
    @property
    def position(self) -> str: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def bias(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def moe_ffn(self) -> int: ...
    @property
    def shared_experts(self) -> int: ...
    @property
    def moe_every(self) -> int: ...
    @property
    def capacity_factor(self) -> float | None: ...


@dataclass(frozen=True)
class Dims:
    """A ``ModelDims`` read from a ``ModelConfig``."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    norm: str
    activation: str
    position: str
    tie_embeddings: bool
    bias: bool
    num_experts: int
    top_k: int
    moe_ffn: int
    shared_experts: int
    moe_every: int
    capacity_factor: float | None


def dims_of(model: ModelConfig) -> Dims:
    """The description's numbers of a ``model.*`` config."""
    moe = model.moe
    return Dims(
        num_layers=model.num_layers,
        hidden=model.hidden_size,
        heads=model.num_heads,
        kv_heads=model.num_kv_heads or model.num_heads,
        ffn=model.ffn_hidden_size,
        vocab=model.vocab_size,
        seq=model.seq_len,
        norm=str(model.norm),
        activation=str(model.activation),
        position=str(model.position),
        tie_embeddings=model.tie_embeddings,
        bias=model.bias,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        moe_ffn=moe.ffn_hidden_size or model.ffn_hidden_size,
        shared_experts=moe.num_shared_experts,
        moe_every=moe.every,
        capacity_factor=moe.capacity_factor,
    )


def head_dim(d: ModelDims) -> int:
    return d.hidden // d.heads


def is_moe_layer(d: ModelDims, index: int) -> bool:
    """Whether block ``index`` (0-based) is an MoE block (``model.moe.every``)."""
    return d.num_experts > 0 and (index + 1) % d.moe_every == 0


def gate_up_groups(d: ModelDims, *, ffn: int) -> int:
    """Row blocks of a fused gate/up projection of width ``ffn``: every tp the plan allows
    divides both ``num_kv_heads`` and ``ffn_hidden_size``, hence their greatest common divisor."""
    return math.gcd(d.kv_heads, ffn)
