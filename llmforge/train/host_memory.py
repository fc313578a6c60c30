"""Keep the host allocator's freed memory for reuse, so a CPU step does not page-fault.

glibc returns a freed block of more than its mmap threshold (128 KiB, adapting up to
32 MiB) to the operating system, and trims the top of its heap past twice that: the
next step's logits, activations and gradients of the same sizes then come back as
fresh pages, each one faulted in on first write. On a CPU rank that costs from nothing
to 10% of a step, depending on how earlier frees moved the adaptive thresholds (about
12,000 faults a step for the default recipe in the rounds it happens). Fixing both
thresholds at their largest keeps every block up to 32 MiB in the heap, reused from step
to step, as tcmalloc and jemalloc do by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache

#: glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: The largest mmap threshold glibc accepts on 64-bit hosts (half its 64 MiB heap size).
MMAP_THRESHOLD_MAX = 32 * 2**20
#: Freed memory at the heap's top kept rather than returned: far more than one step frees.
TRIM_THRESHOLD = 2**30


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Fix glibc's thresholds for this process (once); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
