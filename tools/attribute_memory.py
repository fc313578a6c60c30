"""Where rank 0 of a ZeRO-3 CPU run peaks: its tensors by kind (torch's FSDP memory tracker)
and its resident memory (RSS) over the step, in one process that stands for rank 0 of ``--dp``
ranks (torch's fake process group: the same allocations as the real rank, no other rank, no
gloo buffers; collectives move nothing, so the values are not the real run's).

    python tools/attribute_memory.py [--dp 8] [--layers 20] [--hidden 1024] [--steps 3]

The plan is ``tools/bench_build.py``'s large run. Prints, for the last step: the tracked
peak by FSDP2 reference type (sharded/unsharded parameters and gradients, all-gather and
reduce-scatter buffers, activations, temporaries, optimizer states), the modules whose
forward or backward peaked highest, and RSS: before the build, after it, and each step's peak.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import threading
import time
import warnings

import torch

GIB = 1024**3
MIB = 1024**2


class RssSampler:
    """The process's resident memory, sampled every ``interval`` seconds from /proc."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_words() -> str:
    """glibc's own account (mallinfo2): heap obtained, in use and free, and mmapped blocks."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return ""
    return (
        f"glibc heap {m.arena / GIB:.3f} GiB (in use {m.uordblks / GIB:.3f}, free {m.fordblks / GIB:.3f}), "
        f"mmapped {m.hblkhd / GIB:.3f} GiB in {m.hblks} blocks"
    )


def plan_of(args) -> object:
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    common = [
        "parallel=fsdp",
        f"parallel.dp={args.dp}",
        "parallel.zero=3",
        "train.micro_batch_size=1",
        f"train.global_batch_size={args.dp}",
        "checkpoint.interval=1000000",
        "model.seq_len=128",
        "train.eval_interval=0",
        "data.val_fraction=0",
        "logging.wandb.mode=disabled",
    ]
    big = [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.num_heads={args.hidden // 64}",
        f"model.ffn_hidden_size={4 * args.hidden}",
    ]
    return RunPlan.build(compose(common + (big if args.layers else [])))


def one_step(c) -> None:
    """The loop's step, as the rehearsal runs it (``llmforge.rehearse.run._one_step``) without the guard."""
    from llmforge.train.loop import _unscale_and_clip

    out = c.step(c.sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size))
    flags = c.guard.local_flags(out.loss)
    _unscale_and_clip(c, 1.0, flags=flags)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def tracked_step(c, *, track: bool):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if not track:
        with RssSampler() as rss:
            one_step(c)
        return None, rss
    tracker = FSDPMemTracker(c.model_parts[0], c.optimizer)
    with tracker, RssSampler() as rss:
        one_step(c)
    return tracker, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=20, help="0: the tiny run's model")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's thresholds as they are (no keep_freed_memory)")
    parser.add_argument("--rss-only", action="store_true", help="no tensor tracker: RSS and step time only")
    parser.add_argument("--mmap-threshold", type=int, default=0, help="fix glibc's mmap threshold at this many bytes instead")
    args = parser.parse_args()
    if args.glibc_default or args.mmap_threshold:
        import llmforge.train.build as build_module

        build_module.keep_freed_memory = lambda threshold: False
        if args.mmap_threshold:
            from llmforge.processes import host_memory

            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(host_memory.M_MMAP_THRESHOLD, args.mmap_threshold)
            libc.mallopt(host_memory.M_TRIM_THRESHOLD, 2 * args.mmap_threshold)
    from llmforge.rehearse.fake import FakeBatches, fake_process_group
    from llmforge.train.build import build_components, distributed_rank

    plan = plan_of(args)
    cfg = plan.config
    sampler = RssSampler()
    rss_start = sampler.now()
    with fake_process_group(rank=0, world_size=args.dp), warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        rank = distributed_rank(plan, device=torch.device("cpu"))
        batches = FakeBatches(global_batch=cfg.train.global_batch_size, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
        with RssSampler() as build:
            c = build_components(plan, rank=rank, sampler=batches)
        print(f"RSS: start {rss_start / GIB:.3f} GiB, build peak {build.peak / GIB:.3f}, after build {sampler.now() / GIB:.3f}")
        for step in range(1, args.steps + 1):
            start, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            tracker, rss = tracked_step(c, track=not args.rss_only)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            print(
                f"step {step} ({time.perf_counter() - start:.1f} s, {faults} page faults): RSS peak {rss.peak / GIB:.3f} GiB, after "
                f"{sampler.now() / GIB:.3f} GiB; {heap_words()}"
            )
        if tracker is None:
            return
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        print(
            "tracked tensors at the last step's peak (MiB): "
            + ", ".join(f"{getattr(k, 'value', k)} {v / MIB:.1f}" for k, v in peak.items() if v)
        )
        print_modules(tracker)


def _mib(snapshot: dict) -> str:
    return ", ".join(f"{getattr(k, 'value', k)} {v / MIB:.0f}" for k, v in snapshot.items() if v >= MIB / 2)


def print_modules(tracker) -> None:
    """Each module's peak in forward and in backward (MiB, by reference type), modules of depth <= 2."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState

    for stats in tracker.memory_tracking.values():
        if stats.mod_fqn.count(".") > 2:
            continue
        for state in (_FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW):
            snaps = stats.snapshots.get(state)
            if snaps:
                snap = max(snaps, key=lambda s: s[torch.device("cpu")]["Total"])[torch.device("cpu")]
                print(f"  {stats.mod_fqn:<24} {state.value:<14} {_mib(snap)}")


if __name__ == "__main__":
    main()
