"""When a rank's step peaks, and which of its items are live then.

Not every item of the memory estimate lives through the whole step. The step zeroes the
gradients with ``set_to_none``, and backward makes each parameter's gradient as it frees
the activations of the block that used it. A microbatch's activations therefore meet the
gradients only where an earlier microbatch of the same step made them (gradient
accumulation) or a pipeline schedule interleaves microbatches (``concurrent``). Without
either, the step has three candidate peaks (``live_at_peak`` takes the largest):

- the end of the forward: the saved activations, and under recompute the 16-bit copies
  of the weights that autocast's cache holds until the forward returns though no block
  saves them (ZeRO 0 only: FSDP gathers 16-bit weights that need no cast); under
  accumulation also the previous microbatch's logits, which the step holds until the
  new ones replace them;
- the start of the backward: the saved activations, the loss's logits gradient and its
  fp32 chunks, one block's rebuilt activations under recompute, the ZeRO 1-3 gathers and
  block gradients;
- the end of the backward: every gradient, the logits the step still holds, the tied
  embedding's dense gradient before it is added to the output layer's, one block's
  rebuilt activations, ZeRO 0's flat gradient copies (complete only at the end).

On one H200 (torch 2.11, bf16, parallel=single, one microbatch) gpt-1b peaked at 32.01 GiB
reserved without recompute: the start of the backward, no gradient yet (4.9 GiB fewer
than the items' sum), as the rehearsal on fake tensors shows (grads 0 at its peak).
With selective recompute, checkpointed op by op then, it peaked at 28.29 GiB: the end of the
forward, autocast's cached weight copies (2.25 GiB) live besides the kept matmul outputs.
Compiled blocks are still checkpointed so; eager dense blocks now rebuild their cheap steps
and save their weight copies as without recompute, so they peak at the start of the backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Working:
    """A rank's short-lived bytes, by when they live (see the module docstring)."""

    loss: float = 0.0  # the logits' gradient and the loss's fp32 chunks (last stage)
    recompute: float = 0.0  # one block's rebuilt activations, through the backward
    fp8: float = 0.0  # one layer's float8 casts, through forward and backward
    reduce: float = 0.0  # gradient reduction buffers and ZeRO 3's gathers
    reduce_at_end: bool = False  # ZeRO 0: the flat copies fill up as the backward ends
    cached: float = 0.0  # autocast's cache of weight copies no block saves (end of forward)
    embedding: float = 0.0  # a tied embedding's dense gradient (end of backward, first stage)
    kept_to_end: float = 0.0  # the logits the step holds until its backward returns (last stage)
    # a vocab-parallel embedding's per-microbatch gradient (a Partial of the whole table) and
    # the sum it is accumulated into, while a pipeline keeps other microbatches' activations
    pipelined_embedding: float = 0.0

    @property
    def all_at_once(self) -> float:
        """Everything the backward's start may hold, the forward's cache aside."""
        return self.loss + self.recompute + self.fp8 + self.reduce + self.pipelined_embedding


@dataclass(frozen=True)
class Live:
    """Bytes live at the step's peak besides the weights and optimizer states."""

    grads: float
    activations: float
    transient: float
    when: str

    @property
    def total(self) -> float:
        return self.grads + self.activations + self.transient


def live_at_peak(*, grads: float, activations: float, working: Working, concurrent: bool) -> Live:
    """The largest of the step's candidate peaks (module docstring). ``grads`` are all the
    gradients the step makes, ``activations`` the saved activations at the schedule's peak."""
    earlier = grads if concurrent else 0.0
    gathers = 0.0 if working.reduce_at_end else working.reduce
    candidates = [
        Live(earlier, activations, working.all_at_once, "start of the backward"),
        # under accumulation the previous microbatch's logits live until this forward's replace them
        Live(
            earlier,
            activations,
            working.cached + working.fp8 + gathers + (working.kept_to_end if concurrent else 0.0),
            "end of the forward",
        ),
    ]
    if not concurrent:
        end = max(working.recompute, working.embedding) + working.fp8 + working.reduce
        candidates.append(Live(grads, min(activations, working.kept_to_end), end, "end of the backward"))
    return max(candidates, key=lambda live: live.total)
