"""Data pipeline: corpus, tokenizer, packing into token shards, resumable sampler.

``prepare`` imports no torch; ``BatchSampler`` does. Names are
imported lazily so ``import llmforge.data`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PreparedData": "llmforge.data.prepare",
    "prepare": "llmforge.data.prepare",
    "BatchSampler": "llmforge.data.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmforge.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
