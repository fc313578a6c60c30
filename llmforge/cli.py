"""The llmforge command line: the Typer declarations. Each command parses its
arguments and hands over to ``llmforge.commands``; nothing heavy is imported at start-up."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from llmforge.errors import Terminated, UserError, end_by_sigterm, error_text

app = typer.Typer(
    name="llmforge",
    help="Compose, validate, estimate and launch LLM pretraining runs.\n\n"
    "Every command takes Hydra-style overrides: recipe=NAME picks a recipe, GROUP=OPTION a config "
    "option (parallel=tp2pp2), a.b=value a single key (train.steps=100).",
    epilog="Examples:\n\n  llmforge pretrain\n\n  llmforge pretrain recipe=gpt-1b parallel=tp4pp2 train.steps=10\n\n"
    "  llmforge estimate recipe=gpt-7b parallel=tp4pp2\n\n  llmforge resume ckpt=runs/tiny/checkpoints/latest",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Prepare training data (tokenizer + token shards).", no_args_is_help=True)
app.add_typer(data_app, name="data")

# Markup off: whatever a message quotes (paths, values, a rank's error) prints as written;
# llmforge styles its own words with Text/style= instead.
err = Console(stderr=True, markup=False, soft_wrap=True)
out = Console(markup=False, soft_wrap=True)

OVERRIDES = typer.Argument(None, help="Overrides: recipe=NAME, GROUP=OPTION, key.path=value.", show_default=False)
CONFIG_DIR = typer.Option(None, "--config-dir", "-C", help="Extra folder of configs (model/, parallel/, recipe/, ...); repeatable.")


def user_errors(fn: Callable) -> Callable:
    """Turn a UserError into one red message and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            err.print(error_text(exc.message()), highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            err.print("interrupted", style="yellow")
            raise typer.Exit(code=130) from None
        except Terminated:  # what it stopped has said so (a data preparation)
            end_by_sigterm()

    return wrapper


@app.command()
@user_errors
def plan(
    overrides: list[str] | None = OVERRIDES,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    force: bool = typer.Option(False, "--force", help="Show an FP8 plan even if the estimate says FP8 does not pay."),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Compose and validate a run plan, and show it. Nothing is started.

    [bold]Examples[/]

      llmforge plan recipe=gpt-1b parallel=tp4pp2

      llmforge plan recipe=gpt-7b train.global_batch_size=2048 --json
    """
    from llmforge.commands.inspect import plan_command

    plan_command(overrides or [], as_json=as_json, config_dir=config_dir or [], console=out, force=force)


@app.command()
@user_errors
def recipes(config_dir: list[Path] | None = CONFIG_DIR) -> None:
    """List recipes and the options of every config group, with one-line descriptions.

    [bold]Example[/]

      llmforge recipes
    """
    from llmforge.commands.inspect import recipes_command

    recipes_command(config_dir=config_dir or [], console=out)


@app.command()
@user_errors
def keys(prefix: str = typer.Argument("", help="Show only keys starting with this, e.g. parallel.")) -> None:
    """List every configuration key with its type, default and meaning.

    [bold]Example[/]

      llmforge keys parallel.
    """
    from llmforge.commands.inspect import keys_command

    keys_command(prefix, console=out)


@app.command()
@user_errors
def estimate(
    overrides: list[str] | None = OVERRIDES,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (schema in docs/estimator.md)."),
    timeline: bool = typer.Option(False, "--timeline", help="Draw the pipeline schedule, slot by slot."),
    measure: bool = typer.Option(False, "--measure", help="Also build the real model on CPU and print measured numbers."),
    rehearse: bool = typer.Option(
        False,
        "--rehearse",
        help="Also run the most-loaded rank's build and two steps at full scale on fake tensors (CPU) and print its peak memory.",
    ),
    search: bool = typer.Option(False, "--search", help="Search every valid layout and rank those that fit by speed."),
    top: int = typer.Option(5, "--top", min=1, help="With --search, how many layouts to show (1 or more)."),
    plan_file: Path | None = typer.Option(
        None, "--plan", help="Start from a run's plan.json (or its run folder) instead of the recipe (overrides apply on top)."
    ),
    force: bool = typer.Option(False, "--force", help="Estimate an FP8 plan even if FP8 does not pay."),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Estimate memory per device, pipeline bubble, FLOPs, communication and step time.

    Pure arithmetic on the plan: no GPU, no torch, well under a second.

    [bold]Examples[/]

      llmforge estimate recipe=gpt-7b parallel=tp4pp2

      llmforge estimate recipe=gpt-1b parallel=tp2pp2 parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual_stages=2 --timeline

      llmforge estimate recipe=llama-70b cluster.nodes=8 --search --top 5

      llmforge estimate --plan runs/tiny/plan.json

      llmforge estimate recipe=llama-8b parallel=fsdp cluster.nodes=1 --rehearse
    """
    from llmforge.commands.inspect import estimate_command

    estimate_command(
        overrides or [],
        plan_file=plan_file,
        config_dir=config_dir or [],
        as_json=as_json,
        timeline=timeline,
        measure=measure,
        search=search,
        top=top,
        console=out,
        rehearse=rehearse,
        force=force,
    )


@app.command()
@user_errors
def pretrain(
    overrides: list[str] | None = OVERRIDES,
    force: bool = typer.Option(False, "--force", help="Launch even if the estimate says the plan does not fit (or that FP8 does not pay)."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the launch command (or SLURM script, Kubernetes job or SkyPilot task) and stop."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Start over in a run.dir (and checkpoint.dir) that holds a run: its files and checkpoints are deleted.",
    ),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Validate, estimate and launch a pretraining run.

    With no arguments, trains the [bold]tiny[/] recipe on this machine's CPU on the built-in
    corpus (no download) in about a minute. A layout with several ranks starts one process per
    rank through torchrun.

    [bold]Examples[/]

      llmforge pretrain

      llmforge pretrain parallel=tp2 train.steps=50

      llmforge pretrain recipe=gpt-1b parallel=tp4pp2 cluster.nodes=2 --dry-run

      llmforge pretrain recipe=gpt-1b cluster=h100-node cluster.nodes=4 cluster.launcher=kubernetes \
        cluster.image=IMAGE cluster.kubernetes.runs_claim=runs run.dir=/runs/gpt-1b --dry-run
    """
    from llmforge.commands.train import pretrain_command

    pretrain_command(overrides or [], config_dir=config_dir or [], force=force, dry_run=dry_run, overwrite=overwrite, console=err)


@app.command()
@user_errors
def resume(
    overrides: list[str] | None = OVERRIDES,
    force: bool = typer.Option(False, "--force", help="Launch even if the estimate says the plan does not fit (or that FP8 does not pay)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch command and stop."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start over in a run.dir (other than the checkpoint's) that already holds a run."
    ),
    from_other_run: bool = typer.Option(
        False, "--from-other-run", help="Accept a checkpoint whose plan is not its run folder's; the run continues in a new run.dir."
    ),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Continue a run from a checkpoint: ckpt=PATH, where PATH is a step folder, a run
    folder or a run's checkpoints/latest. Other overrides (train.steps, train.lr, a new
    parallel layout, ...) apply on top of the saved plan. The run continues in the
    checkpoint's run folder; a run.dir=... elsewhere must hold no run, as for pretrain.

    [bold]Examples[/]

      llmforge resume ckpt=runs/tiny/checkpoints/latest

      llmforge resume ckpt=runs/tiny train.steps=400 parallel=dp2

      llmforge resume ckpt=runs/tiny/checkpoints/step_240 run.dir=runs/tiny-branch
    """
    from llmforge.commands.train import resume_command

    resume_command(
        overrides or [],
        config_dir=config_dir or [],
        force=force,
        dry_run=dry_run,
        overwrite=overwrite,
        from_other_run=from_other_run,
        console=err,
    )


@app.command()
@user_errors
def export(
    overrides: list[str] | None = OVERRIDES,
    out_dir: str = typer.Option(..., "--out", "-o", help="Folder to write model.safetensors, config.json and the tokenizer files into."),
    quantize: str = typer.Option(
        "auto",
        "--quantize",
        help="Also write the torchao-quantized model (quantized.safetensors, quantization.json): "
        "int8-int4, int4, none, or auto (the run's precision.qat; none for a run without QAT). See docs/qat.md.",
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", help="Input columns per int4 weight scale (default: the run's precision.qat_group_size, else 32)."
    ),
) -> None:
    """Export a checkpoint's model to Hugging Face format (safetensors + config.json, and the
    run's tokenizer), loadable with AutoModelForCausalLM and AutoTokenizer; for a QAT run
    (precision.qat) or with --quantize also the quantized model (docs/qat.md).

    [bold]Examples[/]

      llmforge export ckpt=runs/tiny/checkpoints/latest --out exported/tiny

      llmforge export ckpt=runs/tiny --out exported/tiny-int4 --quantize int8-int4
    """
    from llmforge.commands.checkpoint import export_command

    export_command(overrides or [], out_dir=out_dir, console=err, quantize=quantize, group_size=group_size)


@app.command()
@user_errors
def generate(
    overrides: list[str] | None = OVERRIDES,
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Text to continue."),
    prompts: Path | None = typer.Option(None, "--prompts", help="A text file of prompts, one a line (instead of --prompt)."),
    out_file: str | None = typer.Option(
        None, "--out", help="Write one JSON object a line ({prompt, completion}) to this file instead of stdout."
    ),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N, or auto (the first GPU if there is one)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="A tokenizer.json to use instead of the run's own."),
) -> None:
    """Continue a prompt with a checkpoint's model and the run's tokenizer: ckpt=PATH, plus
    generate.* keys (llmforge keys generate.) for length, temperature (0 = greedy), top-k,
    top-p, seed and the KV cache. The text goes to stdout (or --out FILE as JSONL); the
    speed in tokens/s to stderr.

    [bold]Examples[/]

      llmforge generate ckpt=runs/tiny --prompt "def main(" generate.temperature=0

      llmforge generate ckpt=runs/tiny/checkpoints/latest --prompt "import " generate.top_k=40 generate.top_p=0.9 generate.seed=1

      llmforge generate ckpt=runs/tiny --prompts prompts.txt --out completions.jsonl
    """
    from llmforge.commands.checkpoint import generate_command

    generate_command(
        overrides or [], prompt=prompt, prompts=prompts, out_file=out_file, device=device, tokenizer=tokenizer, out=out, err=err
    )


@app.command("eval")
@user_errors
def evaluate(
    overrides: list[str] | None = OVERRIDES,
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N, or auto (the first GPU if there is one)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="A tokenizer.json to use instead of the run's own."),
) -> None:
    r"""Evaluate a checkpoint on lm-evaluation-harness tasks: ckpt=PATH and eval.tasks=\[...],
    plus eval.* keys (llmforge keys eval.) for your own task YAML folder, a document limit,
    few-shot count and batch size. Prints each task's metrics with their standard errors and
    writes lm-eval's results to RUN/evals/step_N.json (docs/eval.md).

    [bold]Examples[/]

      llmforge eval ckpt=runs/tiny eval.tasks=\[hellaswag,arc_easy] eval.limit=100

      llmforge eval ckpt=runs/tiny/checkpoints/step_200 eval.tasks=\[my_task] eval.include_path=\[tasks/]
    """
    from llmforge.commands.evaluate import eval_command

    eval_command(overrides or [], device=device, tokenizer=tokenizer, out=out, err=err)


@app.command()
@user_errors
def calibrate(
    overrides: list[str] | None = OVERRIDES,
    quick: bool = typer.Option(False, "--quick", help="Fewer and smaller shapes: a few seconds instead of a minute or two."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the profile here (a .yaml path) instead of LLMFORGE_HOME/profiles/."),
    name: str | None = typer.Option(
        None, "--name", help="The profile's name (default: the profile it starts from, e.g. cpu or h100-80gb)."
    ),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Measure this machine and write a hardware profile that estimate, plan, --search and
    every run's MFU and closing line use.

    Times matmuls (per dtype, transformer shapes), fused attention, memory-bound kernels,
    the per-kernel launch floor and device memory; with several ranks (cluster.nodes,
    cluster.devices_per_node, started through torchrun as pretrain does) also all_reduce,
    all_gather, reduce_scatter, all_to_all and send/recv. The profile goes to
    LLMFORGE_HOME/profiles/ (default ~/.cache/llmforge); on a CPU it becomes this machine's
    cluster.accelerator=cpu.

    [bold]Examples[/]

      llmforge calibrate --quick

      llmforge calibrate cluster.devices_per_node=2

      llmforge calibrate cluster=h100-node --out profiles/h100-ours.yaml
    """
    from llmforge.calibrate.run import command_line
    from llmforge.commands.calibrate import calibrate_command

    calibrate_command(
        overrides or [],
        config_dir=config_dir or [],
        quick=quick,
        out=out,
        name=name,
        command=command_line(overrides or [], quick=quick, out=out, name=name),
        console=err,
    )


@data_app.command("prepare")
@user_errors
def data_prepare(
    overrides: list[str] | None = OVERRIDES,
    force: bool = typer.Option(False, "--force", help="Rebuild even if a valid cache exists."),
    config_dir: list[Path] | None = CONFIG_DIR,
) -> None:
    """Train (or load) the tokenizer and write token shards for data.* settings.

    [bold]Examples[/]

      llmforge data prepare

      llmforge data prepare data=files data.path=corpus/ data.vocab_size=32000
    """
    from llmforge.commands.data import data_prepare_command

    data_prepare_command(overrides or [], config_dir=config_dir or [], force=force, console=err)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
