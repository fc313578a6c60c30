"""Balanced MoE routing: a fixed, perfectly balanced choice of experts (``balanced_routing()``).

Under it assignment ``a = token x top_k + choice`` goes to expert ``a mod num_experts``, so
every expert gets the same share of the assignments (``tokens x top_k / num_experts``, the
load the estimator assumes), at most ``capacity`` of them in token order (expert e's n-th
assignment is ``e + n E``: kept while n < capacity). The combine weights stay the router's
probabilities of those experts, so the router still gets its gradients. Every shape and
index follows from the token count alone, so fake tensors (no values) can run an MoE layer:
``llmforge estimate --rehearse`` runs under it. It is not a training setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ACTIVE = False


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Route every MoE layer's tokens to the experts in the balanced pattern while inside."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, True
    try:
        yield
    finally:
        _ACTIVE = before


def active() -> bool:
    return _ACTIVE


def counts(*, tokens: int, top_k: int, num_experts: int, capacity: int | None) -> list[int]:
    """Assignments each expert keeps."""
    total = tokens * top_k
    out = [total // num_experts + (1 if e < total % num_experts else 0) for e in range(num_experts)]
    return out if capacity is None else [min(c, capacity) for c in out]


def experts(tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """[tokens, top_k] expert ids."""
    return (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)


def keep(tokens: int, top_k: int, num_experts: int, capacity: int | None, device: torch.device) -> torch.Tensor:
    """[tokens, top_k] mask of the assignments within their expert's capacity."""
    limit = capacity if capacity is not None else tokens * top_k
    return (torch.arange(tokens * top_k, device=device) // num_experts < limit).view(tokens, top_k)


def assignments(*, tokens: int, top_k: int, num_experts: int, capacity: int | None, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The kept assignments (``token x top_k + choice``) sorted by expert, and each expert's count."""
    kept = counts(tokens=tokens, top_k=top_k, num_experts=num_experts, capacity=capacity)
    order = torch.cat([torch.arange(e, tokens * top_k, num_experts, device=device)[:n] for e, n in enumerate(kept)])
    return order, kept
