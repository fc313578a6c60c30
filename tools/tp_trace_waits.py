"""Where a tensor-parallel step's gloo collectives spend their time, from two ranks' traces.

    llmforge pretrain parallel=tp2 cluster.devices_per_node=2 train.steps=16 train.profile=11-13 run.dir=RUN ...
    python tools/tp_trace_waits.py RUN/profile/rank0.steps11-13.pt.trace.json RUN/profile/rank1.steps11-13.pt.trace.json

Both ranks run on one host, so their traces share a clock. The k-th ``gloo:all_reduce`` of one
rank is the k-th of the other: for each, the time one rank waited for the other to enter, and the
time from the later entry to the end (the transfer, and whatever kept a woken rank from a core).
It also sums each rank's main-thread ``wait_tensor`` (what the step waits on its collectives).
Compare the per-collective figures with the profile's ``comm_latency_us`` (times the hops) and
``comm_sync_share`` (``llmforge.estimate.host``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

COLLECTIVE = "gloo:all_reduce"
WAIT = "_c10d_functional::wait_tensor"


def _events(path: Path) -> tuple[list[dict], int]:
    trace = json.loads(path.read_text())
    base = int(trace.get("baseTimeNanoseconds", 0)) // 1000
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sum(1 for e in events if str(e["name"]).startswith("ProfilerStep#"))
    return [{**e, "ts": e["ts"] + base} for e in events], max(1, steps)


def _line(name: str, values_us: list[float], steps: int) -> str:
    return (
        f"{name:34s} mean {statistics.mean(values_us):7.0f} us  median {statistics.median(values_us):7.0f} us  "
        f"per step {sum(values_us) / steps / 1e3:7.1f} ms"
    )


def main(paths: list[str]) -> None:
    (r0, steps), (r1, _) = (_events(Path(p)) for p in paths)
    c0, c1 = ([e for e in r if e["name"] == COLLECTIVE] for r in (r0, r1))
    c0.sort(key=lambda e: e["ts"])
    c1.sort(key=lambda e: e["ts"])
    print(f"{len(c0)} and {len(c1)} {COLLECTIVE} over {steps} steps ({len(c0) / steps:.0f} a step)")
    for rank, calls in ((0, c0), (1, c1)):
        print(_line(f"rank {rank}: inside each collective", [e["dur"] for e in calls], steps))
    waits0, waits1, after = [], [], []
    for a, b in zip(c0, c1, strict=False):
        entered = max(a["ts"], b["ts"])
        waits0.append(entered - a["ts"])
        waits1.append(entered - b["ts"])
        after.append(max(a["ts"] + a["dur"], b["ts"] + b["dur"]) - entered)
    print(_line("rank 0: waiting for rank 1 to enter", waits0, steps))
    print(_line("rank 1: waiting for rank 0 to enter", waits1, steps))
    print(_line("after both entered", after, steps))
    for rank, events in ((0, r0), (1, r1)):
        print(_line(f"rank {rank}: main thread {WAIT}", [e["dur"] for e in events if e["name"] == WAIT], steps))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
