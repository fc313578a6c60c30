"""Benchmark the data pipeline against plain baselines, side by side in one run.

    python tools/bench_data.py [--mb 8] [--vocab 4096]

Prints, on the same corpus (standard-library text written to a .jsonl file):

1. tokenize-and-pack throughput (MB/s) of llmforge's pipeline against a plain
   ``datasets.map`` + ``tokenizers`` baseline that then packs the ids into one array;
2. peak memory (RSS) of preparing the shards against holding the tokens in Python lists;
3. sampler throughput to the trainer (tokens/s) and whether reads are views of the memmap.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmforge.data.documents import open_documents  # noqa: E402
from llmforge.data.shards import pack  # noqa: E402
from llmforge.data.sources import builtin_source, file_source  # noqa: E402
from llmforge.data.tokenizer import train_bpe  # noqa: E402


def make_corpus(folder: Path, *, mb: float) -> Path:
    """Standard-library sources as one .jsonl document per file."""
    path = folder / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for f in builtin_source(max_mb=mb).files:
            fh.write(json.dumps({"text": Path(f).read_text(encoding="utf-8")}) + "\n")
    return path


def ours(corpus: Path, tokenizer: Path, out: Path) -> int:
    """llmforge: datasets load, then tokenizer straight into shard files."""
    docs = open_documents(file_source(str(corpus), text_key="text"), text_key="text", cache_dir=out / "hf")
    stats = pack(docs, tokenizer_path=tokenizer, eos_id=0, dtype=np.dtype(np.uint16), out_dir=out / "shards")
    return stats.num_tokens


def baseline(corpus: Path, tokenizer: Path, out: Path) -> int:
    """The usual recipe: datasets.map with tokenizers' encode_batch, then pack the id column."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer))
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "hf"))
    ds = ds.map(lambda b: {"ids": [e.ids + [0] for e in tok.encode_batch(b["text"])]}, batched=True, remove_columns=["text"])
    out.mkdir(parents=True, exist_ok=True)
    ids = np.fromiter(itertools.chain.from_iterable(ds["ids"]), dtype=np.uint16)
    ids.tofile(out / "tokens.bin")
    return len(ids)


def python_lists(corpus: Path, tokenizer: Path, out: Path) -> int:
    """Hold every document's ids as Python lists (what the memory figure is compared with)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    held = [e.ids + [0] for e in tok.encode_batch(texts)]
    del texts
    return sum(len(x) for x in held)


def _child(name: str, corpus: str, tokenizer: str, out: str, queue) -> None:
    import datasets  # noqa: F401  (imported before the clock starts, for every method alike)

    start = time.perf_counter()
    tokens = {"ours": ours, "baseline": baseline, "lists": python_lists}[name](Path(corpus), Path(tokenizer), Path(out))
    queue.put((time.perf_counter() - start, tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def measure(name: str, corpus: Path, tokenizer: Path, out: Path):
    """(seconds, tokens, peak RSS MB) of one method in a fresh process."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, str(corpus), str(tokenizer), str(out), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def bench_sampler(shards: Path, *, num_tokens: int, vocab: int, seq_len: int, batch: int, seconds: float = 2.0):
    """Tokens per second out of BatchSampler.next_batch, and whether reads are memmap views."""
    from llmforge.data.prepare import PreparedData, StreamInfo
    from llmforge.data.sampler import BatchSampler

    info = StreamInfo(
        name="bench", folder=shards, weight=1.0, num_tokens=num_tokens, num_documents=0, shards=(("tokens_00000.bin", num_tokens),)
    )
    data = PreparedData(
        root=shards, tokenizer_path=shards, vocab_size=vocab, eos_id=0, num_tokens=num_tokens, streams=(info,), fingerprint="bench"
    )
    sampler = BatchSampler(data, seq_len=seq_len, global_batch_size=batch, seed=0)
    stream = data.open_stream(0)
    zero_copy = np.shares_memory(stream.slice(seq_len, 2 * seq_len + 1), stream._maps[0])
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += sampler.next_batch(dp_rank=0, dp_size=1).numel()
    return count / (time.perf_counter() - start), zero_copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size in MB of standard-library text")
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), mb=args.mb, vocab=args.vocab)


def run(tmp: Path, *, mb: float, vocab: int) -> None:
    corpus = make_corpus(tmp, mb=mb)
    size_mb = corpus.stat().st_size / 1e6
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    tokenizer = tmp / "tokenizer.json"
    train_bpe([texts], vocab_size=vocab).save(str(tokenizer))
    print(f"corpus: {len(texts)} documents, {size_mb:.1f} MB (.jsonl), vocab {vocab}, {multiprocessing.cpu_count()} cpus")
    del texts
    results = {name: measure(name, corpus, tokenizer, tmp / name) for name in ("ours", "baseline", "lists")}
    (t_ours, n_ours, rss_ours), (t_base, n_base, rss_base), (_, n_lists, rss_lists) = results.values()
    assert n_ours == n_base == n_lists, (n_ours, n_base, n_lists)
    print(f"tokens: {n_ours:,}")
    print(
        f"tokenize+pack  llmforge {size_mb / t_ours:6.2f} MB/s   datasets.map+tokenizers {size_mb / t_base:6.2f} MB/s"
        f"   ratio {t_base / t_ours:.2f}x (target >= 1)"
    )
    print(
        f"peak memory    llmforge {rss_ours:6.0f} MB     tokens in Python lists {rss_lists:6.0f} MB"
        f"     ratio {rss_ours / rss_lists:.2f} (lower is better)   [datasets.map baseline {rss_base:.0f} MB]"
    )
    for seq_len, batch in ((128, 8), (128, 64), (1024, 16)):
        rate, zero_copy = bench_sampler(tmp / "ours" / "shards", num_tokens=n_ours, vocab=vocab, seq_len=seq_len, batch=batch)
        print(
            f"sampler        seq_len {seq_len:5d} batch {batch:3d}: {rate / 1e6:6.1f} M tokens/s (target >= 1)"
            f"   zero-copy reads: {zero_copy}"
        )


if __name__ == "__main__":
    main()
