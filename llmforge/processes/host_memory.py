"""Keep the host allocator's freed memory for reuse, so a CPU step does not page-fault, and
map whole weights and gradients on their own, so they do not fragment it.

glibc returns a freed block of more than its mmap threshold (128 KiB, adapting up to
32 MiB) to the operating system, and trims the top of its heap past twice that: the
next step's logits, activations and gradients of the same sizes then come back as
fresh pages, each one faulted in on first write. On a CPU rank that costs from nothing
to 10% of a step, depending on how earlier frees moved the adaptive thresholds (about
12,000 faults a step for the default recipe in the rounds it happens). Fixing both
thresholds keeps every block up to the mmap threshold in the heap, reused from step
to step, as tcmalloc and jemalloc do by default.

The mmap threshold is the smallest power of two above the step's largest activation
(``llmforge.estimate.cpu_memory.heap_mmap_threshold``), at most 32 MiB. Larger blocks are a big
model's whole weights and gradients: under ZeRO-3 a block's are gathered and freed in every
forward and backward while the activations stay, and in the heap the activations split the
space they leave: measured on rank 0 of a 225M-parameter model at dp8 ZeRO-3
(``tools/attribute_memory.py``), the heap grew to 1.5 GiB around 0.45 GiB of live blocks with a
32 MiB threshold, and to 0.6 GiB with 4 MiB, for twice the page faults (mapped blocks are
faulted in afresh).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache

#: glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Freed memory at the heap's top kept rather than returned: far more than one step frees.
TRIM_THRESHOLD = 2**30


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the operating system (glibc's ``malloc_trim``); False
    where none went back or the C library is not glibc. A CPU rank calls it before its build
    (``llmforge.train.run.start_host_peak``): what the process freed before, such as the first
    CPU run's calibration in the launcher's own process (about 0.27 GiB of freed matmul
    buffers), would otherwise stay resident through the run."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@lru_cache(maxsize=1)
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory(threshold: int) -> bool:
    """Fix glibc's thresholds for this process (mmap at ``threshold``); False where the C library
    is not glibc. Set on every call: the thresholds are the process's, and a process that builds
    several plans (the test harness, a rehearsal) must get each plan's."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
