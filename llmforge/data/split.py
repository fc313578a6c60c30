"""Hold out a share of each stream's documents for validation.

The held-out documents are drawn from ``(val_seed, stream)``, the documents' lengths
and the sequence length alone, so every rank, every layout and every resume agrees
on them (``held_out`` says how many). Each
side of the split is presented as its own stream: its documents concatenated in
their original order, read through the same ``num_tokens`` / ``slice`` interface
as a ``TokenStream``, so the sampler cuts it into windows the usual way and no
window ever mixes tokens of the two sides.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmforge.data.reader import TokenStream

SPLITS = ("train", "val")
#: Version of the rule choosing the held-out documents (kept in the sampler's state: a
#: resume under another rule would train on documents held out before).
SPLIT_RULE = 2


#: Datasets of fewer documents hold one out only when the fraction itself asks for one.
MIN_DOCUMENTS = 10
#: At most this many documents of a dataset are held out: a large corpus trains on the rest.
MAX_DOCUMENTS = 10_000
#: The held-out set may grow to this share of a dataset's documents to reach one sequence.
MAX_GROWN_SHARE = 0.1


def held_out_count(num_documents: int, *, fraction: float) -> int:
    """Documents ``fraction`` holds out of ``num_documents`` before the length check:
    ``round(fraction * n)``, at least 1 once there are ``MIN_DOCUMENTS``, at most
    ``MAX_DOCUMENTS``, and always fewer than ``n``."""
    count = round(fraction * num_documents)
    if count == 0 and fraction > 0 and num_documents >= MIN_DOCUMENTS:
        count = 1
    return max(0, min(count, MAX_DOCUMENTS, num_documents - 1))


def held_out(doc_ends: np.ndarray, *, fraction: float, seed: int, stream: int, min_tokens: int = 1) -> np.ndarray:
    """Boolean mask of the held-out documents: ``held_out_count`` of them in a seeded order,
    grown in that order (up to ``MAX_GROWN_SHARE`` of the documents) until they hold
    ``min_tokens``; none when even that falls short."""
    ends = np.asarray(doc_ends, dtype=np.int64)
    n = len(ends)
    mask = np.zeros(n, dtype=bool)
    count = held_out_count(n, fraction=fraction)
    if count == 0:
        return mask
    order = np.random.default_rng([seed, 2, stream]).permutation(n)
    lengths = np.diff(ends, prepend=0)[order]
    needed = int(np.searchsorted(np.cumsum(lengths), min_tokens)) + 1
    take = max(count, needed)
    if take > min(max(count, int(MAX_GROWN_SHARE * n)), n - 1):
        return mask
    mask[order[:take]] = True
    return mask


def held_out_masks(doc_ends: Sequence[np.ndarray], *, fraction: float, seed: int, min_tokens: int) -> list[np.ndarray]:
    """``held_out`` of every stream, or none held out anywhere when some stream can hold
    none (a validation set always covers every dataset)."""
    masks = [held_out(ends, fraction=fraction, seed=seed, stream=i, min_tokens=min_tokens) for i, ends in enumerate(doc_ends)]
    if all(m.any() for m in masks):
        return masks
    return [np.zeros_like(m) for m in masks]


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
        parts: list[np.ndarray] = []
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


def open_split(stream: TokenStream, *, split: str, mask: np.ndarray) -> SplitStream:
    """The ``train`` or ``val`` side of a token stream whose held-out documents are ``mask``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    return SplitStream(stream, runs=runs_of(stream.doc_ends(), mask if split == "val" else ~mask))
