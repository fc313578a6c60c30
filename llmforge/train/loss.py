"""Next-token cross-entropy that never materialises the logits in fp32.

``F.cross_entropy(logits.float(), targets)`` on bf16 logits of ``[tokens, vocab]``
keeps an fp32 copy of the logits, their fp32 log-probabilities for backward and an
fp32 gradient: 12 bytes per logit besides the logits themselves (7.7 GiB for 16k
tokens of a 50k vocabulary), in several passes over them.

Here forward reads the logits once, a chunk of tokens at a time, and keeps one fp32
number per token: its log-sum-exp (accumulated in fp32, whatever the logits' dtype).
The loss is ``lse - logit[target]``, averaged over the tokens whose target is not
``ignore_index`` (as ``F.cross_entropy``). Backward reads each chunk again and writes
the gradient ``(exp(logit - lse) - onehot(target)) * scale`` straight into the
logits' dtype. The arithmetic is that of ``F.cross_entropy`` on fp32 logits; only
the order of summation differs.

Compiled (under ``train.compile``, as torchtitan compiles its loss, and always on CUDA),
forward and backward each become one fused kernel over all tokens: no fp32 temporary of
the logits exists, so the chunks are not needed. fp32 logits that fit in one chunk go to
``F.cross_entropy`` itself, compiled or not: the same arithmetic, without the
second softmax in backward.

Under tensor parallelism the logits are vocabulary-sharded DTensors and the
loss is ``loss_parallel``'s (``llmforge.parallel.tensor.sharded_cross_entropy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**26  # logits per chunk: 256 MiB of fp32 temporaries
IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _lse_and_target(chunk: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the fp32 log-sum-exp of the logits and the fp32 logit of the target
    (an ignored target reads column 0; its row weighs nothing)."""
    x = chunk.float()
    return torch.logsumexp(x, dim=1), x.gather(1, target.clamp(min=0)[:, None]).squeeze(1)


def _lse_and_target_eager(chunk: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_lse_and_target`` op by op: one fp32 log-softmax of the chunk (a single kernel), read at the target."""
    index = target.clamp(min=0)[:, None]
    picked = chunk.gather(1, index).squeeze(1).float()
    return picked - torch.log_softmax(chunk, dim=1, dtype=torch.float32).gather(1, index).squeeze(1), picked


def _grad_eager(chunk: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = (softmax - onehot(target)) * row_scale`` in ``out``'s dtype, op by op: an fp32
    softmax of the chunk (one kernel), the target's -1, the scale, one cast (a multiply that
    also casts runs unvectorised)."""
    p = torch.softmax(chunk, dim=1, dtype=torch.float32)
    p.scatter_add_(1, target.clamp(min=0)[:, None], torch.full_like(p[:, :1], -1.0))
    if out.dtype == torch.float32:
        torch.mul(p, row_scale[:, None], out=out)
    else:
        out.copy_(p.mul_(row_scale[:, None]))


def _grad_fused(chunk: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The same gradient written as one elementwise expression: one kernel once compiled."""
    columns = torch.arange(chunk.shape[1], device=chunk.device)
    hit = (columns[None, :] == target[:, None]).float()
    return ((torch.exp(chunk.float() - lse[:, None]) - hit) * row_scale[:, None]).to(chunk.dtype)


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    """The forward and backward kernels compiled (each one graph, shapes fixed per run)."""
    return (
        torch.compile(_lse_and_target, dynamic=False, fullgraph=True),
        torch.compile(_grad_fused, dynamic=False, fullgraph=True),
    )


def _row_weights(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each token's share of the mean: 1 / (tokens counted), 0 where the target is ignored."""
    weight = (targets != ignore_index).float()
    return weight / weight.sum()


class _FusedCrossEntropy(torch.autograd.Function):
    """Saved for backward: the logits and targets as they are, and compiled the fp32
    log-sum-exp per token (op by op, backward recomputes the softmax instead)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, compiled: bool) -> torch.Tensor:  # type: ignore[override]
        rows = logits.shape[0] if compiled else chunk_rows(logits.shape[-1])
        lse_of = _compiled()[0] if compiled else _lse_and_target_eager
        with torch.autocast(logits.device.type, enabled=False):
            parts = [lse_of(logits[i : i + rows], targets[i : i + rows]) for i in range(0, logits.shape[0], rows)]
        lse = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        picked = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        ctx.save_for_backward(logits, targets, *((lse,) if compiled else ()))
        ctx.compiled, ctx.ignore_index = compiled, ignore_index
        return torch.dot(lse - picked, _row_weights(targets, ignore_index))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, targets, *lse = ctx.saved_tensors
        row_scale = _row_weights(targets, ctx.ignore_index) * grad
        with torch.autocast(logits.device.type, enabled=False):
            if ctx.compiled:
                return _compiled()[1](logits, targets, lse[0], row_scale), None, None, None
            rows, out = chunk_rows(logits.shape[-1]), torch.empty_like(logits)
            for i in range(0, logits.shape[0], rows):
                s = slice(i, i + rows)
                _grad_eager(logits[s], targets[s], row_scale[s], out[s])
        return out, None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX, compiled: bool | None = None
) -> torch.Tensor:
    """Mean next-token loss of ``logits [b, s, vocab]`` against ``targets [b, s]``, in fp32
    whatever the logits' dtype; targets equal to ``ignore_index`` count for nothing.
    ``compiled``: forward and backward run as one compiled kernel each; None (the default)
    compiles them on CUDA, where op by op they take 8x as long (14 against 1.8 ms for 16k
    tokens of a 50k vocabulary on an H200, ``docs/gpu.md``), and runs them op by op elsewhere."""
    logits, targets = logits.flatten(0, 1), targets.flatten(0, 1)
    if logits.dtype == torch.float32 and logits.numel() <= CHUNK_ELEMENTS:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return _FusedCrossEntropy.apply(logits, targets, ignore_index, logits.is_cuda if compiled is None else compiled)


#: ``cross_entropy`` as a compiled run computes it on any device (``train.compile``).
compiled_cross_entropy = functools.partial(cross_entropy, compiled=True)
