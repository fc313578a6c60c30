"""BatchSampler: determinism, dp shares, resume, mixtures, zero-copy reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmforge.config.schema import DataConfig
from llmforge.data.prepare import prepare
from llmforge.data.sampler import MIX_BLOCK, BatchSampler
from llmforge.errors import UserError

SEQ = 16
G = 8


def _jsonl(path: Path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    big = _jsonl(root / "big.jsonl", [f"alpha {i} beta gamma delta {i * i} epsilon\n" for i in range(300)])
    small = _jsonl(root / "small.jsonl", [f"zeta {i} eta" for i in range(20)])
    cache = str(root / "cache")
    single = prepare(data=DataConfig(path=big, cache_dir=cache), vocab_size=300, seed=0)
    mixed = prepare(data=DataConfig(mixture=[f"{big}:3", f"{small}:1"], cache_dir=cache), vocab_size=300, seed=0)
    return single, mixed


def _run(data, steps, *, seed, dp_size=1, batch=G, state=None):
    """Run steps with one sampler per dp rank (as ranks do); return batches, sequence ids, rank 0's sampler."""
    samplers = [BatchSampler(data, seq_len=SEQ, global_batch_size=batch, seed=seed) for _ in range(dp_size)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
    batches, ids = [], []
    for _ in range(steps):
        batches.append(torch.cat([s.next_batch(dp_rank=r, dp_size=dp_size) for r, s in enumerate(samplers)]))
        ids.append(np.concatenate([s.last_sequence_ids for s in samplers]))
    return torch.stack(batches), np.stack(ids), samplers[0]


def test_rows_are_windows_of_the_token_stream(corpus):
    data, _ = corpus
    sampler = BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=1)
    batch = sampler.next_batch(dp_rank=0, dp_size=1)
    assert batch.shape == (G, SEQ + 1) and batch.dtype == torch.int64
    tokens = np.asarray(data.open_stream(0).slice(0, data.num_tokens))
    for row, (_, _, window) in zip(batch.numpy(), sampler.last_sequence_ids, strict=False):
        assert np.array_equal(row, tokens[window * SEQ : window * SEQ + SEQ + 1])


def test_same_seed_same_order_other_seed_other_order(corpus):
    data, _ = corpus
    a, _, _ = _run(data, 5, seed=7)
    b, _, _ = _run(data, 5, seed=7)
    c, _, _ = _run(data, 5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_shares_are_disjoint_and_join_to_the_single_rank_batch(corpus, dp_size):
    data, _ = corpus
    whole, whole_ids, _ = _run(data, 6, seed=3)
    split, split_ids, _ = _run(data, 6, seed=3, dp_size=dp_size)
    assert torch.equal(whole, split) and np.array_equal(whole_ids, split_ids)
    sampler = BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=3)
    shares = [set(map(tuple, sampler.batch_ids(step=0, dp_rank=r, dp_size=dp_size))) for r in range(dp_size)]
    assert sum(len(s) for s in shares) == G and len(set().union(*shares)) == G


def test_an_epoch_visits_every_window_once(corpus):
    data, _ = corpus
    sampler = BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=5)
    m = sampler.num_sequences[0]
    ids = sampler.sequence_ids(start=0, count=2 * m)
    assert sorted(ids[:m, 2]) == list(range(m)) and set(ids[:m, 1]) == {0}
    assert sorted(ids[m:, 2]) == list(range(m)) and set(ids[m:, 1]) == {1}
    assert not np.array_equal(ids[:m, 2], ids[m:, 2])  # each epoch has its own shuffle
    covered = {int(w) for w in ids[:m, 2]}
    assert covered == set(range((data.num_tokens - 1) // SEQ))


def test_resume_mid_epoch_continues_the_exact_order_with_other_dp_and_batch(corpus):
    data, _ = corpus
    straight, straight_ids, _ = _run(data, 10, seed=11)
    _, first_ids, first = _run(data, 4, seed=11)
    state = first.state_dict()
    assert all(isinstance(v, (int, float, str)) for v in state.values())
    rest, rest_ids, _ = _run(data, 6, seed=999, dp_size=2, state=state)
    assert torch.equal(rest, straight[4:])
    assert np.array_equal(np.concatenate([first_ids, rest_ids]), straight_ids)
    wider, _, _ = _run(data, 1, seed=0, batch=2 * G, state=state)
    assert torch.equal(wider[0], straight[4:6].reshape(2 * G, SEQ + 1))


def test_state_survives_weights_only_checkpoint_loading(corpus, tmp_path):
    data, _ = corpus
    _, _, sampler = _run(data, 3, seed=2)
    torch.save({"sampler": sampler.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)["sampler"]
    assert state == sampler.state_dict() and state["position"] == 3 * G


def test_resume_with_other_seq_len_or_data_is_refused(corpus):
    single, mixed = corpus
    state = BatchSampler(single, seq_len=SEQ, global_batch_size=G, seed=0).state_dict()
    with pytest.raises(UserError, match="seq_len"):
        BatchSampler(single, seq_len=SEQ * 2, global_batch_size=G, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="differs"):
        BatchSampler(mixed, seq_len=SEQ, global_batch_size=G, seed=0).load_state_dict(state)


def test_mixture_follows_the_weights_and_repeats_the_small_dataset(corpus):
    _, mixed = corpus
    sampler = BatchSampler(mixed, seq_len=SEQ, global_batch_size=G, seed=4)
    ids = sampler.sequence_ids(start=0, count=2 * MIX_BLOCK)
    share = np.bincount(ids[:, 0], minlength=2) / len(ids)
    assert share == pytest.approx([0.75, 0.25], abs=1e-3)
    small = ids[ids[:, 0] == 1]
    m = sampler.num_sequences[1]
    assert small[:, 1].max() >= 2  # several epochs of the small dataset
    assert sorted(small[:m, 2]) == list(range(m))
    again = BatchSampler(mixed, seq_len=SEQ, global_batch_size=G, seed=4).sequence_ids(start=0, count=2 * MIX_BLOCK)
    assert np.array_equal(ids, again)


def test_mixture_resume_and_dp_split(corpus):
    _, mixed = corpus
    straight, _, _ = _run(mixed, 8, seed=6)
    _, _, first = _run(mixed, 3, seed=6)
    rest, _, _ = _run(mixed, 5, seed=6, dp_size=4, state=first.state_dict())
    assert torch.equal(rest, straight[3:])
    assert set(np.unique(_run(mixed, 40, seed=6)[1][:, :, 0])) == {0, 1}


def test_reads_are_views_of_the_memory_map(corpus):
    data, _ = corpus
    stream = data.open_stream(0)
    piece = stream.slice(5, 5 + SEQ + 1)
    assert isinstance(piece.base, np.memmap) or isinstance(piece, np.memmap)
    assert np.shares_memory(piece, stream._maps[0])


def test_too_little_data_for_one_sequence_is_a_user_error(corpus):
    data, _ = corpus
    with pytest.raises(UserError, match="seq_len"):
        BatchSampler(data, seq_len=data.num_tokens, global_batch_size=G, seed=0)


def test_dp_size_must_divide_the_global_batch(corpus):
    data, _ = corpus
    with pytest.raises(ValueError, match="divisible"):
        BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=0).next_batch(dp_rank=0, dp_size=3)
