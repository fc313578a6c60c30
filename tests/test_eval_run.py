"""Evaluations in the training loop and ``llmforge eval`` on a run's checkpoints (one process,
tasks written by the tests)."""

from __future__ import annotations

import json
import shutil

import pytest
from eval_tasks import write_corpus, write_tasks
from typer.testing import CliRunner

from llmforge.checkpoint.resume import plan_for_resume
from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run

pytest.importorskip("lm_eval")

runner = CliRunner()
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "model.vocab_size=320",
    "model.dropout=0.1",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "train.lr=1e-2",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=0",
]


@pytest.fixture(scope="module")
def facts(tmp_path_factory, data_cache):
    """Overrides for the facts corpus, and the folder of the tasks about it."""
    folder = tmp_path_factory.mktemp("facts")
    return [f"data.path={write_corpus(folder)}", f"data.cache_dir={data_cache}"], write_tasks(folder / "tasks")


def with_tasks(facts, interval: int = 2) -> list[str]:
    return [f"eval.interval={interval}", "eval.tasks=[facts_mc,facts_gen]", f"eval.include_path=[{facts[1]}]", "eval.limit=4"]


@pytest.fixture(scope="module")
def runs(facts, tmp_path_factory):
    """The same 6 steps without evaluations and with them every 2 steps."""
    out = {}
    for name, extra in (("plain", []), ("evaluated", [*with_tasks(facts), "logging.wandb.mode=offline", "logging.tensorboard=true"])):
        run_dir = tmp_path_factory.mktemp(name)
        run(RunPlan.build(compose([*TINY, *facts[0], *extra, f"run.dir={run_dir}"])), rank=RankInfo())
        out[name] = run_dir
    return out


def evaluated_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/facts_mc/acc" in r]


def test_evaluations_every_k_steps_leave_the_training_losses_unchanged(runs):
    plain, evaluated = (read_metrics(runs[k] / "metrics.jsonl") for k in ("plain", "evaluated"))
    assert [r["loss"] for r in plain] == [r["loss"] for r in evaluated]  # dropout, data order: bit-identical
    assert evaluated_steps(runs["evaluated"]) == [2, 4, 6]
    record = next(r for r in evaluated if r["step"] == 4)
    assert {"eval/facts_gen/exact_match", "eval/facts_mc/acc_stderr", "eval_s", "eval_tokens_per_s"} <= set(record)
    assert record["tokens_seen"] == 4 * 8 * 32
    saved = json.loads((runs["evaluated"] / "evals" / "step_4.json").read_text())
    assert saved["results"]["facts_mc"]["acc,none"] == record["eval/facts_mc/acc"]
    assert sorted(p.name for p in (runs["evaluated"] / "evals").iterdir()) == ["step_2.json", "step_4.json", "step_6.json"]
    for pattern in ("wandb/offline-run-*/*.wandb", "tensorboard/events.*"):  # the same record goes to W&B and TensorBoard
        assert any(b"eval/facts_mc/acc" in p.read_bytes() for p in runs["evaluated"].glob(pattern)), pattern


def test_a_resume_continues_the_series_with_one_record_per_interval(runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["evaluated"], run_dir)  # a run that went on past its checkpoint at step 2, then resumed from it
    plan, path = plan_for_resume([f"ckpt={run_dir}/checkpoints/step_2", "logging.wandb.mode=disabled", "logging.tensorboard=false"])
    (run_dir / "evals" / "step_8.json").write_text("{}")  # from a longer history past the checkpoint
    run(plan, rank=RankInfo(), resume_from=path)
    assert evaluated_steps(run_dir) == [2, 4, 6]
    assert sorted(p.name for p in (run_dir / "evals").iterdir()) == ["step_2.json", "step_4.json", "step_6.json"]
    before = read_metrics(runs["evaluated"] / "metrics.jsonl")
    assert read_metrics(run_dir / "metrics.jsonl") == [
        {**r, **{k: v for k, v in after.items() if k in ("step_time_s", "tokens_per_s", "mfu", "eval_s", "eval_tokens_per_s")}}
        | {k: after[k] for k in after if k.startswith("peak_")}
        for r, after in zip(before, read_metrics(run_dir / "metrics.jsonl"), strict=True)
    ]  # the same losses and evaluations; only timings and memory differ


