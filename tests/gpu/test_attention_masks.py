"""Document and sliding-window attention on CUDA (FlexAttention block masks, compiled)
computes what the dense boolean mask computes on the CPU: loss and every gradient."""

from __future__ import annotations

import pytest
import torch

from llmforge.models.gpt import GPT
from llmforge.models.masks import document_ids
from llmforge.testing.harness import tiny_plan
from llmforge.train.loss import cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MASKS = {
    "document": ["model.attention_mask=document", "model.position_reset=true", "model.position=rope"],
    "document_window": ["model.attention_mask=document", "model.sliding_window=24", "model.sliding_window_every=2"],
    "window": ["model.sliding_window=40", "model.num_kv_heads=2"],
}


def loss_and_grads(model: GPT, batch: torch.Tensor, *, device: str):
    model = model.to(device)
    model.zero_grad()
    batch = batch.to(device)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    documents = document_ids(inputs, eos_id=0)
    loss = cross_entropy(model(inputs, documents=documents), targets)
    loss.backward()
    return loss.item(), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MASKS))
def test_flex_on_cuda_matches_the_dense_mask_on_cpu(name):
    plan = tiny_plan(["model.seq_len=256", "model.hidden_size=64", "model.num_heads=4"] + MASKS[name])
    model = GPT(plan.config.model)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(1, 256, (2, 257), generator=gen)
    batch[torch.rand(batch.shape, generator=gen) < 0.03] = 0  # documents of about 30 tokens
    cuda_masks = model.to("cuda").attention_masks(
        positions=None, documents=document_ids(batch[:, :-1].cuda(), eos_id=0), batch=2, length=256, device=torch.device("cuda")
    )
    assert not isinstance(cuda_masks.full if cuda_masks.full is not None else cuda_masks.windowed, torch.Tensor)
    loss_cpu, grads_cpu = loss_and_grads(model, batch, device="cpu")
    loss_cuda, grads_cuda = loss_and_grads(model, batch, device="cuda")
    assert abs(loss_cuda - loss_cpu) / loss_cpu < 1e-4
    for n, g in grads_cpu.items():
        rel = float((grads_cuda[n] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-3, f"{n}: {rel:.2e}"
