"""On a GPU: the rehearsed peak (fake CPU tensors) of a one-GPU plan against the same program's
real peak on the GPU (``torch.cuda.max_memory_allocated`` during the second step).

    python tools/rehearse_vs_gpu.py [OVERRIDES]   # prints one JSON object
"""

from __future__ import annotations

import json
import os
import sys

import torch

DEFAULT = [
    "recipe=llama-8b",
    "model.num_layers=4",
    "cluster.nodes=1",
    "cluster.devices_per_node=1",
    "cluster.launcher=torchrun",
    "parallel=fsdp",
    "parallel.recompute=selective",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "model.seq_len=4096",
]


def real_gpu_peak(plan) -> dict:
    import torch.distributed as dist

    from llmforge.rehearse.fake import FakeBatches
    from llmforge.rehearse.run import _one_step
    from llmforge.rehearse.tracker import PeakTracker
    from llmforge.train.build import build_components, distributed_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rank = distributed_rank(plan, device=device)
    cfg = plan.config
    batches = FakeBatches(global_batch=cfg.train.global_batch_size, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    c = build_components(plan, rank=rank, sampler=_OnDevice(batches))
    out = {}
    for step in (1, 2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with PeakTracker(modules=c.model_parts, optimizer=c.optimizer) as t:
            _one_step(c, tracker=t, grad_clip=cfg.optim.grad_clip)
        torch.cuda.synchronize()
        out[f"step{step}"] = {
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "tracker_peak": t.peak_bytes,
            "tracker_categories": t.peak_by_category(),
        }
    dist.destroy_process_group()
    return out


class _OnDevice:
    def __init__(self, batches) -> None:
        self.batches, self.eos_id = batches, None

    def next_batch(self, *, dp_rank: int, dp_size: int) -> torch.Tensor:
        return self.batches.next_batch(dp_rank=dp_rank, dp_size=dp_size)


def main(argv) -> None:
    from llmforge.commands.plans import build_plan
    from llmforge.estimate.core import estimate_plan
    from llmforge.rehearse.run import rehearse

    plan = build_plan(argv or DEFAULT)
    est = estimate_plan(plan)
    r = rehearse(plan, stage=est.worst.stage)
    result = {
        "overrides": argv or DEFAULT,
        "rehearsed": {
            "step_peak_bytes": r.step_peak_bytes,
            "first_step_peak_bytes": r.first_step_peak_bytes,
            "categories": r.categories,
            "seconds": r.seconds,
        },
        "estimate_tensor_bytes": sum(getattr(est.worst, k) for k in ("weights", "grads", "optimizer", "activations", "transient")),
    }
    if torch.cuda.is_available():
        result["gpu"] = real_gpu_peak(plan)
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
