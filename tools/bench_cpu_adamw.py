"""The CPU optimizer step of offloaded training (parallel.offload=states), side by side in one run.

    python tools/bench_cpu_adamw.py [--mparams 16] [--tensors 64] [--repeat 5]

AdamW over fp32 parameters in host memory, as torch runs it with ``fused=True`` (what
llmforge uses for offloaded states), ``foreach=True`` and the per-parameter for-loop (what
a user gets from ``torch.optim.AdamW`` on CPU tensors by default), and a copy of the same
bytes (``torch.Tensor.copy_``, the host memory bandwidth this machine reaches). Prints
parameters per second and effective bytes per second of each (an AdamW step moves 28 bytes
per parameter: reads weight, gradient and two moments, writes weight and moments), their
ratio to the for-loop, and the share of the copy bandwidth the fused step reaches (the
estimator's ``HOST_ADAM_EFFICIENCY``, llmforge.estimate.offload).
"""

from __future__ import annotations

import argparse
import time

import torch

ADAM_BYTES = 28


def params_of(total: int, tensors: int) -> list:
    size = total // tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(size)
    return params


def time_step(kind: str, *, total: int, tensors: int, repeat: int) -> float:
    params = params_of(total, tensors)
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    opt = torch.optim.AdamW(params, lr=1e-3, **options)
    opt.step()  # allocates the moments
    start = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    return (time.perf_counter() - start) / repeat


def copy_bandwidth(*, total: int, repeat: int) -> float:
    """Bytes/s of a plain copy (read + write) of ``total`` fp32 elements."""
    src, dst = torch.randn(total), torch.empty(total)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    return 8 * total * repeat / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mparams", type=float, default=16.0, help="millions of parameters")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    total = int(args.mparams * 1e6)
    print(
        f"AdamW on {total / 1e6:.0f}M fp32 parameters in {args.tensors} tensors, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}"
    )
    bandwidth = copy_bandwidth(total=total, repeat=args.repeat)
    print(f"copy            {bandwidth / 1e9:7.2f} GB/s (host memory bandwidth reached)")
    times = {kind: time_step(kind, total=total, tensors=args.tensors, repeat=args.repeat) for kind in ("for-loop", "foreach", "fused")}
    for kind, seconds in times.items():
        rate = ADAM_BYTES * total / seconds
        print(
            f"{kind:<15} {seconds * 1e3:8.1f} ms/step  {total / seconds / 1e6:8.1f} Mparams/s  {rate / 1e9:6.2f} GB/s  "
            f"{times['for-loop'] / seconds:5.2f}x the for-loop  {rate / bandwidth:5.0%} of the copy bandwidth"
        )


if __name__ == "__main__":
    main()
