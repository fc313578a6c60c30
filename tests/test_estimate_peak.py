"""When the step peaks (llmforge.estimate.phases), held to the rehearsal on fake tensors.

The estimate's items are what is live at the largest of three moments: the end of the
forward, the start of the backward, the end of the backward. Gradients are made during the
backward as activations are freed, so they meet a microbatch's activations only under
gradient accumulation; under recompute autocast's cache holds the blocks' 16-bit weight
copies until the forward returns. On an H200 gpt-1b (one microbatch of 4 x 2048) peaked at
32.01 GiB reserved where the items' sum was 37.8 GiB: its 4.9 GiB of gradients were not yet
made. The rehearsal (every tensor the program keeps, on CPU, bf16 autocast) is the reference
here on tiny shapes, a few seconds each.
"""

from __future__ import annotations

import pytest

from llmforge.commands.plans import build_plan
from llmforge.estimate.core import estimate_plan
from llmforge.rehearse.run import rehearse

BF16 = ["recipe=tiny", "precision=bf16", "train.micro_batch_size=2"]
SMALL = [*BF16, "model.seq_len=128", "model.vocab_size=1024"]  # activations and the loss outweigh the weights
DEEP = [*BF16, "model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.vocab_size=256", "model.seq_len=256"]
WIDE = [*BF16, "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.vocab_size=256", "model.seq_len=32"]  # weights outweigh

CASES = {
    "one microbatch: no gradient yet": ([*SMALL, "train.global_batch_size=2"], "start of the backward"),
    "accumulation: the first microbatch's gradients": ([*SMALL, "train.global_batch_size=4"], "start of the backward"),
    "selective: autocast's cached weight copies": (
        [*DEEP, "train.global_batch_size=2", "parallel.recompute=selective"],
        "end of the forward",
    ),
    "selective under accumulation: and the last logits": (
        [*WIDE, "train.global_batch_size=4", "parallel.recompute=selective"],
        "end of the forward",
    ),
    "full, small activations: every gradient": ([*WIDE, "train.global_batch_size=2", "parallel.recompute=full"], "end of the backward"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_peaks_when_and_as_high_as_the_rehearsal(name):
    overrides, when = CASES[name]
    plan = build_plan(overrides)
    w = estimate_plan(plan).worst
    r = rehearse(plan, stage=0)
    tensors = w.weights + w.grads + w.optimizer + w.activations + w.transient
    assert w.peak == when
    if when != "end of the backward":  # there the rehearsal peaks just before the last gradient is made
        assert r.categories["grads"] == w.grads
    assert 0.95 < r.step_peak_bytes / tensors < 1.05
