"""The chunked cross-entropy: F.cross_entropy's numbers without fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import llmforge.train.loss as loss_module
from llmforge.train.loss import cross_entropy


class LargestFloat32(TorchDispatchMode):
    """The element count of the largest fp32 tensor any op produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_and_gradient_equal_cross_entropy_on_fp32_logits(dtype, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 97 * 16)  # 16 tokens per chunk: 10 chunks, the last partial
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 50, 97, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 97, (3, 50), generator=gen)
    got = cross_entropy(logits, targets)
    (2.5 * got).backward()
    grad, logits.grad = logits.grad, None
    want = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    (2.5 * want).backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-8)


def test_bf16_logits_are_never_copied_to_fp32_whole(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 128 * 8)
    logits = torch.randn(4, 32, 128).bfloat16().requires_grad_()
    targets = torch.randint(0, 128, (4, 32))
    with LargestFloat32() as seen:
        cross_entropy(logits, targets).backward()
    assert 0 < seen.largest <= 8 * 128 * 2  # a chunk (and its CPU conversion), never the 128 x 128 logits
    with LargestFloat32() as plain:
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    assert plain.largest == 4 * 32 * 128
