"""Outputs that cannot damage inputs: export and generate never write into a run's
checkpoints or over its files, and an output that is one of the inputs is refused,
before any work, with nothing written (one process, tiny model)."""

from __future__ import annotations

import pytest
from test_run_safety import invoke as refused
from test_run_safety import snapshot
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=1",
    "train.steps=2",
    "checkpoint.interval=1",
]
runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_data):
    """A run with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("outputs")
    run(RunPlan.build(compose([*TINY, *small_data, f"run.dir={root / 'run'}"])), rank=RankInfo())
    return root / "run"


@pytest.mark.parametrize("where", ["checkpoints/step_2", "checkpoints/step_2/sub", "checkpoints/hf", "checkpoints"])
def test_export_into_a_runs_checkpoints_is_refused_and_changes_nothing(trained, where):
    before = snapshot(trained)
    text = refused("export", f"ckpt={trained}", "--out", str(trained / where))
    assert "--out" in text and "checkpoints" in text and str(trained / "export") in text
    assert snapshot(trained) == before


def test_generate_into_a_checkpoint_or_over_a_run_file_is_refused(trained, tmp_path):
    (tmp_path / "p.txt").write_text("def main(\n", encoding="utf-8")
    before = snapshot(trained)
    for target in (trained / "checkpoints" / "step_2" / "out.jsonl", trained / "metrics.jsonl", trained / "plan.json"):
        text = refused("generate", f"ckpt={trained}", "--prompts", str(tmp_path / "p.txt"), "--out", str(target), "generate.max_tokens=2")
        assert "--out" in text and "Fix:" in text
    assert snapshot(trained) == before


def test_generate_out_that_is_the_prompts_file_or_a_folder_is_refused(trained, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def main(\n", encoding="utf-8")
    text = refused("generate", f"ckpt={trained}", "--prompts", str(prompts), "--out", str(prompts), "generate.max_tokens=2")
    assert "--prompts file this command reads" in text
    (tmp_path / "link.txt").symlink_to(prompts)
    refused("generate", f"ckpt={trained}", "--prompts", str(tmp_path / "link.txt"), "--out", str(prompts), "generate.max_tokens=2")
    assert prompts.read_text(encoding="utf-8") == "def main(\n"
    text = refused("generate", f"ckpt={trained}", "--prompt", "x", "--out", str(tmp_path), "generate.max_tokens=2")
    assert "is a folder" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "p.txt"]


def test_export_and_generate_beside_the_run_still_work(trained, tmp_path):
    result = runner.invoke(app, ["export", f"ckpt={trained}", "--out", str(trained / "export")])
    assert result.exit_code == 0, result.output
    modes = {p.name: p.stat().st_mode & 0o777 for p in (trained / "export").iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] == (trained / "plan.json").stat().st_mode & 0o777, modes
    out = tmp_path / "with space é" / "out.jsonl"
    result = runner.invoke(app, ["generate", f"ckpt={trained}", "--prompt", "x", "--out", str(out), "generate.max_tokens=2"])
    assert result.exit_code == 0, result.output
    assert out.is_file()


def test_a_prompt_longer_than_the_context_is_said(trained):
    result = runner.invoke(
        app, ["generate", f"ckpt={trained}", "--prompt", "def main(x, y, z): return x + y + z " * 8, "generate.max_tokens=2"]
    )
    assert result.exit_code == 0, result.output
    assert "longer than the model's 16 positions (model.seq_len)" in " ".join(result.stderr.split())
    short = runner.invoke(app, ["generate", f"ckpt={trained}", "--prompt", "def", "generate.max_tokens=2"])
    assert "longer than" not in short.stderr


@pytest.mark.parametrize(
    "extreme",
    [
        ["generate.temperature=1e-300"],
        ["generate.temperature=5e-324"],
        ["generate.top_p=1e-300"],
        ["generate.temperature=1e308"],
        ["generate.top_k=99999999999"],
    ],
)
def test_extreme_sampling_settings_end_cleanly(trained, extreme):
    """A temperature or top_p next to 0 samples the greedy token; a huge one stays a valid draw."""
    args = ["generate", f"ckpt={trained}", "--prompt", "def main(", "generate.max_tokens=4", "generate.stop_at_eos=false", *extreme]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    if "1e308" not in extreme[0] and "top_k" not in extreme[0]:
        greedy = runner.invoke(
            app,
            [
                "generate",
                f"ckpt={trained}",
                "--prompt",
                "def main(",
                "generate.max_tokens=4",
                "generate.stop_at_eos=false",
                "generate.temperature=0",
            ],
        )
        assert result.stdout == greedy.stdout


def test_an_export_replaces_its_folder_whole_and_refuses_a_folder_of_other_files(trained, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "quantized.safetensors").write_bytes(b"a previous export's quantized model")
    (out / "quantization.json").write_text("{}")
    result = runner.invoke(app, ["export", f"ckpt={trained}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "quantized.safetensors").exists() and not (out / "quantization.json").exists()
    assert (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    text = refused("export", f"ckpt={trained}", "--out", str(mine))
    assert "holds files an export does not write (notes.txt)" in text
    assert snapshot(mine) == {"notes.txt": b"not an export"}
    example = text.split("e.g. --out ")[1].split()[0]
    assert runner.invoke(app, ["export", f"ckpt={trained}", "--out", example]).exit_code == 0
