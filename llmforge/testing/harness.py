"""Run several layouts of the same tiny model in one started process group and
collect what they computed: the equivalence tests and tools/bench_parallel.py use it.

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        -m llmforge.testing.harness SPEC.json OUT.pt

SPEC.json: ``{"base": [overrides...], "layouts": {"name": [overrides...]}, "fail_rank": null,
"fail_at": null, "device": "cpu", "mesh_of_one": false, "count_syncs": [names...]}`` (started as
``-m llmforge.testing.drill``, a layout given as a dict is an anomaly drill): ``fail_rank``
raises before layout ``fail_at`` (default: the first); ``"device": "cuda"`` trains each rank on
its GPU, under NCCL; ``mesh_of_one`` sends a one-rank layout through the distributed path (see
``rank_info``); ``count_syncs`` counts the host synchronisations of a step of those layouts.
OUT.pt (written by rank 0): per layout the losses, validation losses (every
EVAL_INTERVAL steps and at the end, forward only), grad norms, step times, the
host synchronisations of the counted step on rank 0 (``llmforge.train.syncs``), the
intra-op thread count of each rank, the dtypes each rank's blocks received and
returned (the residual stream) and its losses had, rank 0's local element count of each
parameter (what it holds of its shard), the full (gathered) parameters after the
last step and every rank's persistent buffers (the MoE routing bias).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from llmforge.errors import fail
from llmforge.launch.guard import install_from_env
from llmforge.models.masks import needs_eos
from llmforge.parallel.data import reshard_gathered
from llmforge.parallel.dtensor import local_numel
from llmforge.parallel.mesh import backend_for
from llmforge.parallel.offload import OffloadedStep
from llmforge.plan import RunPlan, config_from_dict
from llmforge.processes.rank_errors import end_rank, report_errors
from llmforge.processes.watch import guard_rank
from llmforge.train.build import build_components, distributed_rank
from llmforge.train.callbacks import Recorder
from llmforge.train.components import Components, RankInfo
from llmforge.train.loop import train_loop
from llmforge.train.stop import StopSignal
from llmforge.train.syncs import StepSyncs

TINY = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.ffn_hidden_size=64",
    "model.vocab_size=256",
    "model.seq_len=32",
    "model.bias=false",
    "model.init_std=0.1",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=5",
    "train.lr=1e-3",
    "optim.warmup_steps=0",
    "optim.grad_clip=0.5",
    "optim.schedule=constant",
]

EVAL_INTERVAL = 4
DOCUMENT_EOS_RATE = 0.1  # about three documents per tiny window when masks follow documents
# the step whose host synchronisations are counted: logged, not validated, not the first after
# an evaluation (a pipeline schedule exchanges its shapes again then)
SYNC_STEP = 3


@dataclass
class SyntheticSampler:
    """The global batch of step k depends only on (seed, k); each data-parallel rank
    takes its contiguous share of rows, as the real sampler does. ``eos_rate`` > 0
    makes that share of the tokens the end-of-document token ``eos_id`` (documents
    for the document masks)."""

    vocab_size: int
    seq_len: int
    global_batch_size: int
    seed: int
    step: int = 0
    eos_rate: float = 0.0
    eos_id: int = 0

    def next_batch(self, *, dp_rank: int, dp_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7919 + self.step)
        rows = torch.randint(0, self.vocab_size, (self.global_batch_size, self.seq_len + 1), generator=gen)
        if self.eos_rate > 0:
            rows[torch.rand(rows.shape, generator=gen) < self.eos_rate] = self.eos_id
        self.step += 1
        share = self.global_batch_size // dp_size
        return rows[dp_rank * share : (dp_rank + 1) * share]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def tiny_plan(overrides: list[str]) -> RunPlan:
    """A validated plan of the tiny test model with ``overrides`` applied."""
    return RunPlan.build(config_from_dict({}, TINY + list(overrides)))


@dataclass
class LayoutResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    sync_ops: list[dict[str, int]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    dtypes: list[dict[str, list[str]]] = field(default_factory=list)
    local_numel: dict[str, int] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: Where the offloaded tensors went (``offload_facts``): the tests check the offload was in place.
    offload: dict[str, object] = field(default_factory=dict)


def rank_info(plan: RunPlan, *, device: torch.device, mesh_of_one: bool = False) -> RankInfo:
    """This rank's place in a fresh mesh for ``plan``. A one-rank plan gets no mesh (it
    trains as in one process) unless ``mesh_of_one`` and a process group is started: then
    it takes the distributed path with a mesh of size one, as the worker does."""
    if plan.world_size == 1 and not (mesh_of_one and dist.is_initialized()):
        return RankInfo(device=device)
    return distributed_rank(plan, device=device)


def train_layout(
    plan: RunPlan, *, device: torch.device | None = None, mesh_of_one: bool = False, count_syncs: bool = False
) -> LayoutResult:
    """Train ``plan`` on synthetic data, logging every ``train.log_interval`` steps (the tiny
    plan's default: every step) with the run's stop vote; return what it computed (params on
    rank 0). ``count_syncs``: count the host synchronisations of step ``SYNC_STEP`` (slow:
    every op goes through a Python dispatch mode)."""
    device = device if device is not None else torch.device("cpu")
    cfg = plan.config
    torch.manual_seed(cfg.train.seed)
    eos_rate = DOCUMENT_EOS_RATE if needs_eos(cfg.model) else 0.0
    sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.model.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
        eos_rate=eos_rate,
    )
    rank = rank_info(plan, device=device, mesh_of_one=mesh_of_one)
    # validation on other synthetic rows mid-run and at the end: training must continue unchanged after it
    val_sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.model.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed + 1,
        eos_rate=eos_rate,
    )
    c = build_components(plan, rank=rank, sampler=sampler, val_sampler=val_sampler)
    dtypes = record_dtypes(c)
    copies = _count_activation_copies(c)
    recorder = Recorder()
    records = recorder.records
    syncs = StepSyncs(host=c.host_tensors, enabled=count_syncs, skip=SYNC_STEP - 1, count=1)
    with syncs:
        train_loop(
            c,
            start_step=0,
            total_steps=cfg.train.steps,
            grad_clip=cfg.optim.grad_clip,
            log_interval=cfg.train.log_interval,
            checkpoint_interval=0,
            callbacks=[recorder, StopSignal(device=device), syncs],
            eval_interval=EVAL_INTERVAL,
            eval_steps=1,
        )
    out = LayoutResult(
        losses=[r["loss"] for r in records],
        val_losses=[r["val_loss"] for r in records if "val_loss" in r],
        grad_norms=[r["grad_norm"] for r in records],
        step_times=[r["step_time_s"] for r in records],
        syncs=syncs.per_step,
        sync_ops=syncs.ops_per_step,
    )
    out.params = full_parameters(c)  # reshards first: ZeRO 1/2 keep the compute copy gathered
    out.local_numel = {n: local_numel(p) for part in c.model_parts for n, p in part.named_parameters()}
    out.threads = rank_threads()
    out.dtypes = per_rank({k: sorted(v) for k, v in dtypes.items()})
    out.buffers = rank_buffers(c)
    out.offload = {**offload_facts(c), **copies}
    return out


def offload_facts(c: Components) -> dict[str, object]:
    """The offload policy of every FSDP2 parameter group, whether each sharded parameter is kept
    in host memory (FSDP2's ``offload_to_cpu``), and whether AdamW is torch's fused one."""
    groups = [m._get_fsdp_state()._fsdp_param_group for part in c.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    return {
        "fsdp_policies": sorted({type(g.offload_policy).__name__ for g in groups}),
        "params_on_host": [bool(p.offload_to_cpu) for g in groups for p in g.fsdp_params],
        "fused_adamw": bool(c.optimizer.defaults.get("fused")),
    }


def _count_activation_copies(c: Components) -> dict[str, int]:
    """Count the activations the step's offload hooks copy to host memory and back (a dict
    filled while training; empty counts when no offload hook is in place)."""
    counts = {"activations_to_host": 0, "activations_back": 0}
    step = c.step
    while step is not None and not isinstance(step, OffloadedStep):
        step = getattr(step, "inner", None)
    if step is None:
        return counts
    offload = step.offload
    pack, unpack = offload.pack, offload.unpack

    def counting_pack(tensor: torch.Tensor):
        packed = pack(tensor)
        if isinstance(packed, tuple) and packed[1].data_ptr() != tensor.data_ptr():  # a copy, not the tensor itself
            counts["activations_to_host"] += 1
        return packed

    def counting_unpack(packed):
        if isinstance(packed, tuple):
            counts["activations_back"] += 1
        return unpack(packed)

    offload.pack, offload.unpack = counting_pack, counting_unpack
    return counts


def rank_buffers(c: Components) -> list[dict[str, torch.Tensor]]:
    """Every rank's persistent buffers by name (collective when distributed)."""
    mine: dict[str, torch.Tensor] = {}
    for part in c.model_parts:
        params = {name for name, _ in part.named_parameters()}
        mine.update({k: v.detach().cpu().clone() for k, v in part.state_dict().items() if k not in params})
    if not dist.is_initialized():
        return [mine]
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [g or {} for g in gathered]


def rank_threads() -> list[int]:
    """torch's intra-op thread count on every rank (collective when distributed)."""
    return [int(c) for c in per_rank(torch.get_num_threads())]


def per_rank(mine: object) -> list:
    """``mine`` from every rank, in rank order (collective when distributed)."""
    if not dist.is_initialized():
        return [mine]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def record_dtypes(c: Components) -> dict[str, set]:
    """Collect, as the run goes, the dtypes of the residual stream as it reaches each
    block (before any hook casts it), of each block's output and of the losses."""
    seen: dict[str, set] = {"block_inputs": set(), "block_outputs": set(), "losses": set()}
    for part in c.model_parts:
        for block in part.layers.values():
            block.register_forward_pre_hook(lambda _m, args: seen["block_inputs"].add(str(args[0].dtype)), prepend=True)
            block.register_forward_hook(lambda _m, _args, out: seen["block_outputs"].add(str(out.dtype)))
    step = getattr(c.step, "inner", c.step)  # an OffloadedStep wraps the runner
    loss_fn = step.loss_fn

    def recorded(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        seen["losses"].add(str(loss.dtype))
        return loss

    step.loss_fn = recorded
    return seen


def full_parameters(c: Components) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, by its name in the full model (on rank 0;
    other ranks return an empty dict). Collective over all ranks."""
    local: dict[str, torch.Tensor] = {}
    for part in c.model_parts:
        reshard_gathered([part])  # read the sharded fp32 parameters, not the gathered compute weights
        for name, p in part.named_parameters():
            local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    if not dist.is_initialized():
        return local
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, value in (part or {}).items():
            merged.setdefault(name, value)
    return merged if dist.get_rank() == 0 else {}


def main(argv: list[str], *, drill: Callable[..., dict] | None = None) -> None:
    """Run the spec's layouts; ``drill`` runs those given as dicts (``python -m llmforge.testing.drill``)."""
    spec = json.loads(Path(argv[0]).read_text())
    guard_rank(int(os.environ.get("RANK", "0")))
    with report_errors():
        device = _join(spec.get("device", "cpu"))
        results = {}
        for name, entry in spec["layouts"].items():
            if isinstance(entry, dict) and drill is not None:  # an anomaly drill (llmforge.testing.drill)
                results[name] = drill(tiny_plan(spec.get("base", []) + entry["overrides"]), entry, device=device)
                continue
            plan = tiny_plan(spec.get("base", []) + entry)
            if spec.get("fail_rank") == dist.get_rank() and name == spec.get("fail_at", name):
                _fail(spec.get("fail_kind", "error"))
            counted = name in spec.get("count_syncs", [])
            results[name] = train_layout(plan, device=device, mesh_of_one=spec.get("mesh_of_one", False), count_syncs=counted).__dict__
        if dist.get_rank() == 0:
            torch.save(results, argv[1])
        dist.barrier()
        dist.destroy_process_group()
    end_rank()


def _join(device_type: str) -> torch.device:
    """Join torchrun's process group as the worker does; this rank's compute device."""
    import os

    device = torch.device("cpu")
    if device_type != "cpu":
        device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))
    install_from_env(device)
    return device


def _fail(kind: str) -> None:
    if kind == "user":
        raise fail("data.path = 'missing.txt': no such file")
    raise RuntimeError("injected failure on this rank")


if __name__ == "__main__":
    main(sys.argv[1:])
