"""The estimate next to torchtitan's published Llama 3.1 H100 runs, as tests/test_estimate_published.py holds it.

    python tools/published_runs.py

Prints, per row: llmforge's estimate (tokens/s per GPU), the same with torchtitan's recompute
policy and loss added, the published figure (and the one held, without async TP), their
ratio, and the estimated against the published memory; then the responses (compile, Float8,
schedule, 128 vs 8 GPUs), estimated against published.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_estimate_published as published  # noqa: E402


def main() -> None:
    print(f"{'row':28s} {'estimate':>9s} {'+theirs':>8s} {'published':>9s} {'held':>6s} {'ratio':>6s} {'GiB est':>8s} {'GiB pub':>8s}")
    for name, row in published.ROWS.items():
        est, tokens = published.per_gpu(row)
        held = row.tokens_per_s_per_gpu / (published.ASYNC_TP_GAIN if row.async_tp else 1.0)
        print(f"{name:28s} {est.tokens_per_s / row.layout.world:9,.0f} {tokens:8,.0f} {row.tokens_per_s_per_gpu:9,.0f} "
              f"{held:6,.0f} {tokens / held:6.3f} {est.worst.total / 2**30:8.1f} {row.memory_gib:8.1f}")
    pairs = [("8B 8 GPUs compile", "8B 8 GPUs"), ("8B 8 GPUs compile float8", "8B 8 GPUs compile"),
             ("405B 512 GPUs interleaved", "405B 512 GPUs 1F1B"), ("8B 128 GPUs", "8B 8 GPUs"), ("8B 128 GPUs compile", "8B 8 GPUs compile")]
    for faster, slower in pairs:
        estimated, reported = published.ratio(faster, slower)
        print(f"{faster} / {slower}: estimate {estimated:.3f}, published {reported:.3f}")


if __name__ == "__main__":
    main()
