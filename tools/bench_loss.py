"""The cross-entropy's forward and backward time, side by side in one run.

Rows, on logits of ``[tokens, vocab]`` in ``--dtype`` (default: gpt-125m's vocabulary and
bf16, the logits autocast gives):

- ``F.cross_entropy``: ``F.cross_entropy(logits.float(), targets)``, as a plain loop writes it;
- ``three-pass chunked``: a chunked loss that keeps each chunk's fp32 log-softmax in forward
  and, in backward, recomputes the softmax, scatters the target's -1 and writes the gradient
  through a mixed-dtype multiply (the reference the fused loss replaces);
- ``fused``: ``llmforge.train.loss.cross_entropy``, eager;
- ``fused, compiled``: the same compiled (``train.compile``; compile time not counted).

Each row's time is the median of ``--repeats`` forward+backward passes after one warm-up;
the ratio column is each row's time over the ``fused`` row's. Also prints each row's
largest difference from an fp64 reference, loss and gradient.

    python tools/bench_loss.py                       # 2048 tokens x 50304, bf16, on CPU
    python tools/bench_loss.py --tokens 8192 --device cuda --no-compile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmforge.train.loss import chunk_rows, compiled_cross_entropy, cross_entropy

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _ThreePassChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows, total = chunk_rows(logits.shape[-1]), torch.zeros((), device=logits.device)
        for i in range(0, logits.shape[0], rows):
            logp = torch.log_softmax(logits[i : i + rows], dim=-1, dtype=torch.float32)
            total -= logp.gather(1, targets[i : i + rows, None]).sum()
        ctx.save_for_backward(logits, targets)
        return total / logits.shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        rows, scale, out = chunk_rows(logits.shape[-1]), (grad / logits.shape[0]).float(), torch.empty_like(logits)
        for i in range(0, logits.shape[0], rows):
            p = torch.softmax(logits[i : i + rows], dim=-1, dtype=torch.float32)
            target = targets[i : i + rows, None]
            p.scatter_add_(1, target, torch.full_like(target, -1, dtype=p.dtype))
            torch.mul(p, scale, out=out[i : i + rows])
        return out, None


def _rows(compile_too: bool) -> dict[str, Loss]:
    rows: dict[str, Loss] = {
        "F.cross_entropy": lambda x, t: F.cross_entropy(x.float(), t),
        "three-pass chunked": _ThreePassChunked.apply,
        "fused": lambda x, t: cross_entropy(x[None], t[None]),
    }
    if compile_too:
        rows["fused, compiled"] = lambda x, t: compiled_cross_entropy(x[None], t[None])
    return rows


def _once(loss_fn: Loss, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_()
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = loss_fn(x, targets)
    loss.backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.detach(), x.grad


def measure(*, tokens: int, vocab: int, dtype: torch.dtype, device: str, repeats: int, compile_too: bool) -> list[dict]:
    """One row per loss: median seconds, ratio to the fused eager loss, error against fp64."""
    gen = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(tokens, vocab, generator=gen)).to(dtype).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    ref = logits.double().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    want_loss = F.cross_entropy(ref.detach(), targets)
    out = []
    for name, fn in _rows(compile_too).items():
        _, loss, grad = _once(fn, logits, targets)  # warm-up (and compile)
        times = [_once(fn, logits, targets)[0] for _ in range(repeats)]
        out.append(
            {
                "loss": name,
                "seconds": statistics.median(times),
                "loss_error": abs(float(loss) - float(want_loss)),
                "grad_error": float((grad.double() - ref.grad).abs().max()),
            }
        )
    fused = next(r["seconds"] for r in out if r["loss"] == "fused")
    for r in out:
        r["vs_fused"] = r["seconds"] / fused
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="rows of logits (gpt-125m: 8 x 1024 per microbatch)")
    ap.add_argument("--vocab", type=int, default=50304, help="vocabulary (gpt-125m: 50304)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = measure(
        tokens=args.tokens, vocab=args.vocab, dtype=dtype, device=args.device, repeats=args.repeats, compile_too=not args.no_compile
    )
    print(f"{args.tokens} x {args.vocab} {args.dtype} logits on {args.device}, forward+backward, median of {args.repeats}")
    print(f"{'loss':<20} {'ms':>9} {'x fused':>8} {'loss err':>10} {'grad err':>10}")
    for r in rows:
        print(f"{r['loss']:<20} {1e3 * r['seconds']:>9.1f} {r['vs_fused']:>7.2f}x {r['loss_error']:>10.2e} {r['grad_error']:>10.2e}")


if __name__ == "__main__":
    main()
