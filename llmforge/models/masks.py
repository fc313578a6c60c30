"""Attention masks of packed windows: causal, document (block-causal) and sliding windows.

Documents are packed end to end and each is followed by the end-of-document token,
so a document starts at the beginning of a window and after every end-of-document
token. ``document_ids`` numbers the documents of each row; the model builds its masks
from those numbers once per microbatch (``build_masks``) and hands every layer the
one it needs: ``None`` (plain causal attention, the fast path), a dense boolean mask
``[b, 1, s_q, s_k]`` (True = attend; SDPA on the CPU, under context parallelism and
with dropout) or a FlexAttention block mask (CUDA).

A token at position q attends to key k when ``k <= q``, with ``document`` when both
are in the same document, and on a sliding-window layer when ``q - k < window`` (itself
and at most ``window - 1`` earlier tokens, as Hugging Face's Mistral and Gemma-2 count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmforge.config.choices import AttentionMask
from llmforge.config.schema import ModelConfig


def windowed_layer(config: ModelConfig, layer_id: int) -> bool:
    """Whether block ``layer_id`` uses the sliding window."""
    if config.sliding_window <= 0:
        return False
    if config.sliding_window_layers:
        return layer_id in config.sliding_window_layers
    return layer_id % config.sliding_window_every == 0


def needs_eos(config: ModelConfig) -> bool:
    """Whether the model needs the end-of-document token (its mask or positions follow documents)."""
    return config.attention_mask == AttentionMask.DOCUMENT or config.position_reset


def model_documents(config: ModelConfig, tokens: torch.Tensor, *, eos_id: int | None) -> torch.Tensor | None:
    """What a training step passes as ``GPT.forward(documents=)`` for the whole [b, s] input: None
    under plain causal attention; the document ids when masks or positions follow documents; else
    (a sliding window alone) one document per row, which tells the model the window's length."""
    if needs_eos(config):
        if eos_id is None:
            raise ValueError("model.attention_mask=document and model.position_reset need the end-of-document token id")
        return document_ids(tokens, eos_id=eos_id)
    if config.sliding_window > 0:
        return torch.zeros(tokens.shape, dtype=torch.int32, device=tokens.device)
    return None


def document_ids(tokens: torch.Tensor, *, eos_id: int) -> torch.Tensor:
    """[b, s] index of each token's document in its row: a new one starts after every end-of-document token."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] position of each token inside its document (0 at each document start)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


@dataclass
class AttentionMasks:
    """The masks of one microbatch: ``full`` for layers without the window, ``windowed`` for the others."""

    full: Any = None
    windowed: Any = None

    def for_layer(self, windowed: bool) -> Any:
        return self.windowed if windowed else self.full


def dense_mask(*, q_positions: torch.Tensor, k_len: int, documents: torch.Tensor | None, window: int) -> torch.Tensor:
    """Boolean [b or 1, 1, s_q, k_len] mask of queries at ``q_positions`` against keys ``0..k_len-1``."""
    k = torch.arange(k_len, device=q_positions.device)[None, :]
    q = q_positions[:, None]
    allowed = k <= q
    if window > 0:
        allowed = allowed & (q - k < window)
    if documents is None:
        return allowed[None, None]
    same = documents.index_select(1, q_positions)[:, :, None] == documents[:, None, :]
    return (allowed[None] & same)[:, None]


def block_mask(*, documents: torch.Tensor | None, window: int, length: int, batch: int, device: torch.device) -> Any:
    """The FlexAttention block mask of the same rule over a whole window (no context parallelism)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        allowed = k <= q
        if window > 0:
            allowed = allowed & (q - k < window)
        if documents is not None:
            allowed = allowed & (documents[b, q] == documents[b, k])
        return allowed

    rows = batch if documents is not None else None
    # compiled where FlexAttention runs (CUDA): the eager builder materialises the whole mask
    return create_block_mask(mask_mod, rows, None, length, length, device=device, _compile=device.type == "cuda")


def build_masks(
    config: ModelConfig,
    *,
    windowed: set,
    q_positions: torch.Tensor | None,
    documents: torch.Tensor | None,
    length: int,
    batch: int,
    device: torch.device,
    flex: bool,
) -> AttentionMasks:
    """Every mask the given layers need, built once. ``windowed``: which of the kinds (True, False) occur;
    ``q_positions``: the queries' global positions under context parallelism (else None)."""
    docs = documents if config.attention_mask == AttentionMask.DOCUMENT else None
    masks = AttentionMasks()
    for kind in windowed:
        window = config.sliding_window if kind else 0
        if docs is None and window == 0:
            continue  # plain causal: the fast path
        if flex and q_positions is None:
            mask = block_mask(documents=docs, window=window, length=length, batch=batch, device=device)
        else:
            k_len = documents.shape[1] if documents is not None else length
            q = q_positions if q_positions is not None else torch.arange(length, device=device)
            mask = dense_mask(q_positions=q, k_len=k_len, documents=docs, window=window)
        setattr(masks, "windowed" if kind else "full", mask)
    return masks
