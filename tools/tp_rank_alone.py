"""One tensor-parallel rank's step with no communication: the recipe's model sharded over torch's
fake process group of ``--tp`` ranks (its collectives return at once), in this one process, one
thread, against the unsharded model. What it takes is the rank's compute and DTensor host time,
which the estimate counts as its kernels plus ``tp_host``; a real run's step less this is what its
collectives and their waits cost.

    OMP_NUM_THREADS=1 python tools/tp_rank_alone.py [--tp 2] [--steps 24] [overrides...]

Early steps are slower (warm-up): read the steady ones at the end.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmforge.calibrate.tp_step import stepper
from llmforge.config.compose import compose


def _stepper(config, *, tp: int):
    micro = config.train.micro_batch_size
    group = dist.group.WORLD if tp > 1 else None
    return stepper(config.model, micro_batch=micro, microbatches=config.train.global_batch_size // micro, group=group)


def _times(step, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    config = compose(["recipe=tiny", "logging=quiet", *overrides])
    plain = _times(_stepper(config, tp=1), args.steps)
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    try:
        sharded = _times(_stepper(config, tp=args.tp), args.steps)
    finally:
        dist.destroy_process_group()
    for name, seconds in (("unsharded", plain), (f"tp{args.tp} rank alone", sharded)):
        steady = sorted(seconds[len(seconds) // 2 :])
        print(f"{name}: steps {[round(s, 3) for s in seconds]} s; steady median {steady[len(steady) // 2]:.3f} s")


if __name__ == "__main__":
    main()
