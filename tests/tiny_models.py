"""Two-block model configs the model-description tests share: a GPT-2-like and a Llama-like one."""

from __future__ import annotations

from llmforge.config.schema import ModelConfig

GPT_TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512, seq_len=32)
LLAMA_TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=160,
    vocab_size=512,
    seq_len=32,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    tie_embeddings=False,
    bias=False,
)
