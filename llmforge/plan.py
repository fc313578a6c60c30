"""RunPlan: a RunConfig plus everything derived from it, validated as a whole.

``RunPlan.build(config)`` checks every cross-field rule and raises one UserError
listing each problem (key, value, rule, fix). A built plan is internally
consistent: the estimator, the launcher and the trainer take it as given.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from llmforge.config.schema import RunConfig
from llmforge.config.train_rules import check_training
from llmforge.errors import Problem, UserError, fail

CHOICES: Dict[str, tuple] = {
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.position": ("learned", "rope"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_interleaved", "zbv"),
    "parallel.recompute": ("none", "selective", "full"),
    "precision.param_dtype": ("fp32", "bf16", "fp16"),
    "precision.reduce_dtype": ("fp32", "bf16", "fp16"),
    "precision.fp8_recipe": ("tensorwise", "rowwise"),
    "data.source": ("builtin", "files"),
    "optim.name": ("adamw",),
    "optim.schedule": ("cosine", "linear", "constant", "wsd"),
    "optim.decay_shape": ("linear", "cosine", "sqrt"),
    "train.memory_snapshot": ("off", "oom", "profile"),
    "cluster.launcher": ("local", "torchrun", "slurm"),
    "logging.wandb.mode": ("auto", "online", "offline", "disabled"),
}
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "zb_interleaved", "zbv")
#: Schedules that deadlock or refuse to run with fewer microbatches than pipeline ranks.
FILLING_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_interleaved", "zbv")


def get_key(config: Any, key: str) -> Any:
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class RunPlan:
    """A validated run: the config and the quantities derived from it."""

    config: RunConfig
    world_size: int
    dp: int
    num_kv_heads: int
    microbatches: int
    layers_per_stage: List[int]
    moe_layers: List[int]
    tokens_per_step: int
    data_vocab_size: int

    @property
    def tp(self) -> int:
        return self.config.parallel.tp

    @property
    def pp(self) -> int:
        return self.config.parallel.pp

    @property
    def cp(self) -> int:
        return self.config.parallel.cp

    @property
    def ep(self) -> int:
        return self.config.parallel.ep

    @property
    def dp_replicate(self) -> int:
        """HSDP replica groups (1: ZeRO shards over the whole data-parallel group)."""
        return self.config.parallel.dp_replicate

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks one ZeRO shard group spans (dp / dp_replicate)."""
        return self.dp // self.dp_replicate

    @property
    def virtual_stages(self) -> int:
        return self.config.parallel.pp_virtual_stages

    @property
    def overlap_grad_reduce(self) -> bool:
        """ZeRO-0 reduces gradients in buckets during backward: by default on GPUs, not on
        CPU, where gloo's communication thread competes with compute for the same cores."""
        choice = self.config.parallel.overlap_grad_reduce
        return self.config.cluster.accelerator != "cpu" if choice is None else choice

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.dir)

    @property
    def layout(self) -> str:
        parts = [f"{n}{v}" for n, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.dp_replicate > 1:  # HSDP: replicas x shard group
            parts[0] = f"hsdp{self.dp_replicate}x{self.dp_shard}"
        return "x".join(parts) or "single"

    @classmethod
    def build(cls, config: RunConfig) -> "RunPlan":
        problems = _validate(config)
        if problems:
            raise UserError(problems, title="the run plan is not valid")
        return cls._derive(config)

    @classmethod
    def _derive(cls, config: RunConfig) -> "RunPlan":
        m, p = config.model, config.parallel
        world, dp = _world_and_dp(config)
        chunks = p.pp * p.pp_virtual_stages
        layers = list(p.pp_layers) if p.pp_layers else [m.num_layers // chunks] * chunks
        moe_layers = [i for i in range(m.num_layers) if m.moe.num_experts > 0 and (i + 1) % m.moe.every == 0]
        return cls(
            config=config,
            world_size=world,
            dp=dp,
            num_kv_heads=m.num_kv_heads or m.num_heads,
            microbatches=config.train.global_batch_size // (config.train.micro_batch_size * dp),
            layers_per_stage=layers,
            moe_layers=moe_layers,
            tokens_per_step=config.train.global_batch_size * m.seq_len,
            data_vocab_size=config.data.vocab_size or m.vocab_size,
        )

    def derived(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}

    def to_dict(self) -> Dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "derived": self.derived()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: Path) -> None:
        """Write plan.json atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "RunPlan":
        try:
            data = json.loads(Path(path).read_text())
            config = config_from_dict(data["config"])
        except FileNotFoundError:
            raise fail(f"{path}: no plan.json here; point ckpt= at a run folder or one of its checkpoints") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise fail(f"{path}: plan.json is unreadable ({exc}); the run folder is damaged") from None
        return cls.build(config)


def config_from_dict(data: Dict[str, Any], overrides: Optional[List[str]] = None) -> RunConfig:
    """Rebuild a typed RunConfig from its dict form (plan.json), applying dotted overrides."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _world_and_dp(config: RunConfig) -> tuple[int, int]:
    p, c = config.parallel, config.cluster
    model_parallel = p.tp * p.pp * p.cp
    if c.devices_per_node is None:
        dp = 1 if p.dp == "auto" else int(p.dp)
        return dp * model_parallel, dp
    world = c.nodes * c.devices_per_node
    dp = world // model_parallel if p.dp == "auto" else int(p.dp)
    return world, dp


def _validate(config: RunConfig) -> List[Problem]:
    problems: List[Problem] = []
    for check in (_check_choices, _check_ranges, _check_model, _check_world, _check_tp, _check_pipeline, _check_batch, _check_moe, _check_data, _check_accelerator, _check_fp8, _check_hsdp, check_training):
        problems.extend(check(config))
    return problems


def _check_choices(config: RunConfig) -> List[Problem]:
    out = []
    for key, allowed in CHOICES.items():
        value = get_key(config, key)
        if value not in allowed:
            from llmforge.errors import nearest

            out.append(Problem(key, value, f"not a valid choice{nearest(str(value), allowed)}", f"use one of: {', '.join(allowed)}"))
    return out


_POSITIVE = (
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.ffn_hidden_size", "model.vocab_size",
    "model.seq_len", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.pp_virtual_stages",
    "parallel.recompute_every", "parallel.dp_replicate", "train.micro_batch_size", "train.global_batch_size", "train.steps",
    "train.log_interval", "cluster.nodes", "cluster.timeout_s", "data.num_proc", "checkpoint.keep", "model.moe.every",
)


def _check_ranges(config: RunConfig) -> List[Problem]:
    out = []
    for key in _POSITIVE:
        value = get_key(config, key)
        if not isinstance(value, int) or value < 1:
            out.append(Problem(key, value, "must be a positive integer", f"set {key} to 1 or more"))
    dp = config.parallel.dp
    if dp != "auto" and not (isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1):
        out.append(Problem("parallel.dp", dp, "must be a positive integer or auto", "set parallel.dp=auto or e.g. parallel.dp=2"))
    if config.parallel.zero not in (0, 1, 2, 3):
        out.append(Problem("parallel.zero", config.parallel.zero, "ZeRO stage must be 0, 1, 2 or 3", "set parallel.zero to 0-3"))
    if config.cluster.devices_per_node is not None and config.cluster.devices_per_node < 1:
        out.append(Problem("cluster.devices_per_node", config.cluster.devices_per_node, "must be positive", "set it to 1 or more, or null"))
    if not 0.0 <= config.model.dropout < 1.0:
        out.append(Problem("model.dropout", config.model.dropout, "must be in [0, 1)", "use e.g. 0.0 or 0.1"))
    if not config.train.lr > 0:
        out.append(Problem("train.lr", config.train.lr, "must be positive", "use e.g. train.lr=3e-4"))
    if not 0.0 < config.cluster.efficiency <= 1.0:
        out.append(Problem("cluster.efficiency", config.cluster.efficiency, "must be in (0, 1]", "use e.g. 0.5"))
    if config.checkpoint.interval < 0:
        out.append(Problem("checkpoint.interval", config.checkpoint.interval, "must be 0 or more", "0 saves only at the end"))
    return out


def _check_model(config: RunConfig) -> List[Problem]:
    m, out = config.model, []
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads > 0 and m.hidden_size % m.num_heads:
        out.append(Problem("model.hidden_size", m.hidden_size, f"not divisible by model.num_heads={m.num_heads}", "make hidden_size a multiple of num_heads"))
    if kv < 1 or (m.num_heads > 0 and m.num_heads % kv):
        out.append(Problem("model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads={m.num_heads}", "use a divisor of num_heads (GQA groups)"))
    if m.position == "rope" and m.num_heads > 0 and (m.hidden_size // m.num_heads) % 2:
        out.append(Problem("model.position", m.position, "RoPE needs an even head dimension", "change hidden_size or num_heads"))
    return out


def _check_world(config: RunConfig) -> List[Problem]:
    p, c, out = config.parallel, config.cluster, []
    if not _ints(p.tp, p.pp, p.cp) or (p.dp != "auto" and not _ints(p.dp)):
        return out
    model_parallel = p.tp * p.pp * p.cp
    if c.devices_per_node is None:
        return out
    world = c.nodes * c.devices_per_node
    if p.dp == "auto":
        if world % model_parallel:
            out.append(Problem("parallel", f"tp*pp*cp={model_parallel}", f"does not divide the world size {world} (cluster.nodes x cluster.devices_per_node)", "change tp/pp/cp or the number of devices"))
    elif p.dp * model_parallel != world:
        out.append(Problem("parallel.dp", p.dp, f"dp*tp*pp*cp = {p.dp * model_parallel} but the world size is {world} (cluster.nodes={c.nodes} x cluster.devices_per_node={c.devices_per_node})", f"set parallel.dp=auto or cluster.devices_per_node={p.dp * model_parallel // max(c.nodes, 1)}"))
    if p.tp > c.devices_per_node:
        out.append(Problem("parallel.tp", p.tp, f"larger than cluster.devices_per_node={c.devices_per_node}: tensor parallel must stay inside a node", "lower tp and raise pp or dp"))
    return out


def _check_tp(config: RunConfig) -> List[Problem]:
    m, p, out = config.model, config.parallel, []
    kv = m.num_kv_heads or m.num_heads
    if not _ints(p.tp, p.cp) or p.tp < 1 or p.cp < 1:
        return out
    if m.num_heads % p.tp:
        out.append(Problem("parallel.tp", p.tp, f"does not divide model.num_heads={m.num_heads}", "pick tp among the divisors of num_heads"))
    if kv % p.tp:
        out.append(Problem("parallel.tp", p.tp, f"does not divide model.num_kv_heads={kv}", "pick tp among the divisors of num_kv_heads"))
    if m.ffn_hidden_size % p.tp:
        out.append(Problem("parallel.tp", p.tp, f"does not divide model.ffn_hidden_size={m.ffn_hidden_size}", "pick tp dividing ffn_hidden_size"))
    if m.vocab_size % p.tp:
        out.append(Problem("model.vocab_size", m.vocab_size, f"not divisible by parallel.tp={p.tp} (vocab-parallel embedding)", "pad vocab_size to a multiple of tp"))
    if p.sequence_parallel and p.tp == 1:
        out.append(Problem("parallel.sequence_parallel", True, "sequence parallel splits activations over tp ranks, and tp=1", "set parallel.tp>1 or parallel.sequence_parallel=false"))
    if p.sequence_parallel and m.seq_len % p.tp:
        out.append(Problem("model.seq_len", m.seq_len, f"not divisible by parallel.tp={p.tp} with sequence parallel", "make seq_len a multiple of tp"))
    if m.seq_len % (2 * p.cp):
        out.append(Problem("model.seq_len", m.seq_len, f"not divisible by parallel.cp={p.cp} x 2 (load-balanced context-parallel chunks)", "make seq_len a multiple of 2 x cp"))
    return out


def _check_pipeline(config: RunConfig) -> List[Problem]:
    m, p, out = config.model, config.parallel, []
    if not _ints(p.pp, p.pp_virtual_stages) or p.pp < 1 or p.pp_virtual_stages < 1:
        return out
    chunks = p.pp * p.pp_virtual_stages
    if p.pp_layers:
        if len(p.pp_layers) != chunks or sum(p.pp_layers) != m.num_layers or min(p.pp_layers) < 1:
            out.append(Problem("parallel.pp_layers", list(p.pp_layers), f"needs {chunks} positive entries (pp x virtual stages) summing to model.num_layers={m.num_layers}", "list the layers of each stage, e.g. [3,5]"))
    elif m.num_layers % chunks:
        out.append(Problem("model.num_layers", m.num_layers, f"not divisible by pp x virtual stages = {chunks}", "change pp or pp_virtual_stages, or set parallel.pp_layers for an uneven split"))
    multi = p.pp_schedule in MULTI_CHUNK_SCHEDULES
    if p.pp_virtual_stages > 1 and not multi:
        out.append(Problem("parallel.pp_virtual_stages", p.pp_virtual_stages, f"schedule {p.pp_schedule} runs one stage per rank", f"use one of {', '.join(MULTI_CHUNK_SCHEDULES)} or pp_virtual_stages=1"))
    if multi and p.pp_virtual_stages < 2 and p.pp > 1:
        out.append(Problem("parallel.pp_schedule", p.pp_schedule, "this schedule needs at least 2 virtual stages per rank", "set parallel.pp_virtual_stages=2"))
    if p.pp_schedule == "zbv" and p.pp_virtual_stages != 2 and p.pp > 1:
        out.append(Problem("parallel.pp_virtual_stages", p.pp_virtual_stages, "the ZBV schedule uses exactly 2 stages per rank (V shape)", "set parallel.pp_virtual_stages=2"))
    return out


def _check_batch(config: RunConfig) -> List[Problem]:
    t, p, out = config.train, config.parallel, []
    if not _ints(t.micro_batch_size, t.global_batch_size, p.tp, p.pp, p.cp) or min(t.micro_batch_size, p.tp, p.pp, p.cp) < 1:
        return out
    if p.dp != "auto" and not _ints(p.dp):
        return out
    _, dp = _world_and_dp(config)
    if dp < 1:
        return out
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        out.append(Problem("train.global_batch_size", t.global_batch_size, f"not divisible by micro_batch_size x dp = {t.micro_batch_size} x {dp}", f"use a multiple of {per_step}, e.g. {max(per_step, t.global_batch_size // per_step * per_step)}"))
        return out
    m = t.global_batch_size // per_step
    if p.pp > 1 and p.pp_schedule in FILLING_SCHEDULES and m < p.pp:
        out.append(Problem("train.global_batch_size", t.global_batch_size, f"gives {m} microbatches per pipeline, fewer than parallel.pp={p.pp} stages that {p.pp_schedule} must fill", f"raise global_batch_size to {p.pp * per_step} or lower micro_batch_size"))
    elif p.pp > 1 and p.pp_schedule in MULTI_CHUNK_SCHEDULES and m % p.pp:
        out.append(Problem("train.global_batch_size", t.global_batch_size, f"gives {m} microbatches, not a multiple of parallel.pp={p.pp} as {p.pp_schedule} needs", f"use a multiple of {p.pp * per_step}"))
    return out


def _check_moe(config: RunConfig) -> List[Problem]:
    moe, p, out = config.model.moe, config.parallel, []
    if moe.num_experts < 0:
        out.append(Problem("model.moe.num_experts", moe.num_experts, "cannot be negative", "use 0 for a dense model"))
        return out
    if moe.num_experts == 0:
        if _ints(p.ep) and p.ep > 1:
            out.append(Problem("parallel.ep", p.ep, "expert parallel needs an MoE model (model.moe.num_experts=0)", "set parallel.ep=1 or pick an MoE model"))
        return out
    if not 1 <= moe.top_k <= moe.num_experts:
        out.append(Problem("model.moe.top_k", moe.top_k, f"must be between 1 and model.moe.num_experts={moe.num_experts}", "lower top_k"))
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        out.append(Problem("model.moe.capacity_factor", moe.capacity_factor, "must be positive or null (dropless)", "use e.g. 1.25 or null"))
    if _ints(p.ep) and p.ep >= 1:
        if moe.num_experts % p.ep:
            out.append(Problem("parallel.ep", p.ep, f"does not divide model.moe.num_experts={moe.num_experts}", "pick ep among the divisors of num_experts"))
        if p.dp != "auto" and not _ints(p.dp):
            return out
        if _ints(p.tp, p.pp, p.cp) and min(p.tp, p.pp, p.cp) >= 1:
            _, dp = _world_and_dp(config)
            if dp >= 1 and (dp * p.cp) % p.ep:
                out.append(Problem("parallel.ep", p.ep, f"experts are split over the dp x cp = {dp * p.cp} ranks of a model replica's group, which ep does not divide", "choose ep dividing dp x cp"))
    return out


def _check_data(config: RunConfig) -> List[Problem]:
    d, out = config.data, []
    if d.source == "files" and not d.path and not d.mixture:
        out.append(Problem("data.path", d.path, "data.source=files needs files to read", "set data.path=FILE_OR_FOLDER"))
    if d.vocab_size is not None and d.vocab_size > config.model.vocab_size:
        out.append(Problem("data.vocab_size", d.vocab_size, f"larger than model.vocab_size={config.model.vocab_size}", "lower data.vocab_size or raise model.vocab_size"))
    return out


def _check_accelerator(config: RunConfig) -> List[Problem]:
    """cluster.accelerator must name a hardware profile (llmforge.estimate.hardware) or a profile file."""
    from llmforge.estimate.hardware import is_known, unknown_problem

    name = config.cluster.accelerator
    if is_known(name):
        return []
    if name.endswith((".yaml", ".yml")):
        return [Problem("cluster.accelerator", name, "profile file not found", "pass an existing .yaml path or a profile name")]
    return [unknown_problem(name)]


def _check_fp8(config: RunConfig) -> List[Problem]:
    """precision.fp8 needs torchao, bf16 (or fp32) for the rest, and FP8 tensor cores unless emulated."""
    from llmforge.estimate.hardware import get_profile, is_known

    pr, out = config.precision, []
    if not pr.fp8:
        return out
    if not _installed("torchao"):
        out.append(Problem("precision.fp8", True, "FP8 training runs on torchao, which is not installed", "pip install 'llmforge[fp8]' (or pip install torchao), or use precision=bf16"))
    if pr.param_dtype == "fp16":
        out.append(Problem("precision.param_dtype", pr.param_dtype, "fp8 is not combined with fp16 loss scaling (FP8 gradients use e5m2 with their own scales)", "use precision=fp8 (bf16 for the rest) or precision.param_dtype=bf16"))
    name = config.cluster.accelerator
    if is_known(name) and not pr.fp8_emulate and not get_profile(name).has_fp8:
        out.append(Problem("cluster.accelerator", name, "has no FP8 tensor cores (its profile gives no peak_tflops.fp8), so precision.fp8 cannot run there", "use an H100, H200 or B200 (cluster=h100-node), precision=bf16, or precision.fp8_emulate=true to test the numerics without a speed-up"))
    return out


def _check_hsdp(config: RunConfig) -> List[Problem]:
    """parallel.dp_replicate splits the FSDP (ZeRO 1-3) data-parallel group into replicas of a shard group."""
    p, out = config.parallel, []
    if not _ints(p.dp_replicate) or p.dp_replicate <= 1 or not _ints(p.tp, p.pp, p.cp) or min(p.tp, p.pp, p.cp) < 1:
        return out
    if p.zero == 0:
        out.append(Problem("parallel.dp_replicate", p.dp_replicate, "HSDP replicates ZeRO shard groups, and parallel.zero=0 shards nothing", "set parallel.zero=3 (or 1, 2), or parallel.dp_replicate=1"))
    if p.dp != "auto" and not _ints(p.dp):
        return out
    _, dp = _world_and_dp(config)
    if dp >= 1 and dp % p.dp_replicate:
        out.append(Problem("parallel.dp_replicate", p.dp_replicate, f"does not divide the data-parallel size dp={dp}", "pick a divisor of dp, e.g. cluster.nodes (one shard group per node)"))
    if p.ep > 1 or p.cp > 1:
        key, value = ("parallel.ep", p.ep) if p.ep > 1 else ("parallel.cp", p.cp)
        out.append(Problem(key, value, "HSDP (parallel.dp_replicate > 1) is not combined with expert or context parallelism", f"set {key}=1 or parallel.dp_replicate=1"))
    return out


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
