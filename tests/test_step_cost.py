"""The cost around the step seam: host synchronisations, the optimizer, clipping."""

from __future__ import annotations

import pytest
import torch

from llmforge.parallel.clip import GlobalClip
from llmforge.testing.harness import SyntheticSampler, rank_info, tiny_plan
from llmforge.train.build import build_components
from llmforge.train.callbacks import Recorder
from llmforge.train.loop import train_loop
from llmforge.train.syncs import HostSyncCounter, StepSyncs


def _components(plan, device: torch.device):
    cfg = plan.config
    torch.manual_seed(cfg.train.seed)
    sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed
    )
    return build_components(plan, rank=rank_info(plan, device=device), sampler=sampler)


def _syncs_per_step(device: torch.device, *, steps: int, log_interval: int, extra: tuple[str, ...] = ()) -> tuple[list, list]:
    plan = tiny_plan([f"train.steps={steps}", "model.num_layers=1", *extra])
    c = _components(plan, device)
    recorder = Recorder()
    syncs = StepSyncs(host=c.host_tensors)
    with syncs:
        train_loop(
            c,
            start_step=0,
            total_steps=steps,
            grad_clip=0.5,
            log_interval=log_interval,
            checkpoint_interval=0,
            callbacks=[recorder, syncs],
        )
    return syncs.per_step, recorder.records


def test_a_step_reads_the_device_once_when_it_logs_and_never_otherwise():
    per_step, records = _syncs_per_step(torch.device("cpu"), steps=5, log_interval=2)
    # steps 2..5: 2 and 4 log, 3 does not, 5 is the last step (always logged)
    assert per_step == [1, 0, 1, 1]
    assert [r["step"] for r in records] == [2, 4, 5]
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records)


def test_an_moe_step_reads_nothing_when_it_does_not_log():
    """Grouped matmuls take the experts' boundaries on the device: no read of the largest count."""
    moe = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=48", "model.moe.num_shared_experts=1")
    per_step, _ = _syncs_per_step(torch.device("cpu"), steps=4, log_interval=2, extra=moe)
    assert per_step[1] == 0 and per_step[0] == per_step[2] > 0  # steps 2 and 4 read the loss, the norm, the MoE statistics


def test_ranks_vote_on_a_stop_only_at_logged_steps(one_rank, monkeypatch):
    """A signal waits for the next logged step, where the vote's read joins the loop's; a rank alone
    stops after the current step without a vote."""
    import torch.distributed as dist

    from llmforge.train.stop import StopSignal

    alone = StopSignal()
    alone._received = "SIGTERM"
    with HostSyncCounter() as syncs:
        assert alone.should_stop()
    assert syncs.count == 0
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # stands for a second rank
    stop = StopSignal()
    stop._received = "SIGTERM"
    with HostSyncCounter() as syncs:
        assert not stop.should_stop()  # not logged: no vote
    assert syncs.count == 0
    stop.log({"step": 2})
    with HostSyncCounter() as syncs:
        assert stop.should_stop()
    assert syncs.count == 1


def test_the_counter_sees_item_float_and_tolist():
    t = torch.ones(3)
    with HostSyncCounter() as syncs:
        t.sum().item()
        float(t[0])
        t.tolist()
        (t * 2).add_(1)
    assert syncs.count == 3


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_equals_torch_clip_grad_norm(max_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 50, 7)]
    for p in params:
        p.grad = torch.randn_like(p)
    ref = _with_grads([p.grad.clone() for p in params])
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    got = GlobalClip(params=params)(max_norm)
    assert got.dtype == torch.float64 and float(got) == pytest.approx(float(want), rel=1e-6)
    for p, r in zip(params, ref, strict=False):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


def _with_grads(grads: list) -> list:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        out.append(p)
    return out


def test_cpu_runs_torch_default_adamw():
    """On CPU the optimizer is torch's default for CPU tensors: the for-loop AdamW."""
    c = _components(tiny_plan(["model.num_layers=1"]), torch.device("cpu"))
    defaults = c.optimizer.defaults
    assert not defaults["foreach"] and not defaults["fused"]


def _faults_to_write_again(numel: int) -> int:
    """Page faults of writing a fresh buffer of ``numel`` floats after one as large was written
    and freed: the fewest of a few rounds (the heap settles where it grows in the first ones)."""
    import resource

    counts = []
    for _ in range(4):
        torch.empty(numel).fill_(1.0)  # allocated, written and freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(numel).fill_(2.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts)


def test_a_cpu_rank_reuses_freed_host_memory_without_page_faults():
    """After building a CPU rank, a freed step-sized buffer (8 MiB, the default recipe's
    logits) comes back from the heap: writing it again faults in no fresh pages, also where
    an earlier plan of the same process had set a smaller mmap threshold."""
    from llmforge.processes.host_memory import keep_freed_memory

    keep_freed_memory(16 * 2**20)  # as this plan's build sets it: a second call must set it again
    keep_freed_memory(4 * 2**20)
    plan = tiny_plan(["model.num_layers=1", "model.vocab_size=4096", "model.seq_len=128", "train.micro_batch_size=4"])
    _components(plan, torch.device("cpu"))
    logits = 4 * 128 * 4096
    faults = _faults_to_write_again(logits)
    assert faults < 256, f"{faults} page faults for a buffer of 2048 pages"


def test_blocks_larger_than_every_activation_are_mapped_on_their_own():
    """glibc's mmap threshold is the smallest power of two above a microbatch's largest
    activation: the default recipe's 8 MiB logits stay in the heap; a 225M-parameter model's
    16 MiB weights (2 MiB activations) are mapped, so the activations cannot fragment them."""
    from llmforge.estimate.cpu_memory import MMAP_THRESHOLD_MAX, model_mmap_threshold

    def mmap_threshold(plan):
        return model_mmap_threshold(plan.config.model, micro_batch=plan.layout.micro_batch_size)

    default = tiny_plan(["model.vocab_size=4096", "model.seq_len=128", "train.micro_batch_size=4"])
    assert mmap_threshold(default) == 16 * 2**20
    big = tiny_plan(
        [
            "model.num_layers=2",
            "model.hidden_size=1024",
            "model.num_heads=16",
            "model.ffn_hidden_size=4096",
            "model.vocab_size=4096",
            "model.seq_len=128",
            "train.micro_batch_size=1",
            "train.global_batch_size=8",
        ]
    )
    assert mmap_threshold(big) == 4 * 2**20
    assert mmap_threshold(tiny_plan(["model.vocab_size=50304", "model.seq_len=128", "train.micro_batch_size=4"])) == MMAP_THRESHOLD_MAX
