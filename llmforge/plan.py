"""RunPlan: a RunConfig plus everything derived from it, validated as a whole.

``RunPlan.build(config)`` checks every cross-field rule and raises one UserError
listing each problem (key, value, rule, fix). A built plan is internally
consistent: the estimator, the launcher and the trainer take it as given.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmforge.config.choices import DataSource, Dtype, Position, Qat, choice_problem, plain
from llmforge.config.compose import split_unknown_names, with_names
from llmforge.config.eval_rules import check_eval
from llmforge.config.locations import location_problems
from llmforge.config.qat_rules import check_qat
from llmforge.config.ranges import INT64_MAX, range_problems
from llmforge.config.schema import ModelConfig, RunConfig, choice_keys
from llmforge.config.train_rules import check_training
from llmforge.elastic import check_elastic, world_problems
from llmforge.errors import Problem, UserError, fail
from llmforge.hardware import get_profile, is_known, unknown_problem
from llmforge.layout import Layout
from llmforge.layout_rules import (
    check_async_tp,
    check_backend,
    check_batch,
    check_ep,
    check_hsdp,
    check_offload,
    check_pipeline,
    check_tp,
    check_world,
    ints,
    world_and_dp,
)

#: Every choice key with its names, read from the schema's enum types (llmforge.config.choices).
CHOICES: dict[str, tuple[str, ...]] = {key: kind.names() for key, kind in choice_keys().items()}


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
    layers_per_stage: list[int]
    moe_layers: list[int]
    tokens_per_step: int
    data_vocab_size: int

    @functools.cached_property
    def layout(self) -> Layout:
        """The parallel layout; ``str(plan.layout)`` is its short name (``dp2xtp2``)."""
        return Layout.from_config(self.config, dp=self.dp)

    @property
    def overlap_grad_reduce(self) -> bool:
        """ZeRO-0 reduces gradients in buckets during backward: by default on GPUs, not on
        CPU, where gloo's communication thread competes with compute for the same cores."""
        choice = self.config.parallel.overlap_grad_reduce
        return self.config.cluster.accelerator != "cpu" if choice is None else choice

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (0: only at the end). Unset, a tenth of the run and at
        least AUTO_MIN_INTERVAL steps: a crash loses at most that much of the run."""
        interval = self.config.checkpoint.interval
        if interval is not None:
            return interval
        return max(-(-self.config.train.steps // 10), AUTO_MIN_INTERVAL)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.dir)

    @property
    def checkpoint_root(self) -> Path | str:
        """Where checkpoints go: ``run.dir/checkpoints``, or the object-storage URL of ``checkpoint.dir``."""
        return self.config.checkpoint.dir.rstrip("/") if self.config.checkpoint.dir else self.run_dir / "checkpoints"

    @classmethod
    def build(cls, config: RunConfig, *, world: int | None = None) -> RunPlan:
        """The validated plan; ``world``: the ranks torchrun started for an elastic run
        (a node count of its range), which sets the world size and ``parallel.dp: auto``."""
        problems = _validate(config)
        if world is not None:
            problems += world_problems(config, world)
        if problems:
            raise UserError(problems, title="the run plan is not valid")
        return cls._derive(config, world=world)

    def at_world(self, world: int) -> RunPlan:
        """This plan on the ``world`` ranks an elastic run got (itself when unchanged)."""
        return self if world == self.world_size else RunPlan.build(self.config, world=world)

    @classmethod
    def _derive(cls, config: RunConfig, *, world: int | None = None) -> RunPlan:
        m, p = config.model, config.parallel
        world, dp = world_and_dp(config, world=world)
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

    def derived(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}

    def to_dict(self) -> dict[str, Any]:
        return {"config": plain(dataclasses.asdict(self.config)), "derived": plain(self.derived())}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: Path) -> RunPlan:
        try:
            data = json.loads(Path(path).read_text())
            config = config_from_dict(data["config"])
        except FileNotFoundError:
            raise fail(f"{path}: no plan.json here; point ckpt= at a run folder or one of its checkpoints") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise fail(f"{path}: plan.json is unreadable ({exc}); the run folder is damaged") from None
        return cls.build(config)


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Rebuild a typed RunConfig from its dict form (plan.json), applying dotted overrides."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
    dotted, unknown_names = split_unknown_names(list(overrides or []))
    if dotted:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotted))
    return with_names(OmegaConf.to_object(cfg), unknown_names)  # type: ignore[arg-type]


def _validate(config: RunConfig) -> list[Problem]:
    problems: list[Problem] = []
    checks = (
        _check_choices,
        _check_ranges,
        _check_model,
        check_world,
        check_tp,
        check_pipeline,
        check_batch,
        _check_moe,
        check_ep,
        _check_data,
        _check_accelerator,
        _check_fp8,
        check_hsdp,
        check_backend,
        check_async_tp,
        check_offload,
        check_elastic,
        check_training,
        location_problems,
        check_eval,
        check_qat,
    )
    for check in checks:
        problems.extend(check(config))
    return problems


def _check_choices(config: RunConfig) -> list[Problem]:
    out = []
    for key, allowed in CHOICES.items():
        value = get_key(config, key)
        if value not in allowed:
            out.append(choice_problem(key, value, allowed))
    return out


def _check_ranges(config: RunConfig) -> list[Problem]:
    """Every number against its schema field's range (llmforge.config.ranges); parallel.dp is a number or auto."""
    out = range_problems(config)
    dp = config.parallel.dp
    if dp != "auto" and not (isinstance(dp, int) and not isinstance(dp, bool) and 1 <= dp <= INT64_MAX):
        out.append(Problem("parallel.dp", dp, "must be a positive integer or auto", "set parallel.dp=auto or e.g. parallel.dp=2"))
    return out


