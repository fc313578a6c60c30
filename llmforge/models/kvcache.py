"""Keys and values of earlier tokens, kept per layer for generation.

``GPT.forward(tokens, cache=cache)`` runs only the new tokens: each layer appends
their keys and values (after RoPE; grouped-query heads stored once, as the model
computes them) and attends to what the cache holds. A sliding-window layer keeps
only its last ``window - 1`` keys after each call, so its memory and work stay
bounded; the others keep the whole sequence, which is at most ``model.seq_len``
tokens (the positions the model has).
"""

from __future__ import annotations

import torch

from llmforge.config.schema import ModelConfig
from llmforge.models.masks import windowed_layer


class LayerCache:
    """One layer's keys and values [b, kv_heads, n, head_dim] and their positions [n]."""

    def __init__(self, *, window: int) -> None:
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.query_positions = torch.zeros(0, dtype=torch.long)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values; return all keys, values and the [n_q, n_k]
        mask (True = attend) of the new queries (at ``query_positions``)."""
        q_positions = self.query_positions
        if self.keys is None:
            self.keys, self.values, self.positions = k, v, q_positions
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
            self.positions = torch.cat([self.positions, q_positions])
        keys, values, k_pos = self.keys, self.values, self.positions
        mask = k_pos[None, :] <= q_positions[:, None]
        if self.window > 0:
            mask = mask & (q_positions[:, None] - k_pos[None, :] < self.window)
            drop = max(0, k_pos.numel() - (self.window - 1))
            self.keys, self.values, self.positions = keys[:, :, drop:], values[:, :, drop:], k_pos[drop:]
        return keys, values, mask


class KVCache:
    """Every layer's cache of one batch of sequences and how many tokens it has seen."""

    def __init__(self, config: ModelConfig) -> None:
        self.length = 0
        self.layers: list[LayerCache] = [
            LayerCache(window=config.sliding_window if windowed_layer(config, i) else 0) for i in range(config.num_layers)
        ]

    def start(self, count: int, *, device: torch.device) -> torch.Tensor:
        """The positions of the next ``count`` tokens, which every layer's queries take; counted as seen."""
        positions = torch.arange(self.length, self.length + count, device=device)
        for layer in self.layers:
            layer.query_positions = positions
        self.length += count
        return positions

    def held(self) -> int:
        """Keys held over all layers (the cache's size in tokens x layers)."""
        return sum(0 if layer.keys is None else layer.keys.shape[2] for layer in self.layers)
