"""How a rank that finished ends: with its gloo threads never running into a finalizing interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A one-rank gloo group whose subgroup something still holds after destroy_process_group (as
# DTensor's caches hold a device mesh's groups), an exit handler, a worker thread, and an object
# that reports when the interpreter finalizes and clears module globals.
PROGRAM = textwrap.dedent(
    """
    import atexit, os, sys, threading, time
    import torch
    import torch.distributed as dist
    from llmforge.processes.rank_errors import end_rank

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)

    class Finalized:
        def __del__(self, write=sys.stdout.write):
            write("finalized\\n")

    FINALIZED = Finalized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    HELD = dist.new_group([0])
    dist.all_reduce(torch.ones(4), group=HELD)
    dist.destroy_process_group()
    print("gloo threads after destroy:", gloo_threads(), flush=True)
    atexit.register(print, "exit handler ran")
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
    end_rank()
    print("after end_rank")
    """
)


def test_a_finished_rank_ends_without_finalizing_while_gloo_threads_live() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    # the premise: a held group keeps its gloo threads past destroy_process_group
    assert int(lines[0].rpartition(":")[2]) > 0, proc.stdout
    assert lines[1:] == ["thread finished", "exit handler ran"], proc.stdout
