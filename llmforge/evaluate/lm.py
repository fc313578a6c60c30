"""llmforge's own model as an lm-evaluation-harness model (a ``lm_eval.api.model.TemplateLM``).

The three request kinds run on the whole model in one process, in its own code (no
export): ``loglikelihood`` and ``loglikelihood_rolling`` score padded batches of token
windows, longest first; ``generate_until`` continues batches of contexts of equal token
length together with the KV cache (``llmforge.models.kvcache``). Tokenization and
windowing are lm-eval's own (``TemplateLM._encode_pair``, ``get_rolling_token_windows``),
with the end-of-document token as the prefix, as its ``hf`` model does on an export of the
same checkpoint, so the two give the same numbers.

lm-eval is an optional dependency, imported when a model is made (``harness_model``): the
methods live in ``HarnessMethods`` and the class, registered with lm-eval as ``llmforge``,
is that and ``TemplateLM`` together.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from llmforge.models.kvcache import KVCache

#: One scored window: (request key, context ids, continuation ids).
Window = tuple[Any, list[int], list[int]]


def harness_model(
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    eos_id: int,
    seq_len: int,
    batch_size: int = 8,
    max_gen_tokens: int = 256,
    split_over_ranks: bool = False,
) -> Any:
    """The lm-eval model over a built llmforge ``GPT`` (weights already loaded) and the run's tokenizer.
    ``split_over_ranks``: each rank of the default process group (every one with the whole model,
    and none waiting on another in forward) runs its share of the documents; rank 0 gets the results."""
    lm = harness_class()(
        model=model, tokenizer=tokenizer, eos_id=eos_id, seq_len=seq_len, batch_size=batch_size, max_gen_tokens=max_gen_tokens
    )
    if split_over_ranks and dist.is_initialized() and dist.get_world_size() > 1:
        lm._rank, lm._world_size = dist.get_rank(), dist.get_world_size()
    return lm


@functools.cache
def harness_class() -> type:
    """``LlmforgeLM``: ``HarnessMethods`` on lm-eval's ``TemplateLM``, registered as ``llmforge``."""
    import lm_eval.models  # noqa: F401 (lm-eval's own models, registered lazily: ours joins them rather than standing alone)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    return register_model("llmforge")(type("LlmforgeLM", (HarnessMethods, TemplateLM), {"__module__": __name__}))


class HarnessMethods:
    """What the lm-eval model does; ``harness_class`` puts it on ``TemplateLM``."""

    def __init__(
        self, *, model: torch.nn.Module, tokenizer: Any, eos_id: int, seq_len: int, batch_size: int = 8, max_gen_tokens: int = 256
    ) -> None:
        super().__init__()
        self.model, self.tok, self.eos_id = model, tokenizer, eos_id
        self.seq_len, self.batch_size, self.max_gen_tokens = seq_len, batch_size, max_gen_tokens
        self._device = next(model.parameters()).device
        #: Tokens run through the model since the last reset (the throughput figures count them).
        self.tokens_seen = 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated (stacked when they are scalars), as lm-eval's evaluator asks."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def max_length(self) -> int:
        return self.seq_len

    @property
    def tokenizer_name(self) -> str:
        return "llmforge"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tok.encode(string, add_special_tokens=False).ids)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Window], disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per window."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for batch in _chunks(order, self.batch_size):
            for i, scored in zip(batch, self._score([requests[i] for i in batch]), strict=True):
                out[i] = scored
                self.cache_hook.add_partial("loglikelihood", requests[i][0], scored)
        return out

    def _score(self, windows: list[Window]) -> list[tuple[float, bool]]:
        """One padded forward over windows cut to the model's last ``seq_len`` positions."""
        inputs = [(context + continuation)[-(self.seq_len + 1) :][:-1] for _, context, continuation in windows]
        width = max(len(ids) for ids in inputs)
        tokens = torch.full((len(inputs), width), self.eos_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.tokens_seen += sum(len(ids) for ids in inputs)
        logits = self.model(tokens.to(self._device))
        totals, greedy = [], []
        for row, (ids, (_, _, continuation)) in enumerate(zip(inputs, windows, strict=True)):
            # the continuation's positions only: a choice is a token or two of a long context
            picked = torch.log_softmax(logits[row, len(ids) - len(continuation) : len(ids)].float(), dim=-1)
            target = torch.tensor(continuation, dtype=torch.long, device=picked.device)
            totals.append(picked.gather(1, target[:, None]).sum())
            greedy.append((picked.argmax(-1) == target).all())
        return list(zip(torch.stack(totals).double().tolist(), torch.stack(greedy).tolist(), strict=True))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in disjoint windows of the model's length."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows: list[Window] = []
        owners: list[int] = []
        for index, (text,) in enumerate(req.args for req in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eos_id, max_seq_len=self.seq_len, context_len=1
            )
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context up to its first stop string (or end-of-document, or the token limit)."""
        prompts = [self.tok_encode(context)[-self.seq_len :] or [self.eos_id] for context, _ in (r.args for r in requests)]
        out = [""] * len(requests)
        groups: dict[tuple[int, str], list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((len(prompts[i]), repr(sorted(req.args[1].items()))), []).append(i)
        for members in groups.values():
            for batch in _chunks(members, self.batch_size):
                settings = requests[batch[0]].args[1]
                texts = self._generate([prompts[i] for i in batch], settings=settings)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, prompts: list[list[int]], *, settings: dict[str, Any]) -> list[str]:
        """Prompts of one length, continued together (each row stops on its own)."""
        until = _stop_strings(settings)
        limit = int(settings.get("max_gen_toks", self.max_gen_tokens))
        temperature = _temperature(settings)
        generator = torch.Generator().manual_seed(0)
        rows = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        cache, pending = KVCache(self.model.config), [r[-self.seq_len :] for r in rows]
        for _ in range(limit):
            logits = self.model(torch.tensor(pending, dtype=torch.long, device=self._device), cache=cache)[:, -1]
            self.tokens_seen += len(pending) * len(pending[0])
            for row, token in enumerate(_pick(logits, temperature=temperature, generator=generator)):
                rows[row].append(token)
                if not done[row]:
                    new[row].append(token)
                    done[row] = token == self.eos_id or _stopped(self.tok_decode(new[row]), until)
            if all(done):
                break
            if cache.length >= self.seq_len:  # no position left: start again from the last half window
                cache, pending = KVCache(self.model.config), [r[-max(1, self.seq_len // 2) :] for r in rows]
            else:
                pending = [[r[-1]] for r in rows]
        return [_cut(self.tok_decode([t for t in ids if t != self.eos_id]), until) for ids in new]


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _stop_strings(settings: dict[str, Any]) -> list[str]:
    until = settings.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _temperature(settings: dict[str, Any]) -> float:
    """0 (greedy) unless the task asks to sample (``do_sample`` with a positive temperature)."""
    return float(settings.get("temperature", 0.0) or 0.0) if settings.get("do_sample", False) else 0.0


def _pick(logits: torch.Tensor, *, temperature: float, generator: torch.Generator) -> list[int]:
    """Each row's next token: the most likely, or drawn from the softmax at the temperature (float64)."""
    if temperature == 0:
        return [int(t) for t in logits.argmax(-1)]
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    return [int(t) for t in torch.multinomial(probs, 1, generator=generator)[:, 0]]


def _stopped(text: str, until: list[str]) -> bool:
    return any(stop and stop in text for stop in until)


def _cut(text: str, until: list[str]) -> str:
    """The text before its first stop string."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
