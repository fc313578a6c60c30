"""Nothing lost, nothing silently wrong: a resume never takes over or overwrites another
run, an incomplete metrics line is dropped, a plan.json this version does not accept
is named key by key, and a refused save says why (one process, tiny models)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmforge.checkpoint.manifest import write_manifest
from llmforge.checkpoint.resume import plan_for_resume
from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.observe.metrics import read_metrics, tidy_metrics
from llmforge.plan import RunPlan
from llmforge.testing.faults import file_size_limit
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
    "train.log_interval=1",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=1",
]
runner = CliRunner()


def invoke(*args: str) -> str:
    """Run the CLI; it must end in one user error (exit 2, no traceback). Returns its output on one line."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    return " ".join(result.output.split())


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes (to show a refusal changed nothing)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """Run A (hidden 32, a checkpoint at step 2) and run B (hidden 64, a checkpoint at step 4)."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (
        ("a", ["train.steps=2", "checkpoint.interval=2"]),
        ("b", ["model.hidden_size=64", "train.steps=4", "checkpoint.interval=4"]),
    ):
        run(RunPlan.build(compose([*TINY, *small_data, *extra, f"run.dir={root / name}"])), rank=RankInfo())
    return root / "a", root / "b"


def copy_of(run_dir: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(run_dir, target)
    return target


def test_a_checkpoint_copied_in_from_another_run_is_refused(runs, tmp_path):
    a, b = runs
    victim = copy_of(a, tmp_path)
    shutil.copytree(b / "checkpoints" / "step_4", victim / "checkpoints" / "step_4")  # now the newest in the folder
    before = snapshot(victim)
    with pytest.raises(UserError) as info:
        plan_for_resume([f"ckpt={victim}", "train.steps=6"])
    message = info.value.message()
    assert f"{victim / 'checkpoints' / 'step_4'} is a checkpoint of another run than {victim}" in message
    assert f"model.hidden_size = 64: the checkpoint has 64, {victim / 'plan.json'} has 32" in message and "--from-other-run" in message
    assert "--from-other-run" in invoke("resume", f"ckpt={victim}", "train.steps=6")
    with pytest.raises(UserError, match="--from-other-run starts a new run"):
        plan_for_resume([f"ckpt={victim}", "train.steps=6"], from_other_run=True)  # not into the folder of the run it would take over
    assert snapshot(victim) == before
    plan, path = plan_for_resume([f"ckpt={victim}", "train.steps=6", f"run.dir={tmp_path / 'new'}"], from_other_run=True)
    assert path == victim / "checkpoints" / "step_4" and plan.config.model.hidden_size == 64 and plan.run_dir == tmp_path / "new"


def test_a_checkpoint_of_its_own_run_resumes_as_before(runs, tmp_path):
    a, _ = runs
    own = copy_of(a, tmp_path)  # a copied run folder is still one run
    plan, path = plan_for_resume([f"ckpt={own}", "train.steps=3", "model.dropout=0.1"])
    assert path == own / "checkpoints" / "step_2" and plan.run_dir == own


def test_resume_into_a_folder_holding_another_run_is_refused_like_pretrain(runs, tmp_path, monkeypatch):
    a, b = runs
    victim = copy_of(a, tmp_path, "victim")
    before = snapshot(victim)
    monkeypatch.chdir(tmp_path)
    refused = invoke("resume", f"ckpt={b}", "train.steps=6", f"run.dir={victim}")
    pretrain = invoke("pretrain", *TINY, f"run.dir={victim}")
    rule = f"run.dir={victim} already holds a run (metrics.jsonl, checkpoints); continue it with `llmforge resume ckpt={victim}`"
    assert rule in refused and rule in pretrain
    assert snapshot(victim) == before


def test_metrics_readers_skip_and_tidy_drops_an_incomplete_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    notes = tidy_metrics(path)
    assert len(notes) == 1 and "dropped its last line, which is incomplete" in notes[0] and '{"step": 3, "lo' in notes[0]
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}')  # complete but unterminated: kept, and terminated
    assert tidy_metrics(path, after_step=2) == [] and path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert tidy_metrics(path) == [] and path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resume_after_a_write_cut_short_appends_clean_lines(runs, tmp_path):
    a, _ = runs
    own = copy_of(a, tmp_path)
    with (own / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "loss": 7.')
    plan, path = plan_for_resume([f"ckpt={own}", "train.steps=3"])
    out = io.StringIO()
    run(plan, rank=RankInfo(), resume_from=path, console=Console(file=out, width=300))
    lines = (own / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # every line parses
    assert "dropped its last line, which is incomplete" in out.getvalue()


def _edit_plan(folder: Path, *, checkpoint: bool) -> Path:
    """Write into a plan.json a key and a value type this version does not accept
    (for a checkpoint, with a manifest to match: as another llmforge version would)."""
    path = folder / "plan.json"
    data = json.loads(path.read_text())
    data["config"]["model"]["flash"] = True
    data["config"]["train"]["steps"] = "many"
    path.write_text(json.dumps(data))
    if checkpoint:
        write_manifest(folder, step=json.loads((folder / "train_state.json").read_text())["step"])
    return path


def test_a_plan_json_this_version_does_not_accept_names_file_key_and_type(runs, tmp_path):
    a, _ = runs
    folder = copy_of(a, tmp_path)
    run_plan = _edit_plan(folder, checkpoint=False)
    expected = (
        "model.flash = True: this version of llmforge has no such key",
        "train.steps = 'many': this version of llmforge expects an integer",
    )
    for args in (["estimate", "--plan", str(run_plan)], ["resume", f"ckpt={folder}", "train.steps=5"]):
        out = invoke(*args)
        assert all(text in out for text in expected) and f"(in {run_plan})" in out, out
    step_plan = _edit_plan(folder / "checkpoints" / "step_2", checkpoint=True)
    out = invoke("export", f"ckpt={folder / 'checkpoints' / 'step_2'}", "--out", str(tmp_path / "hf"))
    assert all(text in out for text in expected) and f"(in {step_plan})" in out, out
    assert not (tmp_path / "hf").exists()


def test_generate_names_its_tokenizer_option(runs):
    a, _ = runs
    out = invoke("generate", f"ckpt={a}", "--prompt", "x", "--tokenizer", "missing.json")
    assert "--tokenizer = 'missing.json': no such file" in out and "data.tokenizer" not in out


def _refused_save(root: Path, *, earlier_checkpoint: bool) -> str:
    """Save a tiny model's checkpoint under a 4 KiB file-size limit; the error's message."""
    from test_checkpoint_store import save, saver, tiny

    model, optimizer = tiny()
    s = saver(root)
    earlier = [save(s, model, optimizer, 1)] if earlier_checkpoint else []
    with file_size_limit(4096), pytest.raises(UserError) as info:  # files past 4 KiB fail, as on a full disk
        save(s, model, optimizer, 2)
    assert [p.name for p in root.iterdir()] == [p.name for p in earlier]
    return " ".join(info.value.message().split())


def test_a_refused_save_names_the_cause_and_suggests_resume_only_with_a_checkpoint(tmp_path):
    with_earlier = _refused_save(tmp_path / "with-earlier", earlier_checkpoint=True)
    first = _refused_save(tmp_path / "first", earlier_checkpoint=False)
    for message in (with_earlier, first):
        assert "CheckpointException" not in message and "at most 4,096 bytes: the file-size limit, `ulimit -f`" in message
        assert "raise the file-size limit (`ulimit -f unlimited`)" in message
    assert "then resume: `llmforge resume ckpt=" in with_earlier
    assert "nothing to resume" in first and "resume ckpt" not in first and "--overwrite" in first
