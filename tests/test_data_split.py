"""The held-out validation split: disjoint documents, fixed by its seed, both streams resumable."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmforge.config.schema import DataConfig
from llmforge.data.prepare import prepare
from llmforge.data.sampler import BatchSampler
from llmforge.data.split import MAX_DOCUMENTS, held_out, held_out_count, held_out_masks
from llmforge.errors import UserError

SEQ, G, FRACTION = 16, 8, 0.1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 7 + 3)}) + "\n" for i in range(200)))
    return prepare(data=DataConfig(path=str(path), cache_dir=str(root / "cache")), vocab_size=300, seed=0)


def sampler(data, split: str, **kw) -> BatchSampler:
    kw = {"val_fraction": FRACTION, "val_seed": 3, **kw}
    return BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=1, split=split, **kw)


def documents(data) -> list:
    return [np.asarray(d) for d in data.open_stream(0).documents()]


def rows(s: BatchSampler, steps: int, dp_size: int = 1) -> np.ndarray:
    """The next ``steps`` global batches, read rank by rank as ``dp_size`` ranks would."""
    out = []
    for _ in range(steps):
        start = s.position
        for r in range(dp_size):
            s.position = start
            out.append(s.next_batch(dp_rank=r, dp_size=dp_size).numpy())
    return np.concatenate(out)


def test_each_split_reads_only_its_own_documents(data):
    docs = documents(data)
    mask = held_out(data.open_stream(0).doc_ends(), fraction=FRACTION, seed=3, stream=0, min_tokens=SEQ + 1)
    assert mask.sum() == round(FRACTION * len(docs))
    train_text = np.concatenate([d for d, m in zip(docs, mask, strict=False) if not m])
    val_text = np.concatenate([d for d, m in zip(docs, mask, strict=False) if m])
    for split, text in (("train", train_text), ("val", val_text)):
        s = sampler(data, split)
        assert s.num_sequences[0] == (len(text) - 1) // SEQ
        for row, (_, _, window) in zip(rows(s, 3), np.concatenate([s.batch_ids(step=k) for k in range(3)]), strict=False):
            assert np.array_equal(row, text[window * SEQ : window * SEQ + SEQ + 1])
    # the token ranges the two sides read never overlap, and together they are the whole stream
    ranges = sorted(map(tuple, np.concatenate([sampler(data, sp)._streams[0].source_ranges() for sp in ("train", "val")])))
    assert ranges[0][0] == 0 and ranges[-1][1] == data.num_tokens
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_held_out_set_depends_on_val_seed_only(data):
    a, b = sampler(data, "val"), sampler(data, "val")
    assert np.array_equal(a._streams[0].source_ranges(), b._streams[0].source_ranges())
    other = sampler(data, "val", val_seed=4)
    assert not np.array_equal(a._streams[0].source_ranges(), other._streams[0].source_ranges())
    # the training seed (data order) does not move it
    assert np.array_equal(
        BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=99, split="val", val_fraction=FRACTION, val_seed=3)
        ._streams[0]
        .source_ranges(),
        a._streams[0].source_ranges(),
    )


@pytest.mark.parametrize("split", ["train", "val"])
def test_both_streams_visit_every_window_once_and_resume_on_any_dp(data, split):
    s = sampler(data, split)
    m = s.num_sequences[0]
    epoch = s.sequence_ids(start=0, count=m)
    assert sorted(epoch[:, 2]) == list(range(m))
    straight = rows(sampler(data, split), 6)
    first = sampler(data, split)
    rows(first, 2)
    resumed = sampler(data, split)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert np.array_equal(rows(resumed, 4, dp_size=2), straight[2 * G :])


def test_resume_with_another_split_is_refused(data):
    state = sampler(data, "train").state_dict()
    with pytest.raises(UserError, match="data.val_fraction=0.1"):
        sampler(data, "train", val_fraction=0.2).load_state_dict(state)
    with pytest.raises(UserError, match="data.val_seed=3"):
        sampler(data, "train", val_seed=5).load_state_dict(state)
    plain = BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=1).state_dict()
    with pytest.raises(UserError, match="data.val_fraction=0.0"):
        sampler(data, "train").load_state_dict(plain)


def test_too_few_held_out_tokens_name_the_fraction(data):
    with pytest.raises(UserError, match="data.val_fraction"):
        BatchSampler(data, seq_len=SEQ * 40, global_batch_size=G, seed=1, split="val", val_fraction=0.005, val_seed=0)


def test_how_many_documents_are_held_out():
    assert [held_out_count(n, fraction=0.01) for n in (1, 9, 10, 149, 151, 557)] == [0, 0, 1, 1, 2, 6]
    assert held_out_count(10**7, fraction=0.01) == MAX_DOCUMENTS  # a large corpus trains on the rest
    assert [held_out_count(n, fraction=0.5) for n in (1, 2, 4)] == [0, 1, 2]  # a fraction asking for documents gets them
    assert held_out_count(100, fraction=0.0) == 0


def test_held_out_documents_grow_to_one_sequence_or_none_are_held_out(data):
    ends = np.asarray(data.open_stream(0).doc_ends())
    lengths = np.diff(ends, prepend=0)
    grown = held_out(ends, fraction=0.005, seed=0, stream=0, min_tokens=65)
    assert 1 < grown.sum() <= 20 and lengths[grown].sum() >= 65
    first = held_out(ends, fraction=0.005, seed=0, stream=0, min_tokens=1)
    assert first.sum() == 1 and grown[first].all()  # grown from the same seeded order
    assert not held_out(ends, fraction=0.005, seed=0, stream=0, min_tokens=SEQ * 40 + 1).any()
    # then the training side keeps every document and says none are held out
    train = BatchSampler(data, seq_len=SEQ * 40, global_batch_size=G, seed=1, val_fraction=0.005)
    assert train.held_out_documents == [0] and train._streams[0].num_tokens == data.num_tokens


def test_every_dataset_or_none_holds_documents_out():
    big, small = np.arange(1, 101) * 50, np.array([10, 20, 30])
    masks = held_out_masks([big, big], fraction=0.05, seed=0, min_tokens=33)
    assert [int(m.sum()) for m in masks] == [5, 5]
    assert not any(m.any() for m in held_out_masks([big, small], fraction=0.05, seed=0, min_tokens=33))


def test_resume_of_a_split_chosen_by_an_earlier_rule_is_refused(data):
    state = sampler(data, "train").state_dict()
    del state["split_rule"]  # what a checkpoint of the first rule holds
    with pytest.raises(UserError, match="earlier llmforge version"):
        sampler(data, "train").load_state_dict(state)
    plain = BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=1).state_dict()
    del plain["split_rule"]  # nothing held out: nothing to disagree on
    BatchSampler(data, seq_len=SEQ, global_batch_size=G, seed=1).load_state_dict(plain)