def test_layouts_that_split_the_model_are_refused_at_plan_time(facts):
    with pytest.raises(UserError, match="eval.interval") as info:
        RunPlan.build(compose([*TINY, *facts[0], *with_tasks(facts), "parallel.tp=2", "parallel.dp=1", "cluster.devices_per_node=2"]))
    assert "llmforge eval" in info.value.problems[0].fix
    with pytest.raises(UserError, match="need tasks"):
        RunPlan.build(compose([*TINY, "eval.interval=2"]))


def test_llmforge_eval_prints_the_table_and_writes_the_results(runs, facts, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["plain"], run_dir)
    args = ["eval", f"ckpt={run_dir}", "eval.tasks=[facts_mc,facts_text,facts_gen]", f"eval.include_path=[{facts[1]}]", "--device", "cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "facts_mc" in result.output and "byte_perplexity" in result.output and "tokens/s" in result.output
    saved = json.loads((run_dir / "evals" / "step_6.json").read_text())
    assert set(saved["results"]) == {"facts_mc", "facts_text", "facts_gen"}
    assert [p.name for p in (run_dir / "evals").iterdir()] == ["step_6.json"]  # written beside, renamed in


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("eval.tasks=[no_such_task]", "eval.tasks"),
        ("eval.include_path=[/no/such/folder]", "eval.include_path"),
        ("eval.tasks=[broken]", "eval.tasks"),
        ("eval.tasks=[hub_only]", "eval.tasks"),
        ("train.steps=3", "train.steps"),
    ],
)
def test_bad_input_exits_2_naming_the_key_and_writes_nothing(runs, facts, tmp_path, monkeypatch, override, key):
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    shutil.copytree(facts[1], tasks)
    (tasks / "broken.yaml").write_text(
        f"task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path}/missing.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: x\ndoc_to_choice: choices\ndoc_to_target: label\n"
    )
    (tasks / "hub_only.yaml").write_text(
        "task: hub_only\ndataset_path: nobody/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: x\ndoc_to_choice: choices\ndoc_to_target: label\n"
    )
    run_dir = tmp_path / "run"
    shutil.copytree(runs["plain"], run_dir)
    result = runner.invoke(app, ["eval", f"ckpt={run_dir}", "eval.tasks=[facts_mc]", f"eval.include_path=[{tasks}]", override])
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert not (run_dir / "evals").exists()
    if override.endswith("[hub_only]"):
        assert "no network" in result.output


def test_a_folder_that_is_no_checkpoint_exits_2(tmp_path):
    result = runner.invoke(app, ["eval", f"ckpt={tmp_path}", "eval.tasks=[facts_mc]"])
    assert result.exit_code == 2 and "neither a checkpoint" in result.output, result.output


def test_the_same_numbers_as_lm_evals_hf_model_on_the_export(runs, facts, tmp_path):
    pytest.importorskip("accelerate")  # lm-eval's hf model needs it (the test extra installs it)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run_dir = tmp_path / "run"
    shutil.copytree(runs["plain"], run_dir)
    assert runner.invoke(app, ["export", f"ckpt={run_dir}", "--out", str(tmp_path / "hf")]).exit_code == 0
    names = ["facts_mc", "facts_text", "facts_gen"]
    result = runner.invoke(app, ["eval", f"ckpt={run_dir}", f"eval.tasks=[{','.join(names)}]", f"eval.include_path=[{facts[1]}]"])
    assert result.exit_code == 0, result.output
    ours = json.loads((run_dir / "evals" / "step_6.json").read_text())["results"]
    theirs = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(tmp_path / "hf"), "dtype": "float32"},
        tasks=names,
        task_manager=TaskManager(include_path=str(facts[1]), include_defaults=False),
        device="cpu",
        batch_size=4,
        bootstrap_iters=0,
    )["results"]
    for task, metric in [
        ("facts_mc", "acc,none"),
        ("facts_mc", "acc_norm,none"),
        ("facts_text", "byte_perplexity,none"),
        ("facts_gen", "exact_match,none"),
    ]:
        assert ours[task][metric] == pytest.approx(theirs[task][metric], rel=1e-5), (task, metric)


def test_without_lm_eval_the_eval_keys_say_how_to_install_it(monkeypatch):
    import sys

    from llmforge.evaluate.tasks import check_settings

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without the eval extra imports
    with pytest.raises(UserError, match="lm-eval") as info:
        check_settings(compose([*TINY, "eval.tasks=[facts_mc]"]).eval)
    assert "llmforge[eval]" in info.value.problems[0].fix
