"""Hold out a share of each stream's documents for validation.

The held-out documents are drawn from ``(val_seed, stream)`` and the document
count alone, so every rank, every layout and every resume agrees on them. Each
side of the split is presented as its own stream: its documents concatenated in
their original order, read through the same ``num_tokens`` / ``slice`` interface
as a ``TokenStream``, so the sampler cuts it into windows the usual way and no
window ever mixes tokens of the two sides.
"""

from __future__ import annotations

from typing import List

import numpy as np

from llmforge.data.reader import TokenStream

SPLITS = ("train", "val")


def held_out(num_documents: int, *, fraction: float, seed: int, stream: int) -> np.ndarray:
    """Boolean mask of the held-out documents: ``round(fraction * n)`` of them, at least one."""
    count = min(num_documents - 1, max(1, round(fraction * num_documents)))
    mask = np.zeros(num_documents, dtype=bool)
    if count > 0:
        mask[np.random.default_rng([seed, 2, stream]).choice(num_documents, size=count, replace=False)] = True
    return mask


def runs_of(doc_ends: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[n, 2] token ranges (start, stop) of the maximal runs of consecutive kept documents."""
    ends = np.asarray(doc_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    flags = np.concatenate([[False], keep, [False]]).astype(np.int8)
    edges = np.diff(flags)
    first, last = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    return np.stack([starts[first], ends[last]], axis=1) if len(first) else np.zeros((0, 2), dtype=np.int64)


class SplitStream:
    """Some documents of a token stream, concatenated: ``num_tokens`` and ``slice`` as a TokenStream."""

    def __init__(self, stream: TokenStream, *, runs: np.ndarray) -> None:
        self._stream = stream
        self._source = runs[:, 0].astype(np.int64)
        lengths = (runs[:, 1] - runs[:, 0]).astype(np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenation (a copy when it spans several runs)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        parts: List[np.ndarray] = []
        run = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop or not parts:
            base, end = int(self._starts[run]), int(self._starts[run + 1])
            take = min(stop, end)
            offset = int(self._source[run]) - base
            parts.append(self._stream.slice(start + offset, take + offset))
            start, run = take, run + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def source_ranges(self) -> np.ndarray:
        """[n, 2] token ranges of the underlying stream this split reads (for checks and tests)."""
        lengths = np.diff(self._starts)
        return np.stack([self._source, self._source + lengths], axis=1)


def open_split(stream: TokenStream, *, split: str, fraction: float, seed: int, index: int) -> SplitStream:
    """The ``train`` or ``val`` side of stream number ``index`` held out by ``fraction`` of its documents."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    ends = stream.doc_ends()
    mask = held_out(len(ends), fraction=fraction, seed=seed, stream=index)
    return SplitStream(stream, runs=runs_of(ends, mask if split == "val" else ~mask))
