"""What is checked before a run starts: the plan's estimate, the tools it needs, the
devices of this machine and the space on run.dir's file system."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from llmforge.checkpoint.hf_import import check_folder
from llmforge.config.train_rules import FAULT_ENV, fault_problem, parse_faults
from llmforge.data.tokenizer import load_tokenizer
from llmforge.elastic import smallest
from llmforge.errors import Problem, UserError
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.estimate.report import fit_problems, summary_text
from llmforge.estimate.text import verdict
from llmforge.observe.tensorboard import check_installed
from llmforge.plan import RunPlan, launch_problems, tokenizer_problems

#: Bytes a checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 12


def preflight(plan: RunPlan, *, force: bool, resume: bool, console: Console, estimate: Estimate | None = None) -> None:
    """Refuse what cannot start (a missing tool, a too-small or unfit tokenizer, a plan estimated
    not to fit unless forced); show the short estimate and notes on the weights to load.
    ``estimate``: the launch's one estimate of ``plan`` (None: estimated here)."""
    if plan.config.data.tokenizer:  # missing, unreadable, or ids past the vocabulary: refused before any rank starts
        load_tokenizer(plan.config.data.tokenizer, vocab_size=plan.data_vocab_size)
    if plan.config.logging.tensorboard:
        check_installed()
    _check_estimate(plan, estimate, force=force, console=console)
    if not resume and plan.config.model.init_from:
        for note in check_folder(plan.config.model.init_from, plan.config.model):
            console.print(note, style="yellow", markup=False, highlight=False)


def _check_estimate(plan: RunPlan, estimate: Estimate | None, *, force: bool, console: Console) -> None:
    """Show the short estimate; refuse a plan estimated not to fit (on its devices, or in the
    host memory of its nodes, every rank of a node together) unless forced."""
    problems = tokenizer_problems(plan.config) + launch_problems(plan.config)
    if problems:
        raise UserError(problems, title="the run plan is not valid")
    est = estimate if estimate is not None else estimate_plan(plan)
    console.print(summary_text(est), markup=False, highlight=False)
    if not est.fits and not force:
        raise UserError(fit_problems(est), title="the plan is estimated not to fit in device or host memory")
    _check_smallest_world(plan, force=force)


def _check_smallest_world(plan: RunPlan, *, force: bool) -> None:
    """An elastic plan must also fit on its fewest nodes, where ZeRO shards over fewer ranks."""
    least = smallest(plan)
    if least is plan or force:
        return
    est = estimate_plan(least)
    if not est.fits:
        c = plan.config.cluster
        raise UserError(
            [
                Problem(
                    "cluster.min_nodes",
                    c.min_nodes,
                    f"on {c.min_nodes} node(s) the layout is {least.layout}, which {verdict(est)}",
                    "raise cluster.min_nodes, shard more (parallel.zero=3, parallel.recompute=full), or pass --force",
                )
            ],
            title="the elastic plan does not fit its smallest world",
        )


def check_host_memory(plan: RunPlan, *, estimate: Estimate | None = None) -> None:
    """Refuse an offloaded plan whose host-side states and activations (every rank of a node
    together) exceed this machine's memory."""
    import os

    host = (estimate if estimate is not None else estimate_plan(plan)).host
    if host is None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host.node_bytes > total:
        raise UserError(
            [
                Problem(
                    "parallel.offload",
                    plan.layout.offload,
                    f"the ranks of this node would keep {host.node_bytes / 2**30:.3g} GiB in host memory "
                    f"(offloaded states and activations) and this machine has {total / 2**30:.3g} GiB",
                    "shard over more ranks (parallel.dp, parallel.zero=3), offload less (parallel.offload_activations=false), "
                    "or run on nodes with more memory",
                )
            ],
            title="not enough host memory",
        )


def check_space(plan: RunPlan, *, estimate: Estimate | None = None) -> None:
    """Refuse a run whose first checkpoint cannot fit on run.dir's file system."""
    import shutil

    folder = plan.run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    need = (estimate if estimate is not None else estimate_plan(plan)).params_total * CHECKPOINT_BYTES_PER_PARAM
    free = shutil.disk_usage(folder).free
    if free < need:
        raise UserError(
            [
                Problem(
                    "run.dir",
                    str(plan.run_dir),
                    f"a checkpoint of this model needs about {need / 2**30:.3g} GiB "
                    f"and the file system of {folder} has {free / 2**30:.3g} GiB free",
                    "free space there or choose a run.dir on a larger file system",
                )
            ],
            title="not enough disk space",
        )


def check_devices(plan: RunPlan) -> None:
    """A GPU profile needs as many CUDA devices on this node as ranks it starts here."""
    c = plan.config.cluster
    if c.accelerator == "cpu":
        return
    import torch

    wanted = c.devices_per_node or plan.world_size // c.nodes
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < wanted:
        raise UserError(
            [
                Problem(
                    "cluster.accelerator",
                    c.accelerator,
                    f"the plan starts {wanted} GPU rank(s) on this node, and this machine has {found} CUDA device(s)",
                    "run it on the GPU nodes (or write a SLURM script with cluster.launcher=slurm), "
                    "or train on this machine's CPU with cluster=cpu and a layout that fits it",
                )
            ],
            title="this machine cannot run the plan",
        )


def check_fault(plan: RunPlan, *, resume_from: Path | None, here: bool, console: Console) -> None:
    """``LLMFORGE_FAULT``, before anything is written: a malformed one is refused, and one whose
    rank or step never comes, or that will end this very command, is said at start-up."""
    import os
    import re

    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    try:
        faults = parse_faults(spec)
    except ValueError:
        raise UserError([fault_problem(spec)], title="bad fault drill") from None
    name = str(resume_from).rstrip("/").rsplit("/", 1)[-1] if resume_from is not None else ""
    done = re.fullmatch(r"step_(\d+)", name)
    resumed_at = int(done.group(1)) if done else 0
    for fault in faults:
        _say_fault(plan, fault, spec=spec, resumed_at=resumed_at, here=here, console=console)


def _say_fault(plan: RunPlan, fault: tuple[int, int, int, str], *, spec: str, resumed_at: int, here: bool, console: Console) -> None:
    """Say at start-up when one fault of ``spec`` never comes, or ends this very command."""
    rank, first, last, kind = fault
    steps = plan.config.train.steps
    never = (
        f"rank {rank} does not exist (this run has {plan.world_size} rank(s), 0-{plan.world_size - 1})"
        if rank >= plan.world_size
        else "a hang waits for another rank, and this run has one"
        if kind == "hang" and plan.world_size < 2
        else f"step {first} comes after the last step ({steps})"
        if first > steps
        else f"step{'s' if last > first else ''} {first}{'-' + str(last) if last > first else ''} "
        f"came before this resume from step {resumed_at}"
        if (first if kind == "exit" else last) <= resumed_at
        else ""
    )
    if never:
        console.print(
            f"{FAULT_ENV}={spec} injects nothing: {never}, so this drill tests nothing", style="yellow", markup=False, highlight=False
        )
    elif kind == "exit" and here:
        console.print(
            f"{FAULT_ENV}={spec}: this run trains in this process with no restarts (cluster.max_restarts=0), "
            f"so this command itself ends after step {first} with exit code 1",
            style="yellow",
            markup=False,
            highlight=False,
        )
