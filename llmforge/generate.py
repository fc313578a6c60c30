"""``llmforge generate``: text from a checkpoint, with the run's tokenizer.

The model is rebuilt whole from the checkpoint (any layout it was saved under)
on the CPU or one GPU, in fp32. Each new token is sampled from the logits of the
last position: greedy when ``generate.temperature=0``, else softmax at the
temperature restricted to the ``top_k`` most likely tokens and to the smallest set
whose probabilities reach ``top_p``, drawn with a generator seeded by
``generate.seed``.

With ``generate.kv_cache`` (the default) the prompt runs once and every new token
runs alone against each layer's cached keys and values (``llmforge.models.kvcache``),
the same ids as recomputing the whole context. The model has ``model.seq_len``
positions: when the cache holds that many, it is rebuilt from the last half of the
text, so the context stays between half a window and a window. Without the cache,
every step runs the model over the last ``model.seq_len`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from llmforge.checkpoint.export import read_model_weights, run_tokenizer_file
from llmforge.checkpoint.locate import locate
from llmforge.checkpoint.resume import saved_config, split_ckpt
from llmforge.config.ranges import range_problems
from llmforge.config.schema import GenerateConfig, RunConfig
from llmforge.data.tokenizer import find_eos, load_tokenizer
from llmforge.errors import Problem, UserError
from llmforge.models.gpt import GPT
from llmforge.models.kvcache import KVCache


def check_settings(g: GenerateConfig) -> None:
    """Every generate.* value out of its schema range, in one error."""
    problems = range_problems(g, prefix="generate.")
    if problems:
        raise UserError(problems, title="bad generate settings")


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """[vocab] logits with the tokens outside top-k / top-p set to -inf (the best one always stays)."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the mass before a token already reaches p
        outside[0] = False  # the most likely token stays, however small p is
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, *, settings: GenerateConfig, generator: torch.Generator) -> int:
    """One token id from the last position's [vocab] logits."""
    logits = logits.double()  # float64: a temperature or top_p near 0 stays apart from 0
    if settings.temperature == 0:
        return int(torch.argmax(logits))
    scaled = (logits - logits.max()) / settings.temperature  # <= 0: a tiny temperature gives -inf, never inf - inf
    logits = filter_logits(scaled, top_k=settings.top_k, top_p=settings.top_p)
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: torch.nn.Module, prompt: list[int], *, settings: GenerateConfig, seq_len: int, eos_id: int | None, device: torch.device
) -> list[int]:
    """The generated token ids (without the prompt)."""
    model.eval()
    if settings.kv_cache:
        return _cached_ids(model, prompt, settings=settings, seq_len=seq_len, eos_id=eos_id, device=device)
    generator = torch.Generator().manual_seed(settings.seed)
    ids = list(prompt)
    out: list[int] = []
    for _ in range(settings.max_tokens):
        window = torch.tensor([ids[-seq_len:]], dtype=torch.long, device=device)
        token = next_token(model(window)[0, -1], settings=settings, generator=generator)
        if settings.stop_at_eos and token == eos_id:
            break
        ids.append(token)
        out.append(token)
    return out


def _cached_ids(
    model: torch.nn.Module, prompt: list[int], *, settings: GenerateConfig, seq_len: int, eos_id: int | None, device: torch.device
) -> list[int]:
    generator = torch.Generator().manual_seed(settings.seed)
    ids, out = list(prompt), []
    cache, pending = KVCache(model.config), ids[-seq_len:]
    for _ in range(settings.max_tokens):
        logits = model(torch.tensor([pending], dtype=torch.long, device=device), cache=cache)[0, -1]
        token = next_token(logits, settings=settings, generator=generator)
        if settings.stop_at_eos and token == eos_id:
            break
        ids.append(token)
        out.append(token)
        if cache.length >= seq_len:  # no position left: start again from the last half window
            cache, pending = KVCache(model.config), ids[-max(1, seq_len // 2) :]
        else:
            pending = [token]
    return out


def load_model(path: Path, *, config: RunConfig, device: torch.device) -> torch.nn.Module:
    """The whole model with a checkpoint's weights (saved under any layout)."""
    weights = read_model_weights(path)
    if config.model.tie_embeddings:
        weights.pop("head.weight", None)  # the last pipeline stage's copy of the embedding
    model = GPT(config.model)
    model.load_state_dict(weights, strict=True)
    return model.to(device)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError([Problem("--device", name, "this machine has no CUDA device", "use --device cpu")], title="no GPU")
    return torch.device(name)


def checkpoint_config(overrides: list[str]):
    """The verified checkpoint folder and its saved config with ``generate.*``/``data.cache_dir`` overrides."""
    ckpt, rest = split_ckpt(overrides)
    allowed = ("generate.", "data.cache_dir=")
    bad = [o for o in rest if not o.lstrip("+~").startswith(allowed)]
    if bad:
        raise UserError(
            [
                Problem(o.split("=", 1)[0], o, "generate takes only ckpt=, generate.* and data.cache_dir overrides", "remove it")
                for o in bad
            ],
            title="bad overrides",
        )
    found = locate(ckpt)
    return found.path, saved_config(found.path, rest)


def run_tokenizer(config: RunConfig, *, tokenizer: Path | None, console: Console):
    """(tokenizer, end-of-document id): ``--tokenizer`` or the run's own, from the prepared-data
    cache (prepared again, identically, if the cache was removed)."""
    from tokenizers import Tokenizer

    if tokenizer is not None:
        tok = load_tokenizer(str(tokenizer), vocab_size=config.model.vocab_size, key="--tokenizer")
        return tok, find_eos(tok)
    path, eos_id = run_tokenizer_file(config, console=console)
    return Tokenizer.from_file(str(path)), eos_id
