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


def _dynamo_traced(monkeypatch) -> None:
    """The compiled kernels traced by dynamo as whole graphs (a break fails), run without Inductor."""
    kernels = (loss_module._lse_and_target, loss_module._grad_fused)
    monkeypatch.setattr(loss_module, "_compiled", lambda: tuple(torch.compile(k, backend="eager", fullgraph=True) for k in kernels))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_matches_an_fp64_reference_with_ignored_targets(dtype, compiled, monkeypatch):
    """fp32 logits to fp32 accuracy; bf16 logits to fp32 accuracy in the loss and to bf16 rounding in
    the gradient (written in bf16); ignored targets count for nothing, as in F.cross_entropy."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 97 * 16)  # eager: 10 chunks, the last partial
    if compiled:
        _dynamo_traced(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, 50, 97, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 97, (3, 50), generator=gen)
    targets[0, :7] = loss_module.IGNORE_INDEX
    got = cross_entropy(logits, targets, compiled=compiled)
    (1.5 * got).backward()
    ref = logits.detach().double().requires_grad_()
    want = F.cross_entropy(ref.flatten(0, 1), targets.flatten())
    (1.5 * want).backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0)
    assert not logits.grad[0, :7].any()
    grad_tol = {"rtol": 1e-5, "atol": 1e-9} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-7}
    torch.testing.assert_close(logits.grad.double(), ref.grad, **grad_tol)


def test_the_loss_follows_the_plans_compile_choice():
    from llmforge.testing.harness import tiny_plan
    from llmforge.train.build_step import loss_function

    assert loss_function(tiny_plan([])) is cross_entropy
    assert loss_function(tiny_plan(["train.compile=true"])) is loss_module.compiled_cross_entropy
