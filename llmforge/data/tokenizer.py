"""Byte-level BPE tokenizers: train one with `tokenizers`, or load the user's tokenizer.json.

Every prepared dataset ends each document with an end-of-document token, so the
tokenizer must have one: a trained tokenizer gets ``<|endoftext|>`` as token 0; a loaded
one uses the first of the usual end-of-text tokens it knows, or gets ``<|endoftext|>`` added.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmforge.errors import Problem, UserError

if TYPE_CHECKING:  # imported where used: the estimator reads the data cache without `tokenizers`
    from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
KNOWN_EOS = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
MIN_VOCAB = 257  # 256 byte tokens plus the end-of-document token
MAX_VOCAB = 2**32
#: Longest run of non-space characters BPE training sees as one piece: a merge rewrites every word
#: holding its pair, so one 5 MB word costs merges x 5 MB; real pre-tokens are far shorter.
MAX_RUN_CHARS = 256
_LONG_RUN = re.compile(rf"\S{{{MAX_RUN_CHARS + 1},}}")


def check_vocab_size(vocab_size: int, *, key: str = "data.vocab_size") -> None:
    """Reject vocabularies a byte-level BPE cannot have or a token shard cannot store."""
    if vocab_size < MIN_VOCAB:
        raise UserError(
            [
                Problem(
                    key,
                    vocab_size,
                    f"a byte-level BPE needs at least {MIN_VOCAB} tokens (256 bytes and the end-of-document token)",
                    f"set {key} to 4096 or more",
                )
            ],
            title="invalid vocabulary size",
        )
    if vocab_size > MAX_VOCAB:
        raise UserError(
            [Problem(key, vocab_size, "token ids must fit the uint32 token shards (at most 2**32)", f"set {key} to at most {MAX_VOCAB}")],
            title="vocabulary too large",
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    check_vocab_size(vocab_size)
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cap_runs(text: str) -> list[str]:
    """text cut into pieces (for training only) so that no run of non-space characters is
    longer than MAX_RUN_CHARS; identical cut pieces of a repeated run count as one word."""
    if _LONG_RUN.search(text) is None:
        return [text]
    pieces: list[str] = []
    start = 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def train_bpe(texts: Iterable[list[str]], *, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most vocab_size tokens on batches of documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path_text: str, *, vocab_size: int, key: str = "data.tokenizer") -> Tokenizer:
    """Load a tokenizer.json (``key`` names where its path came from: data.tokenizer or
    generate's --tokenizer), checking it exists, parses, and fits the model's vocabulary."""
    path = Path(path_text).expanduser()
    unset = "leave it unset to train one" if key == "data.tokenizer" else "leave it out to use the run's own"
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "no such file"
        hint = f" (perhaps {key}={path / 'tokenizer.json'})" if (path / "tokenizer.json").is_file() else ""
        raise UserError([Problem(key, path_text, what, f"point {key} at a tokenizer.json{hint}, or {unset}")], title="missing tokenizer")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(
            [
                Problem(
                    key, str(path), f"not a tokenizers tokenizer.json ({exc})", "save the tokenizer with tokenizer.save('tokenizer.json')"
                )
            ],
            title="unreadable tokenizer",
        ) from None
    if find_eos(tokenizer) is None:
        tokenizer.add_special_tokens([EOS_TOKEN])
    _check_ids_fit(tokenizer, path=path, vocab_size=vocab_size, key=key)
    return tokenizer


def _check_ids_fit(tokenizer: Tokenizer, *, path: Path, vocab_size: int, key: str) -> None:
    """Every id the tokenizer can produce must index the model's embedding and, for
    data.tokenizer, fit a token shard."""
    count, largest = tokenizer.get_vocab_size(with_added_tokens=True), largest_id(tokenizer)
    if largest >= vocab_size:
        what = (
            f"its largest token id is {largest} ({count} tokens, so its ids have gaps)"
            if largest >= count
            else f"it has {count} tokens (ids up to {largest})"
        )
        fix = (
            f"set model.vocab_size={largest + 1} (or larger), or use a tokenizer whose ids fit"
            if key == "data.tokenizer"
            else "use the run's own tokenizer, or one whose ids are below the model's vocabulary size"
        )
        raise UserError(
            [
                Problem(
                    key,
                    str(path),
                    f"{what}, but the vocabulary size is {vocab_size} (data.vocab_size, else model.vocab_size): ids must be below it",
                    fix,
                )
            ],
            title="tokenizer too large for the model",
        )
    if key == "data.tokenizer":  # its ids go into token shards
        check_vocab_size(largest + 1, key="data.tokenizer largest id + 1")


def find_eos(tokenizer: Tokenizer) -> int | None:
    """Id of the end-of-document token, or None."""
    for token in KNOWN_EOS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def largest_id(tokenizer: Tokenizer) -> int:
    """The largest id in the tokenizer's vocabulary, special tokens included."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=0)


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """Ids the tokenizer can produce: one past its largest id (more than its token count when ids have gaps)."""
    return max(tokenizer.get_vocab_size(with_added_tokens=True), largest_id(tokenizer) + 1)
