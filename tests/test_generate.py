"""llmforge generate and the tokenizer in the export, checked against transformers."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.schema import GenerateConfig
from llmforge.generate import checkpoint_config, filter_logits, generate_ids, load_model, next_token, run_tokenizer

transformers = pytest.importorskip("transformers")

runner = CliRunner()
PROMPT = "def main("


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_data):
    """A briefly trained tiny GPT-2-style run and its Hugging Face export."""
    tmp = tmp_path_factory.mktemp("gen")
    args = [
        "pretrain",
        *small_data,
        f"run.dir={tmp / 'run'}",
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.ffn_hidden_size=64",
        "model.seq_len=32",
        "train.steps=4",
        "train.lr=1e-2",
        "optim.warmup_steps=0",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["export", f"ckpt={tmp / 'run'}", "--out", str(tmp / "hf")])
    assert result.exit_code == 0, result.output
    return tmp / "run", tmp / "hf"


@pytest.fixture(scope="module")
def loaded(trained):
    path, config = checkpoint_config([f"ckpt={trained[0]}"])
    tok, eos_id = run_tokenizer(config, tokenizer=None, console=None)
    return load_model(path, config=config, device=torch.device("cpu")), tok, eos_id, config


def ours(loaded, settings: GenerateConfig) -> tuple[list[int], list[int]]:
    model, tok, eos_id, config = loaded
    prompt = tok.encode(PROMPT).ids
    return prompt, generate_ids(model, prompt, settings=settings, seq_len=config.model.seq_len, eos_id=eos_id, device=torch.device("cpu"))


def test_transformers_loads_the_export_with_its_tokenizer(trained, loaded):
    _, hf = trained
    _, tok, eos_id, _ = loaded
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    text = "import os\nprint(os.getcwd())"
    assert theirs(text)["input_ids"] == tok.encode(text).ids
    assert theirs.eos_token_id == eos_id and theirs.decode(tok.encode(text).ids) == text
    assert type(transformers.AutoModelForCausalLM.from_pretrained(hf)).__name__ == "GPT2LMHeadModel"


def test_greedy_generation_equals_transformers_greedy_generate(trained, loaded):
    run, hf = trained
    prompt, generated = ours(loaded, GenerateConfig(max_tokens=20, temperature=0.0))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
    )
    theirs = out[0, len(prompt) :].tolist()
    if theirs and theirs[-1] == tokenizer.eos_token_id:  # transformers keeps the stop token; llmforge drops it
        theirs = theirs[:-1]
    assert generated == theirs and len(generated) > 0

    result = runner.invoke(app, ["generate", f"ckpt={run}", "--prompt", PROMPT, "generate.temperature=0", "generate.max_tokens=20"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == PROMPT + tokenizer.decode(theirs, skip_special_tokens=True)


def test_sampling_follows_seed_top_k_and_top_p(loaded):
    greedy = ours(loaded, GenerateConfig(max_tokens=8, temperature=0.0, stop_at_eos=False))[1]
    assert ours(loaded, GenerateConfig(max_tokens=8, top_k=1, seed=3, stop_at_eos=False))[1] == greedy
    assert ours(loaded, GenerateConfig(max_tokens=8, top_p=1e-6, seed=4, stop_at_eos=False))[1] == greedy
    first = ours(loaded, GenerateConfig(max_tokens=8, temperature=2.0, seed=5, stop_at_eos=False))[1]
    assert ours(loaded, GenerateConfig(max_tokens=8, temperature=2.0, seed=5, stop_at_eos=False))[1] == first
    assert first != ours(loaded, GenerateConfig(max_tokens=8, temperature=2.0, seed=6, stop_at_eos=False))[1]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).log_softmax(-1)  # probs ~ .64 .24 .09 .03
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.5)).tolist() == [True, False, False, False]
    assert next_token(logits, settings=GenerateConfig(temperature=0.0), generator=torch.Generator()) == 0


def test_bad_settings_and_overrides_exit_2(trained):
    run, _ = trained
    result = runner.invoke(app, ["generate", f"ckpt={run}", "--prompt", "x", "generate.top_p=0", "generate.temperature=-1"])
    assert result.exit_code == 2 and "generate.top_p" in result.output and "generate.temperature" in result.output
    result = runner.invoke(app, ["generate", f"ckpt={run}", "--prompt", "x", "train.steps=3"])
    assert result.exit_code == 2 and "generate takes only" in result.output


def test_the_kv_cache_generates_the_ids_of_full_recomputation(loaded):
    """Greedy: the prompt and 40 new tokens overrun the 32 positions, so the cache is rebuilt once
    (from the last half window): the ids agree up to there."""
    within = 32 - len(loaded[1].encode(PROMPT).ids)
    cached = ours(loaded, GenerateConfig(max_tokens=within, temperature=0.0, stop_at_eos=False))[1]
    full = ours(loaded, GenerateConfig(max_tokens=within, temperature=0.0, stop_at_eos=False, kv_cache=False))[1]
    assert cached == full and len(cached) == within
    longer = ours(loaded, GenerateConfig(max_tokens=40, temperature=0.0, stop_at_eos=False))[1]
    assert len(longer) == 40 and longer[:within] == cached


def test_the_cache_rebuild_continues_from_the_last_half_window():
    """Past model.seq_len positions the cached generation must equal a cache-free one whose
    context restarts, at the same tokens, from the last half window: a rebuild from anything
    else (the last token alone, the whole text) gives other ids on a random model."""
    from llmforge.models.gpt import GPT
    from llmforge.testing.harness import tiny_plan

    config = tiny_plan(["model.init_std=0.5"]).config.model
    model = GPT(config).eval()
    model.init_weights(seed=3)
    seq_len, prompt = config.seq_len, torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ids, start, want = list(prompt), 0, []
    with torch.no_grad():
        for _ in range(3 * seq_len):  # several rebuilds
            context = ids[start:]
            token = int(torch.argmax(model(torch.tensor([context]))[0, -1]))
            ids.append(token)
            want.append(token)
            if len(context) >= seq_len:
                start = len(ids) - seq_len // 2
    settings = GenerateConfig(max_tokens=3 * seq_len, temperature=0.0, stop_at_eos=False)
    got = generate_ids(model, prompt, settings=settings, seq_len=seq_len, eos_id=None, device=torch.device("cpu"))
    assert got == want
    assert len(set(want)) > 20  # the model's ids follow its context, so a wrong one shows


@pytest.mark.parametrize("window", [0, 5])
def test_cached_logits_equal_the_whole_sequence_forward_and_a_window_bounds_the_cache(window):
    from llmforge.models.gpt import GPT
    from llmforge.models.kvcache import KVCache
    from llmforge.testing.harness import tiny_plan

    every = ["model.sliding_window_every=2"] if window else []
    config = tiny_plan(["model.position=rope", "model.num_kv_heads=2", f"model.sliding_window={window}", *every]).config.model
    model = GPT(config).eval()
    model.init_weights(seed=1)
    tokens = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(config)
        steps = [model(tokens[:, :6], cache=cache)[0]] + [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(6, 24)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)
    held = [0 if layer.keys is None else layer.keys.shape[2] for layer in cache.layers]
    assert held == ([window - 1, 24, window - 1, 24] if window else [24] * 4)
    assert all(layer.keys.shape[1] == 2 for layer in cache.layers)  # grouped-query heads stored once


def test_prompts_file_writes_one_json_line_each(trained, tmp_path):
    import json

    run, _ = trained
    (tmp_path / "prompts.txt").write_text("def main(\n\nimport os\n", encoding="utf-8")
    out = tmp_path / "out" / "completions.jsonl"
    result = runner.invoke(
        app,
        [
            "generate",
            f"ckpt={run}",
            "--prompts",
            str(tmp_path / "prompts.txt"),
            "--out",
            str(out),
            "generate.temperature=0",
            "generate.max_tokens=5",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def main(", "import os"] and all(isinstance(r["completion"], str) for r in rows)
    assert "tokens/s" in result.stderr
    single = runner.invoke(app, ["generate", f"ckpt={run}", "--prompt", "import os", "generate.temperature=0", "generate.max_tokens=5"])
    assert single.stdout.rstrip("\n") == "import os" + rows[1]["completion"]
    both = runner.invoke(app, ["generate", f"ckpt={run}", "--prompt", "x", "--prompts", str(tmp_path / "prompts.txt")])
    assert both.exit_code == 2 and "exactly one of --prompt" in both.output
