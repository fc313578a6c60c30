"""With a data.mixture, the validation loss of each dataset beside the mixture's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from eval_tasks import write_corpus

from llmforge.config.compose import compose
from llmforge.data.prepare import prepare
from llmforge.data.sampler import BatchSampler
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "model.vocab_size=320",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.steps=2",
    "train.eval_steps=2",
    "data.val_fraction=0.05",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, data_cache) -> list[str]:
    folder = tmp_path_factory.mktemp("mixture")
    facts = write_corpus(folder)
    numbers = folder / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": " ".join(str(i * k % 97) for k in range(30))}) + "\n" for i in range(200)))
    return [f"data.mixture=[{facts}:3,{numbers}:1]", f"data.cache_dir={data_cache}"]


def test_a_dataset_alone_draws_only_its_own_held_out_sequences(mixture):
    config = compose([*TINY, *mixture])
    prepared = prepare(data=config.data, vocab_size=config.model.vocab_size, seed=0)
    for index in range(2):
        sampler = BatchSampler(prepared, seq_len=32, global_batch_size=64, seed=0, split="val", val_fraction=0.05, only_stream=index)
        sampler.next_batch(dp_rank=0, dp_size=1)
        assert np.all(sampler.last_sequence_ids[:, 0] == index)


def test_val_loss_is_reported_per_dataset(mixture, tmp_path):
    run(RunPlan.build(compose([*TINY, *mixture, f"run.dir={tmp_path}"])), rank=RankInfo())
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    per_source = {k: v for k, v in last.items() if k.startswith("val_loss/")}
    assert sorted(per_source) == ["val_loss/facts", "val_loss/numbers"]
    assert all(math.isfinite(v) for v in per_source.values())
    assert per_source["val_loss/facts"] != per_source["val_loss/numbers"] and "val_loss" in last
