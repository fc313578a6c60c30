"""llmforge's model as an lm-eval model: multiple choice, rolling log-likelihood and generation
on tasks the tests write (local JSON lines, no hub), with a tiny model trained in this process
on the facts those tasks ask about."""

from __future__ import annotations

import math

import pytest
import torch
from eval_tasks import COLORS, FACTS, SUBJECTS, write_corpus, write_tasks

from llmforge.config.compose import compose
from llmforge.config.eval_config import EvalConfig
from llmforge.config.schema import GenerateConfig
from llmforge.data.prepare import prepare
from llmforge.generate import generate_ids
from llmforge.models.gpt import GPT
from llmforge.train.loss import cross_entropy

pytest.importorskip("lm_eval")

from llmforge.evaluate.lm import harness_model  # noqa: E402
from llmforge.evaluate.tasks import load_tasks, run_tasks  # noqa: E402

SHAPE = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=48",
    "model.vocab_size=320",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_cache):
    """(config, tokenizer, eos id, task folder, trained model, untrained model)."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("facts")
    corpus, tasks = write_corpus(folder), write_tasks(folder / "tasks")
    config = compose([*SHAPE, f"data.path={corpus}", f"data.cache_dir={data_cache}"])
    prepared = prepare(data=config.data, vocab_size=config.model.vocab_size, seed=0)
    tok = Tokenizer.from_file(str(prepared.tokenizer_path))
    torch.manual_seed(0)
    untrained = GPT(config.model).eval()
    trained = _train(GPT(config.model), tok=tok, eos_id=prepared.eos_id, seq_len=config.model.seq_len)
    return config, tok, prepared.eos_id, tasks, trained, untrained


def _train(model: torch.nn.Module, *, tok, eos_id: int, seq_len: int, steps: int = 150) -> torch.nn.Module:
    """A few hundred AdamW steps on the facts, shuffled into one token stream."""
    import random

    rnd = random.Random(0)
    ids: list[int] = []
    for _ in range(200):
        ids += tok.encode(" ".join(rnd.sample(FACTS, 4))).ids + [eos_id]
    data = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (8,), generator=gen)
        batch = torch.stack([data[s : s + seq_len + 1] for s in starts])
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def lm_of(setup, model, *, batch_size: int = 8):
    config, tok, eos_id, *_ = setup
    return harness_model(model=model, tokenizer=tok, eos_id=eos_id, seq_len=config.model.seq_len, batch_size=batch_size)


def evaluate(setup, model, tasks: list[str], **kw) -> dict:
    folder = setup[3]
    loaded = load_tasks(EvalConfig(tasks=tasks, include_path=[str(folder)]))
    return run_tasks(lm_of(setup, model, **kw), loaded, limit=None)["results"]


def test_multiple_choice_trained_scores_above_chance_untrained_near_it(setup):
    trained, untrained = setup[4], setup[5]
    assert evaluate(setup, trained, ["facts_mc"])["facts_mc"]["acc,none"] >= 0.75  # chance: 0.25 (4 choices)
    assert evaluate(setup, untrained, ["facts_mc"])["facts_mc"]["acc,none"] <= 0.5


def test_batched_scores_equal_one_request_at_a_time(setup):
    from lm_eval.api.instance import Instance

    requests = [Instance("loglikelihood", {}, (f"{s} is", f" {c}"), i) for i, (s, c) in enumerate(zip(SUBJECTS, COLORS, strict=True))]
    one = lm_of(setup, setup[4], batch_size=1).loglikelihood(requests)
    batched = lm_of(setup, setup[4], batch_size=8).loglikelihood(requests)
    assert [x[1] for x in one] == [x[1] for x in batched]
    assert [x[0] for x in one] == pytest.approx([x[0] for x in batched], abs=1e-4)


def test_rolling_loglikelihood_equals_the_models_own_loss(setup):
    """byte_perplexity is exp(-total log-likelihood / bytes): the total is llmforge's summed loss."""
    import json

    config, tok, eos_id, folder, trained, _ = setup
    texts = [json.loads(line)["text"] for line in (folder / "text.jsonl").read_text().splitlines()]
    own = 0.0
    for text in texts:
        ids = tok.encode(text).ids
        assert len(ids) < config.model.seq_len  # one window each
        tokens = torch.tensor([[eos_id, *ids]])
        with torch.no_grad():
            own += float(cross_entropy(trained(tokens[:, :-1]), tokens[:, 1:])) * len(ids)
    result = evaluate(setup, trained, ["facts_text"])["facts_text"]
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert math.log(result["byte_perplexity,none"]) * total_bytes == pytest.approx(own, rel=1e-5)


def test_generate_until_continues_with_the_kv_cache_as_generate_does(setup):
    config, tok, eos_id, _, trained, _ = setup
    result = evaluate(setup, trained, ["facts_gen"])["facts_gen"]
    assert result["exact_match,none"] >= 0.75
    from lm_eval.api.instance import Instance

    settings = {"until": ["."], "max_gen_toks": 6, "do_sample": False}
    got = lm_of(setup, trained).generate_until([Instance("generate_until", {}, ("the sky is", settings), 0)])
    expected = generate_ids(
        trained,
        tok.encode("the sky is").ids,
        settings=GenerateConfig(max_tokens=6, temperature=0.0),
        seq_len=config.model.seq_len,
        eos_id=eos_id,
        device=torch.device("cpu"),
    )
    assert got == [tok.decode(expected).split(".")[0]] and got[0].strip() == "blue"
