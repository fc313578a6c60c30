"""What a CPU rank holds besides its tensors and the heap slack proportional to them: the code a
training step pages in, and the holes the step's largest blocks leave in a heap that keeps
everything up to its mmap threshold (``llmforge.processes.host_memory``, which takes the threshold
from ``heap_mmap_threshold``).

Measured with the tiny recipe (rank peaks over 30-40 steps; the process sampled every 2 ms):

- the resident code (``RssFile``) grows by 14-18 MiB from the first step on, on single, dp2, tp2
  and pp2 alike and on a model 50 times smaller: the kernels of the backward and the optimizer
  (``CPU_STEP_CODE_BYTES``);
- glibc's heap holds 38-62 MiB above its in-use peak (mallinfo2, threshold 16 MiB), about the
  two largest blocks the heap serves; a 225M-parameter ZeRO-3 build (threshold 4 MiB) held about
  a third of its working set above it, which the proportional slack (``CPU_HEAP_SLACK``) counts.
"""

from __future__ import annotations

from llmforge.config.schema import ModelConfig
from llmforge.estimate.shape import Shape

FP32 = 4
#: Code pages (libtorch's kernels) a CPU rank's first training steps fault in.
CPU_STEP_CODE_BYTES = 16 * 2**20
#: glibc's bounds on the mmap threshold this project sets (64-bit hosts).
MMAP_THRESHOLD_MIN, MMAP_THRESHOLD_MAX = 2**20, 32 * 2**20
#: Blocks of the threshold's size whose holes a step leaves in the heap.
HOLE_BLOCKS = 2


def heap_mmap_threshold(*, tokens: int, widest: int) -> int:
    """The smallest power of two above the largest fp32 activation of a microbatch of ``tokens``
    tokens (``widest`` its widest row: vocabulary, feed-forward or attention scores), within
    [``MMAP_THRESHOLD_MIN``, ``MMAP_THRESHOLD_MAX``]: blocks up to it stay in the heap."""
    largest = FP32 * tokens * widest
    threshold = MMAP_THRESHOLD_MIN
    while threshold <= largest and threshold < MMAP_THRESHOLD_MAX:
        threshold *= 2
    return threshold


def model_mmap_threshold(model: ModelConfig, *, micro_batch: int) -> int:
    """``heap_mmap_threshold`` of one microbatch of ``model`` (fp32, whole: an upper bound under
    tensor or context parallelism): a CPU training rank's, and the calibration's probe steps'."""
    widest = max(model.vocab_size, model.ffn_hidden_size, model.num_heads * model.seq_len)
    return heap_mmap_threshold(tokens=micro_batch * model.seq_len, widest=widest)


def cpu_step_bytes(shape: Shape, *, micro_batch: int) -> float:
    """A CPU rank's step beyond its tensors and the proportional slack: the code it pages in and
    the holes of ``HOLE_BLOCKS`` heap blocks of the mmap threshold's size."""
    widest = max(shape.vocab, shape.ffn, shape.heads * shape.seq)
    return CPU_STEP_CODE_BYTES + HOLE_BLOCKS * heap_mmap_threshold(tokens=micro_batch * shape.seq, widest=widest)
