"""A decoder-only transformer that follows every ``model.*`` key.

GPT-2/3 style (LayerNorm, GELU, learned positions, biases, tied embeddings) and
Llama style (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) are the
same code with different settings. The model is a plain ``nn.Module``:
parallelism is applied from outside (``llmforge.parallel``), which is why

- attention reshapes with ``-1`` heads, so tensor parallelism can shard the
  projections and each rank sees only its own heads;
- blocks live in an ``nn.ModuleDict`` keyed by layer index, so a pipeline stage
  can drop the blocks it does not own and parameter names stay the same in every
  layout (checkpoints reshard by name);
- ``embed``, ``norm`` and ``head`` may be ``None`` on pipeline stages that do not
  hold them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.blockspec.block import describe, final_norm
from llmforge.blockspec.dims import dims_of, is_moe_layer
from llmforge.config.choices import Position
from llmforge.config.schema import ModelConfig
from llmforge.models.fused import fuse, layout_of, parts_of
from llmforge.models.kvcache import KVCache
from llmforge.models.layers import MLP, Attention, make_norm, rope_tables
from llmforge.models.masks import AttentionMasks, build_masks, document_positions, windowed_layer
from llmforge.models.moe import MoE
from llmforge.models.rebuild import rebuildable


def make_mlp(config: ModelConfig, *, layer_id: int) -> nn.Module:
    dims = dims_of(config)
    if is_moe_layer(dims, layer_id):
        return MoE(config)
    return MLP(describe(dims).under("mlp"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, layer_id: int) -> None:
        super().__init__()
        self.windowed = windowed_layer(config, layer_id)
        attn_norm, mlp_norm = describe(dims_of(config)).norms
        self.attn_norm = make_norm(attn_norm, eps=config.norm_eps)
        self.attn = Attention(config, windowed=self.windowed)
        self.mlp_norm = make_norm(mlp_norm, eps=config.norm_eps)
        self.mlp = make_mlp(config, layer_id=layer_id)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, mask: Any = None, cache: Any = None
    ) -> torch.Tensor:
        # mask and cache by keyword: tensor parallelism prepares the positional inputs (x, rope) only
        attended = self.attn(rebuildable(self.attn_norm, x), rope, mask=mask, cache=cache)
        x = rebuildable(torch.add, x, self.resid_dropout(attended))
        return x + self.resid_dropout(self.mlp(rebuildable(self.mlp_norm, x)))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed: nn.Embedding | None = (
            nn.Embedding(config.seq_len, config.hidden_size) if config.position == Position.LEARNED else None
        )
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleDict({str(i): Block(config, layer_id=i) for i in range(config.num_layers)})
        self.norm: nn.Module | None = make_norm(final_norm(dims_of(config)), eps=config.norm_eps)
        self.head: nn.Linear | None = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.position == Position.ROPE:
            cos, sin = rope_tables(head_dim=config.hidden_size // config.num_heads, seq_len=config.seq_len, theta=config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Token ids [b, s] -> logits [b, s, vocab]. On a pipeline stage without the
        embedding the input is the previous stage's hidden states [b, s, h]; on one
        without the output layer the result is hidden states. ``positions`` [s] are
        the global positions of the given tokens (default ``0..s-1``; context
        parallelism passes those of this rank's slice of the sequence).
        ``documents`` [b, s_window]: each token's document in the whole window
        (``llmforge.models.masks.model_documents``; None: one document, plain causal).
        ``cache`` (generation, whole model): the tokens continue the cached ones."""
        if cache is not None:
            return self._cached_forward(tokens, cache)
        h = tokens
        masks = self.attention_masks(
            positions=positions, documents=documents, batch=tokens.shape[0], length=tokens.shape[1], device=tokens.device
        )
        positions = self.token_positions(positions=positions, documents=documents, length=tokens.shape[1], device=tokens.device)
        if self.embed is not None:
            h = self.embed(tokens)
            if self.pos_embed is not None:
                h = h + self.pos_embed(positions)
            h = self.embed_dropout(h)
        rope = (self.rope_cos[positions], self.rope_sin[positions]) if self.rope_cos is not None else None
        for layer in self.layers.values():
            h = layer(h, rope, masks.for_layer(layer.windowed))
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.has_output else h

    def _cached_forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        positions = cache.start(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens)  # type: ignore[misc]
        if self.pos_embed is not None:
            h = h + self.pos_embed(positions)
        rope = (self.rope_cos[positions], self.rope_sin[positions]) if self.rope_cos is not None else None
        for index, layer in self.layers.items():
            h = layer(h, rope, None, cache.layers[int(index)])
        return self.output(self.norm(h))  # type: ignore[misc]

    def attention_masks(
        self, *, positions: torch.Tensor | None, documents: torch.Tensor | None, batch: int, length: int, device: torch.device
    ) -> AttentionMasks:
        """This microbatch's masks, built once for all of this model's layers: FlexAttention block
        masks on CUDA (dense ones under context parallelism and with dropout), dense ones elsewhere."""
        kinds = {layer.windowed for layer in self.layers.values()}
        flex = device.type == "cuda" and not (self.training and self.config.dropout > 0)
        return build_masks(
            self.config, windowed=kinds, q_positions=positions, documents=documents, length=length, batch=batch, device=device, flex=flex
        )

    def token_positions(
        self, *, positions: torch.Tensor | None, documents: torch.Tensor | None, length: int, device: torch.device
    ) -> torch.Tensor:
        """Positions for the embedding and RoPE: [s] global ones, or [b, s] inside each document (``model.position_reset``)."""
        if positions is None:
            positions = torch.arange(length, device=device)
        if self.config.position_reset and documents is not None:
            return document_positions(documents).index_select(1, positions)
        return positions

    @property
    def has_output(self) -> bool:
        return self.head is not None or (self.config.tie_embeddings and self.embed is not None and self.norm is not None)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight if self.head is not None else self.embed.weight  # type: ignore[union-attr]
        return F.linear(h, weight)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (seed, parameter name),
        so the values do not depend on construction order or on which stage holds them."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(self.config, name=name, shape=param.shape, seed=seed))
        self.init_buffers(device=next(self.parameters()).device)

    @torch.no_grad()
    def init_buffers(self, *, device: torch.device) -> None:
        """Give the buffers their fresh values on ``device``: the RoPE tables, and the
        training state some layers keep (the MoE routing bias). A model built on the meta
        device and allocated with ``to_empty`` has none of them yet."""
        if self.config.position == Position.ROPE:
            cos, sin = rope_tables(
                head_dim=self.config.hidden_size // self.config.num_heads, seq_len=self.config.seq_len, theta=self.config.rope_theta
            )
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        for module in self.modules():
            if hasattr(module, "reset_state"):
                module.reset_state(device=device)


def initial_value(config: ModelConfig, *, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The whole initial value (fp32, on the host) of the parameter ``name`` of a model
    with ``config``: zero biases, unit norm weights, and normal weights drawn from a
    generator seeded by (seed, name), scaled down on the projections into the residual stream.
    A fused projection is made of its parts' values (``llmforge.models.fused``), as drawn for
    the unfused model."""
    parts = parts_of(name)
    if parts is not None:
        sizes, groups = layout_of(config, name=name, rows=shape[0])
        values = [
            initial_value(config, name=part, shape=torch.Size([rows, *shape[1:]]), seed=seed)
            for part, rows in zip(parts, sizes, strict=False)
        ]
        return fuse(values, groups=groups)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = config.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w_down")):
        std = config.init_std / math.sqrt(2 * config.num_layers)
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Decay matrices; leave biases, norm weights and embeddings undecayed."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name or "embed" in name:
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
