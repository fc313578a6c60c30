"""Real tensor-parallel training steps of small GPTs, timed on the calibration's ranks
(``llmforge.calibrate.tp_wait`` fits what their collectives wait)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from llmforge.calibrate.fit import CommSample
from llmforge.calibrate.tp_wait import PROBES, TP_STEP, Probe
from llmforge.config.schema import ModelConfig
from llmforge.estimate.cpu_memory import model_mmap_threshold
from llmforge.models.gpt import GPT, parameter_groups
from llmforge.parallel.clip import GlobalClip
from llmforge.parallel.tensor import align_grads, apply_tp, loss_context, sharded_cross_entropy
from llmforge.processes.host_memory import keep_freed_memory

#: Timed steps of a probe, full and ``quick``.
TIMED_STEPS = {False: 5, True: 3}
#: A CPU process's first steps run up to five times slower than its steady ones, and fall to them
#: over eight to ten steps (a probe's second model too): a warm-up runs until the last three steps
#: are no more than ``SETTLED`` faster than the three before, within these bounds.
WARMUP_LEAST, WARMUP_MOST = 6, 30
SETTLED = 0.1


def stepper(model_config: ModelConfig, *, micro_batch: int, microbatches: int, group: dist.ProcessGroup | None) -> Callable[[], None]:
    """One training step as a CPU rank runs it: glibc's thresholds fixed as a training rank fixes
    them, ``microbatches`` forward and backward passes accumulating the gradients, the global
    gradient clip and a for-loop AdamW (matrices decayed, the rest not). The weights start as a
    run's do (``init_weights``), and each microbatch brings new tokens as training's bring new
    text: torch's default initialisation (embeddings of standard deviation 1) or steps fitting
    one batch over and over make the softmax peak, so that about half its probabilities are
    denormal or zero, and the output layer's backward matmuls over them then run 1.3-30x slower
    than training's. With ``group`` the model is sharded over its ranks
    (tensor parallel, vocab-parallel loss); without, whole."""
    keep_freed_memory(model_mmap_threshold(model_config, micro_batch=micro_batch))
    model = GPT(model_config)
    model.init_weights(seed=0)
    tp = dist.get_world_size(group) if group is not None else 1
    if group is not None:
        apply_tp(model, tp_mesh=DeviceMesh.from_group(group, "cpu"), sequence_parallel=False)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.1), lr=1e-3, foreach=False)
    clip = GlobalClip(params=params, ranks_per_stage=tp, distributed=group is not None, group=group)
    draw = torch.Generator().manual_seed(0)  # the same tokens on every rank

    def step() -> None:
        for _ in range(microbatches):
            tokens = torch.randint(0, model_config.vocab_size, (micro_batch, model_config.seq_len + 1), generator=draw)
            with loss_context(tp):
                logits, targets = model(tokens[:, :-1]), tokens[:, 1:]
                loss = sharded_cross_entropy(logits, targets) if tp > 1 else F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                (loss / microbatches).backward()
        if tp > 1:
            align_grads(params)
        clip(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def warm_up(step: Callable[[], None], *, group: dist.ProcessGroup | None, most: int | None = None) -> int:
    """Call ``step`` until its time settles on every rank of ``group`` (at least ``WARMUP_LEAST``
    calls, at most ``most``, default ``WARMUP_MOST``); the ranks agree after each call. Returns the
    calls made."""
    most = WARMUP_MOST if most is None else most
    seconds: list[float] = []
    while True:
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        settled = len(seconds) >= WARMUP_LEAST and statistics.median(seconds[-3:]) >= (1 - SETTLED) * statistics.median(seconds[-6:-3])
        going = torch.tensor([0.0 if settled or len(seconds) >= most else 1.0])
        dist.all_reduce(going, op=dist.ReduceOp.MAX, group=group)
        if not going.item():
            return len(seconds)


def median_step_seconds(step: Callable[[], None], *, group: dist.ProcessGroup | None, timed: int, most_warmup: int | None = None) -> float:
    """The median of ``timed`` calls of ``step`` once its time has settled (``warm_up``), on the
    slowest rank of ``group`` (every rank of it calls this; None: the default group)."""
    warm_up(step, group=group, most=most_warmup)
    dist.barrier(group=group)
    seconds = []
    for _ in range(timed):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(seconds)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def time_probe(probe: Probe, *, group: dist.ProcessGroup, quick: bool) -> float:
    """Seconds of one step of ``probe`` sharded over ``group`` (``TIMED_STEPS`` after the warm-up)."""
    step = stepper(probe.model, micro_batch=probe.micro_batch, microbatches=probe.microbatches, group=group)
    return median_step_seconds(step, group=group, timed=TIMED_STEPS[quick])


def can_shard(*, ranks: int) -> bool:
    """Whether every probe shards over ``ranks`` ranks (whole heads on each)."""
    return ranks > 1 and all(probe.model.num_heads % ranks == 0 for probe in PROBES)


def tp_step_samples(*, link: str, group: dist.ProcessGroup, quick: bool) -> list[CommSample]:
    """Every probe's step on ``group``, as ``CommSample(op=TP_STEP, nbytes=probe index)``."""
    n = dist.get_world_size(group)
    return [CommSample(TP_STEP, link, n, index, time_probe(probe, group=group, quick=quick)) for index, probe in enumerate(PROBES)]
