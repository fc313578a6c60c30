"""Held-out loss of post-training quantization against quantization-aware training.

Takes two finished runs of the same recipe: a plain one, and one trained with
``precision.qat`` (switched on for the last part with ``precision.qat_start_step``). Both
final checkpoints are quantized the same way (the QAT run's scheme and group size, through
``llmforge.checkpoint.quantized``, the code ``llmforge export --quantize`` runs), and every
model is scored on the same held-out batches (the first ``train.eval_steps`` global batches
of the plain run's validation split, what its closing val_loss reads; ``--batches N`` for more).

    llmforge pretrain run.dir=runs/plain
    llmforge pretrain precision.qat=int8-int4 precision.qat_start_step=241 run.dir=runs/qat
    python tools/qat_vs_ptq.py --plain runs/plain --qat runs/qat

Prints the plain run's unquantized loss, its post-training-quantized loss and the QAT
run's quantized loss side by side (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def held_out_batches(plan, *, count: int) -> tuple[list[torch.Tensor], int]:
    """The first ``count`` global batches of the run's validation split, and the sequences the split holds."""
    from rich.console import Console

    from llmforge.train.run import make_sampler, prepare_data

    prepared = prepare_data(plan, console=Console(stderr=True, quiet=True))
    sampler = make_sampler(plan, prepared, split="val")
    return [sampler.next_batch(dp_rank=0, dp_size=1) for _ in range(count)], sum(sampler.num_sequences)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy over the batches (each batch's mean, averaged, as validation does)."""
    total = 0.0
    for batch in batches:
        logits = model(batch[:, :-1])
        total += float(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()))
    return total / len(batches)


def final_model(run: str, *, scheme: str, group_size: int):
    """(plan, whole model, quantized model) of a run's newest checkpoint."""
    from llmforge.checkpoint.export import read_model_weights
    from llmforge.checkpoint.locate import locate
    from llmforge.checkpoint.quantized import quantized_model
    from llmforge.checkpoint.resume import checkpoint_plan
    from llmforge.models.fused import fuse_saved
    from llmforge.models.gpt import GPT

    found = locate(run)
    plan = checkpoint_plan(found.path)
    weights = fuse_saved(read_model_weights(found.path), plan.config.model)
    if plan.config.model.tie_embeddings:
        weights.pop("head.weight", None)
    plain = GPT(plan.config.model)
    plain.load_state_dict(weights, strict=True)
    quantized, _ = quantized_model(dict(weights), model=plan.config.model, scheme=scheme, group_size=group_size)
    return plan, found, plain.eval(), quantized


def compare(*, plain_run: str, qat_run: str, batches: int = 0) -> dict[str, object]:
    """The three held-out losses; ``batches`` global batches of the validation split (0: the plain run's train.eval_steps)."""
    from llmforge.checkpoint.locate import locate
    from llmforge.checkpoint.resume import checkpoint_plan

    qat_plan = checkpoint_plan(locate(qat_run).path)
    pr = qat_plan.config.precision
    if pr.qat == "none":
        raise SystemExit(f"{qat_run}: trained without precision.qat; pass the QAT run as --qat")
    plan, found, plain, ptq = final_model(plain_run, scheme=pr.qat, group_size=pr.qat_group_size)
    _, qat_found, _, qat = final_model(qat_run, scheme=pr.qat, group_size=pr.qat_group_size)
    held_out, in_split = held_out_batches(plan, count=batches or plan.config.train.eval_steps)
    return {
        "scheme": pr.qat,
        "group_size": pr.qat_group_size,
        "qat_start_step": pr.qat_start_step,
        "steps": qat_plan.config.train.steps,
        "plain_checkpoint": str(found.path),
        "qat_checkpoint": str(qat_found.path),
        "held_out_tokens": sum(b[:, 1:].numel() for b in held_out),
        "held_out_sequences": sum(len(b) for b in held_out),
        "sequences_in_split": in_split,
        "unquantized": mean_loss(plain, held_out),
        "ptq": mean_loss(ptq, held_out),
        "qat": mean_loss(qat, held_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plain", required=True, help="the plain run (folder or checkpoint)")
    parser.add_argument("--qat", required=True, help="the same run trained with precision.qat (folder or checkpoint)")
    parser.add_argument(
        "--batches",
        type=int,
        default=0,
        help="global batches of the validation split to score (default: train.eval_steps, what the run's val_loss reads)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = compare(plain_run=args.plain, qat_run=args.qat, batches=args.batches)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"held-out loss ({result['held_out_sequences']} sequences, {result['held_out_tokens']:,} tokens; the split holds "
        f"{result['sequences_in_split']} sequences), {result['scheme']} group size {result['group_size']}, "
        f"QAT from step {result['qat_start_step']} of {result['steps']}:"
    )
    print(f"{'unquantized (plain run)':<34}{'PTQ (plain run, quantized)':<34}{'QAT (QAT run, quantized)':<34}")
    row = [result["unquantized"], result["ptq"], result["qat"]]
    print("".join(f"{v:<34.4f}" for v in row))
    print("".join(f"{'ppl ' + format(math.exp(v), '.1f'):<34}" for v in row))


if __name__ == "__main__":
    main()
