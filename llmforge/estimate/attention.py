"""What an attention mask saves: the share of causal attention's work it keeps.

The estimator counts attention as ``4 x seq x hidden`` FLOPs per token and layer
(every key of the window, llmforge.estimate.flops) and times the causal half of it
(llmforge.estimate.kernels). Both are multiplied by ``Shape.attention_fraction``,
the average over layers of

    score entries under the mask / score entries of plain causal attention

counted in the full-score convention (a causal block of n tokens: n**2 entries; a
sliding window: twice the attended pairs less the diagonal), so a document mask
counts exactly what a flop counter counts when each document runs alone:

- causal: 1;
- a sliding window of N (itself and N-1 earlier tokens): from N and ``model.seq_len``;
- document: from the document lengths passed in with the plan (``documents``: the
  ``doc_ends.npy`` of each stream of the prepared data, which the command reads once,
  ``llmforge.data.prepare.document_ends_for``), cut into the ``model.seq_len`` windows
  the sampler reads. Without them every window is assumed to be one document (no
  saving) and the estimate says so: the estimator itself reads no files, so the same
  inputs give the same numbers before and after ``llmforge data prepare``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmforge.config.choices import AttentionMask
from llmforge.config.schema import ModelConfig, RunConfig

#: (exclusive end offset of every document of a stream, the stream's mixture weight), per stream
#: of the prepared data (``llmforge.data.prepare.document_ends_for``).
Documents = Sequence[tuple[Sequence[int], float]]

MAX_WINDOWS = 1 << 16  # windows of each stream read for the document statistics


@dataclass(frozen=True)
class AttentionCost:
    """``fraction``: of causal attention's score entries the mask keeps (averaged over layers)."""

    mask: str
    sliding_window: int
    windowed_layers: int
    fraction: float
    note: str


def scores(length: Any, window: int) -> Any:
    """Score-matrix entries of causal attention over ``length`` tokens in the full-score convention
    (``length**2``, as the flop counter counts a causal block); each query seeing at most ``window``
    keys (0: all): twice the attended pairs less the diagonal. Numbers and numpy arrays alike."""
    if window <= 0:
        return length * length
    capped = window * (window + 1) + 2 * (length - window) * window - length
    return length * length * (length <= window) + capped * (length > window)


def window_fraction(*, seq: int, window: int) -> float:
    """What a sliding window keeps of a window of ``seq`` tokens of one document."""
    return float(scores(seq, window) / scores(seq, 0))


def document_fraction(doc_ends: Sequence[int], *, seq: int, window: int = 0) -> float:
    """Share of causal pairs kept when each of the stream's ``seq``-token windows attends within
    its documents (``doc_ends``: exclusive end offset of every document in the stream)."""
    import numpy as np

    ends = np.asarray(doc_ends, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    windows = min(max(0, (total - 1) // seq), MAX_WINDOWS)
    if windows == 0:
        return window_fraction(seq=seq, window=window)
    stop = windows * seq
    cuts = np.union1d(ends[ends < stop], np.arange(0, stop + 1, seq))
    segments = np.diff(cuts)
    return float(scores(segments.astype(np.float64), window).sum() / (windows * scores(seq, 0)))


def mask_fraction(model: ModelConfig, *, streams: Documents | None) -> float:
    """Layer-averaged fraction for a ``ModelConfig``; ``streams``: (doc_ends, mixture weight) of the
    prepared data, or None (one document per window)."""
    windowed = _windowed_layers(model)
    kinds = [(windowed, model.sliding_window), (model.num_layers - windowed, 0)]
    total = 0.0
    for count, window in kinds:
        if count == 0:
            continue
        if model.attention_mask == AttentionMask.DOCUMENT and streams:
            weight = sum(w for _, w in streams)
            kept = sum(w * document_fraction(ends, seq=model.seq_len, window=window) for ends, w in streams) / weight
        else:
            kept = window_fraction(seq=model.seq_len, window=window)
        total += count * kept
    return total / max(1, model.num_layers)


def _windowed_layers(model: ModelConfig) -> int:
    if model.sliding_window <= 0:
        return 0
    if model.sliding_window_layers:
        return len(set(model.sliding_window_layers))
    return len(range(0, model.num_layers, model.sliding_window_every))


def attention_cost(config: RunConfig, *, documents: Documents | None = None) -> AttentionCost:
    """The attention cost of a RunConfig; ``documents``: the prepared data's document lengths
    (used where the mask follows documents), None where none were read."""
    model = config.model
    note = ""
    if model.attention_mask == AttentionMask.DOCUMENT:
        note = (
            "document lengths from the prepared data"
            if documents
            else "the data is not prepared yet: every window counted as one document (run llmforge data prepare for the saving)"
        )
    windowed = _windowed_layers(model)
    if windowed:
        note = "; ".join(x for x in (note, f"sliding window of {model.sliding_window} on {windowed} of {model.num_layers} layers") if x)
    fraction = mask_fraction(model, streams=documents or None)
    return AttentionCost(
        mask=model.attention_mask,
        sliding_window=model.sliding_window,
        windowed_layers=windowed,
        fraction=fraction,
        note=note or "causal: every earlier token of the window",
    )