def _check_model(config: RunConfig) -> list[Problem]:
    m = config.model
    out: list[Problem] = []
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads > 0 and m.hidden_size % m.num_heads:
        out.append(
            Problem(
                "model.hidden_size",
                m.hidden_size,
                f"not divisible by model.num_heads={m.num_heads}",
                "make hidden_size a multiple of num_heads",
            )
        )
    if kv >= 1 and m.num_heads > 0 and m.num_heads % kv:  # kv < 1: a range problem
        out.append(
            Problem(
                "model.num_kv_heads",
                m.num_kv_heads,
                f"must divide model.num_heads={m.num_heads}",
                "use a divisor of num_heads (GQA groups)",
            )
        )
    if m.position == Position.ROPE and m.num_heads > 0 and (m.hidden_size // m.num_heads) % 2:
        out.append(Problem("model.position", m.position, "RoPE needs an even head dimension", "change hidden_size or num_heads"))
    return out + _check_window(m)


def _check_window(m: ModelConfig) -> list[Problem]:
    """The sliding-window keys: a size, and which layers use it."""
    out: list[Problem] = []
    if m.sliding_window < 0:
        out.append(
            Problem(
                "model.sliding_window",
                m.sliding_window,
                "must be 0 (off) or a window size in tokens",
                "set model.sliding_window=0 or e.g. 4096",
            )
        )
    if m.sliding_window_every < 1:
        out.append(
            Problem("model.sliding_window_every", m.sliding_window_every, "must be 1 or more", "1: every layer; 2: every second layer")
        )
    if m.sliding_window == 0:
        idle = [
            (k, v)
            for k, v in (
                ("model.sliding_window_every", m.sliding_window_every),
                ("model.sliding_window_layers", list(m.sliding_window_layers)),
            )
            if v not in (1, [])
        ]
        out += [
            Problem(
                k,
                v,
                "chooses the layers of a sliding window, and model.sliding_window is 0 (off), so it does nothing",
                f"also set model.sliding_window={max(1, m.seq_len // 2)} (tokens; any from 1 up to model.seq_len), or remove {k}",
            )
            for k, v in idle
        ]
    bad = [i for i in m.sliding_window_layers if not 0 <= i < m.num_layers]
    if bad:
        out.append(
            Problem(
                "model.sliding_window_layers",
                list(m.sliding_window_layers),
                f"layers {bad} do not exist (model.num_layers={m.num_layers})",
                f"use indices 0..{m.num_layers - 1}",
            )
        )
    return out


def _check_moe(config: RunConfig) -> list[Problem]:
    """top_k against the number of experts (ranges: the schema; expert parallelism: llmforge.layout_rules.check_ep)."""
    moe = config.model.moe
    if moe.num_experts > 0 and moe.top_k > moe.num_experts:
        return [Problem("model.moe.top_k", moe.top_k, f"must be between 1 and model.moe.num_experts={moe.num_experts}", "lower top_k")]
    return []


def _check_data(config: RunConfig) -> list[Problem]:
    d = config.data
    out: list[Problem] = []
    if d.source == DataSource.FILES and not d.path and not d.mixture:
        out.append(Problem("data.path", d.path, "data.source=files needs files to read", "set data.path=FILE_OR_FOLDER"))
    if d.vocab_size is not None and d.vocab_size > config.model.vocab_size:
        out.append(
            Problem(
                "data.vocab_size",
                d.vocab_size,
                f"larger than model.vocab_size={config.model.vocab_size}",
                "lower data.vocab_size or raise model.vocab_size",
            )
        )
    return out


#: The shortest automatic checkpoint interval: shorter runs save at the end (and when stopped).
AUTO_MIN_INTERVAL = 10

#: The smallest vocabulary of a trained tokenizer (llmforge.data.tokenizer.MIN_VOCAB).
MIN_TRAINED_VOCAB = 257


def tokenizer_problems(config: RunConfig) -> list[Problem]:
    """A trained byte-level BPE needs its 256 byte tokens and the end-of-document token.
    Checked before data is prepared (not by build(): plans on synthetic data may be
    smaller); the key named is the one that set the size."""
    d = config.data
    key, size = ("data.vocab_size", d.vocab_size) if d.vocab_size is not None else ("model.vocab_size", config.model.vocab_size)
    if d.tokenizer is None and ints(size) and size < MIN_TRAINED_VOCAB:
        return [
            Problem(
                key,
                size,
                f"a trained byte-level BPE needs at least {MIN_TRAINED_VOCAB} tokens (256 bytes and the end-of-document token)",
                f"set {key} to {MIN_TRAINED_VOCAB} or more (4096 for the built-in corpus)",
            )
        ]
    return []


def _check_accelerator(config: RunConfig) -> list[Problem]:
    """cluster.accelerator must name a hardware profile (llmforge.hardware) or a profile file."""
    name = config.cluster.accelerator
    if is_known(name):
        return []
    if name.endswith((".yaml", ".yml")):
        return [Problem("cluster.accelerator", name, "profile file not found", "pass an existing .yaml path or a profile name")]
    return [unknown_problem(name)]


def launch_problems(config: RunConfig) -> list[Problem]:
    """What launching needs from this machine beyond a valid plan: torchao for precision.fp8 and precision.qat.
    Not checked by build(): planning and estimating an FP8 run need no torchao."""
    if config.precision.fp8 and not installed("torchao"):
        return [
            Problem(
                "precision.fp8",
                True,
                "FP8 training runs on torchao, which is not installed",
                "pip install 'llmforge[fp8]' (or pip install torchao), or use precision=bf16",
            )
        ]
    if config.precision.qat != Qat.NONE and not installed("torchao"):
        return [
            Problem(
                "precision.qat",
                config.precision.qat,
                "quantization-aware training runs on torchao, which is not installed",
                "pip install 'llmforge[fp8]' (or pip install torchao), or set precision.qat=none",
            )
        ]
    return []


def _check_fp8(config: RunConfig) -> list[Problem]:
    """precision.fp8 needs bf16 (or fp32) for the rest, and FP8 tensor cores unless emulated (and
    torchao at launch: ``launch_problems``; compiled blocks and a gain by the estimate, unless
    forced: ``llmforge.commands.plans.check_fp8_pays``)."""
    pr = config.precision
    out: list[Problem] = []
    if not pr.fp8:
        return out
    if pr.param_dtype == Dtype.FP16:
        out.append(
            Problem(
                "precision.param_dtype",
                pr.param_dtype,
                "fp8 is not combined with fp16 loss scaling (FP8 gradients use e5m2 with their own scales)",
                "use precision=fp8 (bf16 for the rest) or precision.param_dtype=bf16",
            )
        )
    name = config.cluster.accelerator
    if is_known(name) and not pr.fp8_emulate and not get_profile(name).has_fp8:
        out.append(
            Problem(
                "cluster.accelerator",
                name,
                "has no FP8 tensor cores (its profile gives no peak_tflops.fp8), so precision.fp8 cannot run there",
                "use an H100, H200 or B200 (cluster=h100-node), precision=bf16, or precision.fp8_emulate=true to test the numerics "
                "without a speed-up (with precision.fp8_linears=all on a model too small for float8 to pay)",
            )
        )
    return out


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
