"""Next-token cross-entropy that never materialises the logits in fp32.

``F.cross_entropy(logits.float(), targets)`` on bf16 logits of
``[tokens, vocab]`` keeps an fp32 copy of the logits, their fp32
log-probabilities for backward and an fp32 gradient: 12 bytes per logit besides
the logits themselves (7.7 GiB for 16k tokens of a 50k vocabulary). Here the
logits are read in chunks of tokens: forward takes each chunk's fp32
log-softmax, keeps only the target's log-probability, and saves the logits as
they are (bf16 under autocast); backward recomputes each chunk's softmax in fp32
and writes its gradient straight into the logits' dtype. The arithmetic is
that of ``F.cross_entropy`` on fp32 logits (fp32 softmax, mean over tokens);
only its order of summation differs. fp32 logits that fit in one chunk go to
``F.cross_entropy`` itself: the same arithmetic and the same bytes kept for
backward (the fp32 log-probabilities instead of the fp32 logits), without the
second softmax in backward.

Under tensor parallelism the logits are vocabulary-sharded DTensors and the
loss is ``loss_parallel``'s (``llmforge.parallel.tensor.sharded_cross_entropy``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**26  # logits per chunk: 256 MiB of fp32 temporaries


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``."""
    return max(1, CHUNK_ELEMENTS // vocab)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = chunk_rows(logits.shape[-1])
        dtype = torch.promote_types(logits.dtype, torch.float32)
        total = torch.zeros((), dtype=dtype, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                chunk, target = logits[start : start + rows], targets[start : start + rows, None]
                logp = torch.log_softmax(chunk, dim=-1, dtype=dtype)
                total -= logp.gather(1, target).sum()
        ctx.save_for_backward(logits, targets)
        return total / logits.shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        rows = chunk_rows(logits.shape[-1])
        dtype = torch.promote_types(logits.dtype, torch.float32)
        scale = (grad / logits.shape[0]).to(dtype)
        out = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                chunk, target = logits[start : start + rows], targets[start : start + rows, None]
                p = torch.softmax(chunk, dim=-1, dtype=dtype)
                p.scatter_add_(1, target, torch.full_like(target, -1, dtype=p.dtype))
                torch.mul(p, scale, out=out[start : start + rows])
        return out, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``logits [b, s, vocab]`` against ``targets [b, s]``,
    in fp32 whatever the logits' dtype."""
    logits, targets = logits.flatten(0, 1), targets.flatten(0, 1)
    if logits.dtype == torch.float32 and logits.numel() <= CHUNK_ELEMENTS:
        return F.cross_entropy(logits, targets)
    return _ChunkedCrossEntropy.apply(logits, targets)
