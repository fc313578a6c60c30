"""Profiling: torch.profiler traces of a step range, CUDA memory snapshots, and the
out-of-memory report that names the snapshot.

Traces are Chrome trace JSON (``*.pt.trace.json``, one per rank) that Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin open. Memory
snapshots are the pickles https://pytorch.org/memory_viz reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from llmforge.config.choices import MemorySnapshot
from llmforge.config.train_rules import parse_steps
from llmforge.errors import UserError, fail

#: Allocation events kept by ``train.memory_snapshot=profile`` (the oldest are dropped).
MAX_ENTRIES = 100_000


class StepProfiler:
    """torch.profiler over steps ``first..last`` (1-based, as logged): one step of warm-up
    before them when there is one, then the trace written when ``last`` ends."""

    def __init__(
        self, *, steps: str, start_step: int, out_dir: Path, rank: int, cuda: bool, on_written: Callable[[Path], None] = lambda path: None
    ) -> None:
        first, last = parse_steps(steps)
        self.last = last
        self.path = out_dir / f"rank{rank}.steps{first}-{last}.pt.trace.json"
        self._on_written = on_written
        self._prof: torch.profiler.profile | None = None
        first = max(first, start_step + 1)
        if last < first:
            return  # a resume past the range
        wait = first - 1 - start_step
        warmup = min(1, wait)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait - warmup, warmup=warmup, active=last - first + 1, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,
            profile_memory=True,
        )
        self._prof.start()

    def _export(self, prof: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self._on_written(self.path)

    def step(self, step: int) -> None:
        """Call after every optimizer step."""
        if self._prof is None:
            return
        self._prof.step()
        if step >= self.last:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()


class MemorySnapshots:
    """CUDA allocator history for memory snapshots: ``oom`` records the live allocations
    (with Python stacks) so an out-of-memory error can be explained; ``profile``
    records every allocation and free. Nothing happens off CUDA or with ``off``."""

    def __init__(self, *, mode: str, device: torch.device, out_dir: Path, rank: int) -> None:
        self.active = device.type == "cuda" and mode != MemorySnapshot.OFF
        self.out_dir, self.rank = out_dir, rank
        if self.active:
            everything = mode == MemorySnapshot.PROFILE
            torch.cuda.memory._record_memory_history(
                enabled="all" if everything else "state",
                context="all" if everything else "alloc",
                stacks="python",
                max_entries=MAX_ENTRIES,
                device=device,
            )

    def dump(self, name: str) -> Path | None:
        """Write the snapshot as ``out_dir/<name>_rank<R>.pickle``; None when not recording."""
        if not self.active:
            return None
        path = self.out_dir / f"{name}_rank{self.rank}.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def close(self) -> None:
        if self.active:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.active = False


def out_of_memory_error(exc: BaseException, *, rank: int, step: int, snapshot: Path | None, plan_path: Path) -> UserError:
    """The message an out-of-memory error ends in: where, the snapshot, and how to size the plan."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = (
        f"memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)"
        if snapshot
        else "no memory snapshot (train.memory_snapshot=off)"
    )
    return fail(
        f"rank {rank} ran out of GPU memory in step {step}: {first_line}\n  {where}\n"
        f"  what the plan needs per device: llmforge estimate --plan {plan_path}\n"
        "  to fit: lower train.micro_batch_size, set parallel.recompute=selective or full, or shard more "
        "(parallel.zero=3, parallel.tp, parallel.pp)",
        title="out of memory",
    )
