"""A plain GPT trained as a user writes it (nanoGPT-style), for tools/bench_independent.py.

It imports nothing of llmforge: its own model (fused q/k/v, causal scaled-dot-product
attention, GELU (tanh) MLP, pre-LayerNorm, learned positions, tied embeddings), batches drawn
nanoGPT's way from a memory-mapped token file, gradient accumulation, ``clip_grad_norm_``,
``torch.optim.AdamW`` with torch's default implementation (nanoGPT asks for ``fused`` on
CUDA only) and a warm-up + cosine learning rate set by hand every step.

    python tools/plain_gpt.py --tokens FILE --dtype uint16 --steps 40 --log FILE [shape options]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, ffn), nn.Linear(ffn, width)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, *, layers: int, width: int, heads: int, ffn: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(path: str, dtype: str, *, rows: int, seq: int) -> tuple:
    data = np.memmap(path, dtype=dtype, mode="r")  # re-opened every batch, as nanoGPT does
    ix = torch.randint(len(data) - seq - 1, (rows,))
    x = torch.stack([torch.from_numpy(data[i : i + seq].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + seq].astype(np.int64)) for i in ix.tolist()])
    return x, y


def get_lr(step: int, *, lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    ratio = (step - warmup) / max(1, steps - warmup)
    return 0.1 * lr + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * lr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", required=True)
    p.add_argument("--dtype", default="uint16")
    p.add_argument("--steps", type=int, required=True)
    for name, default in (
        ("layers", 4),
        ("width", 128),
        ("heads", 4),
        ("ffn", 512),
        ("vocab", 4096),
        ("seq", 128),
        ("micro-batch", 4),
        ("global-batch", 16),
        ("warmup", 20),
        ("seed", 1234),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log", required=True, help="file the loss of every step is appended to")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    model = GPT(layers=a.layers, width=a.width, heads=a.heads, ffn=a.ffn, vocab=a.vocab, seq=a.seq)
    params = [q for q in model.parameters() if q.requires_grad]
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95))
    accumulation = a.global_batch // a.micro_batch
    for step in range(a.steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, lr=a.lr, warmup=a.warmup, steps=a.steps)
        for _ in range(accumulation):
            x, y = get_batch(a.tokens, a.dtype, rows=a.micro_batch, seq=a.seq)
            loss = model(x, y) / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with open(a.log, "a") as log:
            log.write(f"step {step + 1}: loss {loss.item() * accumulation:.4f}\n")


if __name__ == "__main__":
    main()
