"""Typed configuration schema: one dataclass per config group.

Every YAML file under ``conf/`` and every command-line override is merged into
these dataclasses by Hydra/OmegaConf, so a misspelt key or a wrong type is
caught at compose time. Each field carries a one-line help text (``llmforge keys``
prints them) and, for a number, its allowed range (``range="[0, 1)"``, checked by
``llmforge.config.ranges`` when the plan is built). Cross-field rules (divisibility, world size, ...) live in
``llmforge.plan``.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llmforge.config.choices import (
    Activation,
    AnomalyAction,
    AttentionMask,
    Choice,
    DataSource,
    DecayShape,
    Dtype,
    Fp8Linears,
    Fp8Recipe,
    Launcher,
    LrSchedule,
    MemorySnapshot,
    MoeBalance,
    Norm,
    NsDtype,
    Offload,
    Optimizer,
    Position,
    Qat,
    Recompute,
    Rehearse,
    Schedule,
    WandbMode,
    choice_type,
    plain,
)
from llmforge.config.eval_config import EvalConfig
from llmforge.config.fields import knob
from llmforge.config.health import HealthConfig
from llmforge.config.launchers import KubernetesConfig, SkyPilotConfig

#: The names of the choice keys, derived from their enums (llmforge.config.choices) for callers that list them.
SCHEDULES = Schedule.names()
RECOMPUTE_MODES = Recompute.names()
ANOMALY_POLICIES = AnomalyAction.names()
OFFLOAD_MODES = Offload.names()
OPTIMIZERS = Optimizer.names()


@dataclass
class MoEConfig:
    num_experts: int = knob(0, range="[0, inf)", help="Routed experts per MoE layer; 0 makes the model dense.")
    top_k: int = knob(2, range="[1, inf)", help="Experts each token is routed to.")
    ffn_hidden_size: int | None = knob(None, range="[1, inf)", help="Hidden size of one expert's MLP (default: model.ffn_hidden_size).")
    num_shared_experts: int = knob(0, range="[0, inf)", help="Experts every token passes through besides the routed ones.")
    capacity_factor: float | None = knob(
        None,
        range="(0, inf)",
        help="Expert capacity as a multiple of the even share of tokens; tokens past it are dropped. null = dropless.",
    )
    aux_loss_coef: float = knob(0.01, range="[0, inf)", help="Weight of the Switch/GShard load-balancing loss.")
    z_loss_coef: float = knob(0.0, range="[0, inf)", help="Weight of the router z-loss (ST-MoE).")
    normalize_top_k: bool = knob(True, help="Renormalise the top-k routing weights to sum to one.")
    every: int = knob(1, range="[1, inf)", help="Make every N-th transformer block an MoE block (1 = all).")
    balance: MoeBalance = knob(
        MoeBalance.AUX,
        help="Load balancing: aux (the aux_loss_coef loss), bias (DeepSeek-V3's per-expert routing bias, no aux loss) or none.",
    )
    bias_update_rate: float = knob(
        0.001, range="[0, inf)", help="balance=bias: each step, every expert's bias moves by this toward an even load."
    )


@dataclass
class ModelConfig:
    num_layers: int = knob(2, range="[1, inf)", help="Transformer blocks.")
    hidden_size: int = knob(64, range="[1, inf)", help="Width of the residual stream.")
    num_heads: int = knob(4, range="[1, inf)", help="Attention (query) heads.")
    num_kv_heads: int | None = knob(None, range="[1, inf)", help="Key/value heads; fewer than num_heads is GQA. null = num_heads.")
    ffn_hidden_size: int = knob(256, range="[1, inf)", help="Hidden size of the MLP.")
    vocab_size: int = knob(4096, range="[1, inf)", help="Vocabulary size of embedding and output layer.")
    seq_len: int = knob(128, range="[1, inf)", help="Training sequence length in tokens.")
    norm: Norm = knob(Norm.LAYERNORM, help="Normalisation: layernorm or rmsnorm.")
    norm_eps: float = knob(1e-5, range="(0, inf)", help="Epsilon of the normalisation layers.")
    activation: Activation = knob(Activation.GELU, help="MLP activation: gelu (2-matrix MLP) or swiglu (gated, 3 matrices).")
    position: Position = knob(Position.LEARNED, help="Position encoding: learned (absolute embedding) or rope.")
    rope_theta: float = knob(10000.0, range="(0, inf)", help="RoPE base frequency.")
    attention_mask: AttentionMask = knob(
        AttentionMask.CAUSAL,
        help="causal: every token attends to all earlier tokens of its window (the fastest path). document: "
        "only to earlier tokens of its own document, the documents delimited by the end-of-document token the data "
        "preparation writes after each one (block-causal).",
    )
    position_reset: bool = knob(
        False, help="Restart positions (learned and RoPE) at 0 at each document start (needs the end-of-document token in the data)."
    )
    sliding_window: int = knob(
        0, range="[0, inf)", help="Each token attends to itself and at most N-1 earlier tokens (Mistral/Gemma-2 style); 0 = off."
    )
    sliding_window_every: int = knob(
        1,
        range="[1, inf)",
        help="With sliding_window: layer i uses the window when i % every == 0 (1: every layer; 2: layers 0, 2, 4, ... as Gemma-2), the "
        "others attend to the whole window.",
    )
    sliding_window_layers: list[int] = knob(
        help="With sliding_window: exactly these layer indices (0-based) use the window (overrides sliding_window_every); empty = use "
        "sliding_window_every.",
        factory=list,
    )
    tie_embeddings: bool = knob(True, help="Share the input embedding with the output projection.")
    bias: bool = knob(True, help="Biases in the linear layers and norms.")
    dropout: float = knob(0.0, range="[0, 1)", help="Dropout probability on attention and residual branches.")
    init_std: float = knob(0.02, range="(0, inf)", help="Standard deviation of the normal weight initialisation.")
    init_from: str | None = knob(
        None,
        help="Start from the weights of a local Hugging Face GPT-2 or Llama folder (config.json + safetensors) instead of random ones.",
    )
    moe: MoEConfig = knob(help="Mixture-of-experts settings.", factory=MoEConfig)


@dataclass
class ParallelConfig:
    dp: Any = knob("auto", help="Data-parallel degree, or auto = world size / (tp*pp*cp).")
    tp: int = knob(1, range="[1, inf)", help="Tensor-parallel degree (inside a node).")
    pp: int = knob(1, range="[1, inf)", help="Pipeline-parallel degree (stages).")
    cp: int = knob(1, range="[1, inf)", help="Context-parallel degree (sequence split across ranks).")
    ep: int = knob(1, range="[1, inf)", help="Expert-parallel degree (experts split across data-parallel ranks).")
    zero: int = knob(0, range="[0, 3]", help="ZeRO stage: 0 replicated, 1 optimizer states, 2 +gradients, 3 +parameters (FSDP).")
    dp_replicate: int = knob(
        1,
        range="[1, inf)",
        help="HSDP: split dp into dp_replicate groups of dp/dp_replicate ranks; ZeRO 1-3 shard inside a group (keep it "
        "inside a node) and all-reduce gradients across groups. 1 = shard over all of dp.",
    )
    sequence_parallel: bool = knob(
        False, help="Shard norm and dropout activations along the sequence over tp ranks; the linears keep only the shard."
    )
    async_tp: bool = knob(
        False,
        help="Async tensor parallel: torch's micro-pipelined TP (symmetric memory, under torch.compile) splits each "
        "sequence-parallel all-gather and reduce-scatter into chunks that overlap the matmuls they feed. Needs CUDA "
        "(not cluster.accelerator=cpu), train.compile=true, parallel.tp>1 and parallel.sequence_parallel=true.",
    )
    pp_schedule: Schedule = knob(Schedule.ONE_F_ONE_B, help=f"Pipeline schedule: {', '.join(SCHEDULES)}.")
    pp_virtual_stages: int = knob(1, range="[1, inf)", help="Model chunks per pipeline rank (interleaved schedules).")
    pp_layers: list[int] | None = knob(None, help="Layers per pipeline stage for an uneven split (length pp*virtual stages).")
    recompute: Recompute = knob(
        Recompute.NONE, help=f"Activation recomputation: {', '.join(RECOMPUTE_MODES[:-1])} or {RECOMPUTE_MODES[-1]}."
    )
    recompute_every: int = knob(1, range="[1, inf)", help="With full recompute, checkpoint every N-th block only.")
    overlap_grad_reduce: bool | None = knob(
        None,
        help="Overlap the gradient reduction with the last microbatch's backward: ZeRO-0 all-reduces in buckets "
        "(parallel.bucket_mb) as their gradients are ready; ZeRO-1 on CPU (gloo, fp32 reduce_dtype) launches FSDP2's "
        "per-block reduce-scatters without waiting (on GPUs FSDP2 always overlaps them). null = on for GPUs (NCCL), "
        "off on CPU (gloo), where it measured slower.",
    )
    bucket_mb: float = knob(
        25.0,
        range="(0, inf)",
        help="ZeRO-0 gradient bucket size in MB when the reduction overlaps backward. ZeRO 1-3 (FSDP2) reduce one "
        "transformer block per collective (the root: embedding, final norm, output layer, is one more).",
    )
    offload: Offload = knob(
        Offload.NONE,
        help="states: keep this rank's shard of the fp32 master weights, gradients and AdamW moments in host memory and "
        "run the optimizer step on the CPU (FSDP2 CPUOffloadPolicy; needs parallel.zero 1-3); none: all on the device.",
    )
    offload_activations: bool = knob(
        False, help="Copy the activations saved for backward to host memory during forward and back during backward."
    )


@dataclass
class PrecisionConfig:
    param_dtype: Dtype = knob(
        Dtype.FP32,
        help="Compute dtype of parameters and activations: fp32, bf16 or fp16 (master weights stay fp32; ZeRO 1-3 gather weights in it).",
    )
    reduce_dtype: Dtype = knob(
        Dtype.FP32, help="Dtype of gradient reduction across data-parallel ranks (and of ZeRO-1's accumulated gradients)."
    )
    initial_loss_scale: float = knob(65536.0, range="(0, inf)", help="fp16 only: starting dynamic loss scale.")
    loss_scale_growth_interval: int = knob(2000, range="[1, inf)", help="fp16 only: steps without overflow before the scale doubles.")
    fp32_residual: bool = knob(
        False,
        help="Keep the residual stream (and the block inputs that recompute saves) in fp32 under bf16/fp16 compute, "
        "like Megatron's --fp32-residual-connection; by default it is in param_dtype, as torchtitan and Megatron run it.",
    )
    fp8: bool = knob(
        False,
        help="FP8 training (torchao float8) of the transformer blocks' linear layers; the rest computes in param_dtype (bf16). "
        "Needs torchao (pip install 'llmforge[fp8]') and an FP8 accelerator (H100, H200, B200) or precision.fp8_emulate=true.",
    )
    fp8_recipe: Fp8Recipe = knob(
        Fp8Recipe.TENSORWISE, help="FP8 scaling: tensorwise (one scale per tensor, float8 FSDP all-gather) or rowwise (one per row)."
    )
    fp8_linears: Fp8Linears = knob(
        Fp8Linears.AUTO,
        help="Which block linear layers run in FP8: auto (only shapes large enough to pay, torchao's size rule for the recipe; "
        "llmforge plan lists them) or all (every one whose dimensions are multiples of 16, e.g. to test the numerics of a small model).",
    )
    fp8_emulate: bool = knob(False, help="Emulate the FP8 matmuls in high precision (CPU, GPUs without FP8): same casts, no speed-up.")
    fp8_all_gather: bool = knob(
        True,
        help="fp8 tensorwise under ZeRO 1-3: all-gather weights cast to float8 (half the bytes), scales computed once after each "
        "optimizer step.",
    )
    qat: Qat = knob(
        Qat.NONE,
        help="Quantization-aware training (torchao) of the transformer blocks' linear layers: none; int8-int4 (int8 dynamic "
        "per-token activations, int4 weights per group); int4 (int4 weights per group). The forward rounds as the "
        "quantized model will, the master weights stay in full precision; llmforge export writes the quantized model (docs/qat.md).",
    )
    qat_group_size: int = knob(
        32,
        range="[1, inf)",
        help="precision.qat: input columns sharing one int4 weight scale; a linear layer whose input width is not a multiple stays in "
        "full precision.",
    )
    qat_start_step: int = knob(
        0,
        range="[0, inf)",
        help="precision.qat: fake-quantize from this step (1-based) onwards, earlier steps train in full precision "
        "(QAT is often switched on for the last part of a run); 0 = from the first step.",
    )


@dataclass
class DataConfig:
    source: DataSource = knob(DataSource.BUILTIN, help="builtin (Python standard library text, no download) or files (data.path).")
    path: str | None = knob(None, help="A .txt/.jsonl/.parquet file or folder of them (sets source=files).")
    text_key: str = knob("text", help="Column holding the text in .jsonl/.parquet files.")
    tokenizer: str | None = knob(None, help="A tokenizer.json to use instead of training a byte-level BPE.")
    vocab_size: int | None = knob(None, range="[1, inf)", help="Size of the trained tokenizer (default: model.vocab_size).")
    cache_dir: str = knob("~/.cache/llmforge", help="Where prepared tokenizers and token shards are kept.")
    builtin_max_mb: float = knob(8.0, range="(0, inf)", help="Megabytes of standard-library text in the built-in corpus.")
    num_proc: int = knob(1, range="[1, inf)", help="Processes used to tokenize.")
    mixture: list[str] = knob(help="Several datasets as PATH:WEIGHT entries (overrides data.path).", factory=list)
    val_fraction: float = knob(
        0.01,
        range="[0, 1)",
        help="Fraction of documents held out for validation (never trained on; the same set for every layout), evaluated at the end of "
        "the run "
        "and every train.eval_interval steps. Per dataset: round(fraction x documents), at least 1 once it has 10 documents, at most "
        "10,000, "
        "grown (up to a tenth of the documents) until they fill one sequence; data too small for that trains without validation. 0 = no "
        "validation.",
    )
    val_seed: int = knob(
        0, range="[0, inf)", help="Seed choosing the held-out documents (kept apart from train.seed so runs with other seeds share them)."
    )


@dataclass
class CheckpointConfig:
    interval: int | None = knob(
        None,
        range="[0, inf)",
        help="Save every N steps; 0 = only at the end; null = a tenth of train.steps (at least 10 steps), so a crash loses at most that.",
    )
    keep: int = knob(3, range="[1, inf)", help="Complete checkpoints to keep; older ones are removed.")
    async_save: bool = knob(False, help="Save in the background (alias: checkpoint.async).")
    save_final: bool = knob(True, help="Save after the last step.")
    dir: str | None = knob(
        None,
        help="Where checkpoints go: unset = run.dir/checkpoints; an object-storage URL (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, any "
        "fsspec URL of a persistent store) puts step_N/ there, owned by this run (owner.json; another run is refused it). "
        "Credentials come from the environment and config files (AWS_*, ~/.aws), never the plan; an S3-compatible "
        "server from AWS_ENDPOINT_URL.",
    )


@dataclass
class TrainConfig:
    micro_batch_size: int = knob(8, range="[1, inf)", help="Sequences per microbatch per data-parallel rank.")
    global_batch_size: int = knob(8, range="[1, inf)", help="Sequences per optimizer step across all ranks.")
    steps: int = knob(100, range="[1, inf)", help="Optimizer steps.")
    lr: float = knob(3e-4, range="(0, inf)", help="Peak learning rate.")
    seed: int = knob(1234, range="[0, inf)", help="Seed for initialisation, data order and dropout.")
    log_interval: int = knob(1, range="[1, inf)", help="Log metrics every N steps.")
    compile: bool = knob(False, help="torch.compile each transformer block (the first steps pay the compile time).")
    eval_interval: int = knob(
        0, range="[0, inf)", help="Validation loss every N steps on the data.val_fraction split (0 = only at the end of the run)."
    )
    eval_steps: int = knob(10, range="[1, inf)", help="Global batches of held-out sequences per validation.")
    profile: str | None = knob(
        None,
        help="Steps to trace with torch.profiler, START-END (or one step N): run.dir/profile/rank<R>.steps<START>-<END>.pt.trace.json per "
        "rank (Perfetto, TensorBoard). null = off.",
    )
    memory_snapshot: MemorySnapshot = knob(
        MemorySnapshot.OOM,
        help="GPUs: oom = record live CUDA allocations and write run.dir/profile/oom_rank<R>.pickle on out-of-memory; profile = record "
        "every allocation from the start and also write a snapshot at the end of train.profile (open at pytorch.org/memory_viz); off.",
    )
    anomaly: AnomalyAction = knob(
        AnomalyAction.SKIP,
        help="A step whose loss or gradient norm is non-finite on any rank never updates the weights or optimizer state; then: "
        "stop = end the run (exit code 2) naming the step and the resume command; skip = go on, and after more than "
        "train.max_skipped_steps "
        "skips in a row stop; rollback = go on, and after more than train.max_skipped_steps skips in a row reload the weights and "
        "optimizer "
        "state of the newest checkpoint older than the first of them (step count, schedule and data stream go on, past the bad batches), "
        "at most train.max_rollbacks times.",
    )
    max_skipped_steps: int = knob(
        5,
        range="[0, inf)",
        help="skip/rollback: consecutive skipped steps tolerated; one more stops the run (skip) or rolls it back (rollback).",
    )
    max_rollbacks: int = knob(
        3, range="[0, inf)", help="rollback: rollbacks allowed in one launch; the anomaly after the last one stops the run."
    )
    rollback_lr_factor: float = knob(
        1.0, range="(0, 1]", help="rollback: multiply the learning rate by this at each rollback (e.g. 0.5; 1.0 keeps it)."
    )
    loss_spike_window: int = knob(
        128,
        range="[0, inf)",
        help="Loss spikes: a step whose loss exceeds the mean of the previous N steps' finite losses by loss_spike_sigma standard "
        "deviations is logged as loss_spike (tested once N steps ran). 0 = off.",
    )
    loss_spike_sigma: float = knob(
        6.0, range="(0, inf)", help="Loss spikes: standard deviations above the window's mean that make a spike."
    )
    loss_spike_skip: bool = knob(False, help="Treat a loss spike like a non-finite step (skipped, and counted by train.anomaly).")
    rehearse: Rehearse = knob(
        Rehearse.AUTO,
        help="Before launch, run the most-loaded rank's build and one step on fake tensors on this CPU (llmforge estimate --rehearse) "
        "and refuse a plan whose rehearsed peak does not fit the device: always, never, or auto (plans of 1B parameters or more on "
        "accelerators).",
    )


@dataclass
class OptimConfig:
    name: Optimizer = knob(
        Optimizer.ADAMW,
        help="Optimizer: adamw, or muon (Newton-Schulz orthogonalised momentum for the blocks' weight matrices, "
        "AdamW for embeddings, output layer, norms, biases and routers; see docs/muon.md).",
    )
    weight_decay: float = knob(0.1, range="[0, inf)", help="Decoupled weight decay (not applied to biases, norms, embeddings).")
    beta1: float = knob(0.9, range="[0, 1)", help="AdamW beta1.")
    beta2: float = knob(0.95, range="[0, 1)", help="AdamW beta2.")
    eps: float = knob(1e-8, range="(0, inf)", help="AdamW epsilon.")
    grad_clip: float = knob(1.0, range="[0, inf)", help="Clip the global gradient norm to this (0 = off).")
    warmup_steps: int = knob(10, range="[0, inf)", help="Linear warm-up steps.")
    schedule: LrSchedule = knob(
        LrSchedule.COSINE,
        help="After warm-up: cosine, linear, constant, or wsd (warmup-stable-decay: constant, then a decay over the last "
        "optim.decay_fraction of the steps).",
    )
    min_lr_ratio: float = knob(0.1, range="[0, 1]", help="Final learning rate as a fraction of train.lr.")
    decay_fraction: float = knob(0.2, range="(0, 1]", help="wsd only: fraction of train.steps spent decaying to min_lr_ratio at the end.")
    decay_shape: DecayShape = knob(DecayShape.SQRT, help="wsd only: shape of the decay: linear, cosine or sqrt (1 - sqrt(progress)).")
    muon_momentum: float = knob(0.95, range="[0, 1)", help="muon only: momentum of the matrices' gradient buffer.")
    muon_nesterov: bool = knob(
        True, help="muon only: orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."
    )
    muon_ns_steps: int = knob(5, range="[1, 99]", help="muon only: Newton-Schulz iterations per matrix and step.")
    muon_ns_dtype: NsDtype = knob(
        NsDtype.FP32, help="muon only: dtype of the Newton-Schulz iterations: fp32, or bf16 (faster on GPUs, as torch.optim.Muon does)."
    )
    adamw_lr: float | None = knob(
        None,
        range="(0, inf)",
        help="muon only: peak learning rate of the AdamW parameters (embeddings, output layer, norms, biases, routers); "
        "null = train.lr (the Muon updates are scaled by 0.2*sqrt(max(rows, cols)) to AdamW's update size, so one rate suits both).",
    )


@dataclass
class ClusterConfig:
    accelerator: str = knob("cpu", help="Hardware profile name (llmforge estimate lists them) or a profile YAML path.")
    nodes: int = knob(1, range="[1, inf)", help="Nodes.")
    min_nodes: int | None = knob(
        None,
        range="[1, inf)",
        help="Elastic training: the job goes on with as few as this many nodes (torchrun --nnodes=min_nodes:nodes); after a "
        "node is lost the ranks restart at the smaller world, parallel.dp=auto over it, from the newest checkpoint. "
        "null = cluster.nodes (not elastic).",
    )
    elastic_wait_s: int = knob(
        30,
        range="[1, inf)",
        help="Elastic training: after a restart the rendezvous waits this long for more nodes to join once cluster.min_nodes "
        "are there (torchrun's last_call_timeout); a lost node is noticed within about half of it (keep-alive).",
    )
    devices_per_node: int | None = knob(
        None, range="[1, inf)", help="Processes (GPUs) per node; world size = nodes * devices_per_node. null = as many as the layout needs."
    )
    launcher: Launcher = knob(
        Launcher.LOCAL,
        help="local: torchrun on this node (a one-rank plan trains in this process); torchrun: torchrun even "
        "for one rank, through the process group, device mesh and NCCL as multi-GPU runs go (checks that path "
        "on one GPU); slurm: write an sbatch script; kubernetes: a TrainJob or JobSet (cluster.kubernetes); "
        "skypilot: a SkyPilot task (cluster.skypilot). See docs/launch.md.",
    )
    image: str | None = knob(
        None, help="kubernetes, skypilot: the container image with llmforge and torch installed (required on kubernetes)."
    )
    network_check: bool | None = knob(
        None,
        help="Before training, time an all-reduce across the nodes and refuse the run when its bus bandwidth is below "
        "cluster.network_min_fraction of the profile's inter-node rate; null = on for multi-node runs on accelerators (a CPU "
        "profile describes no network).",
    )
    network_min_fraction: float = knob(
        0.5,
        range="(0, 1]",
        help="The network check refuses a run whose measured all-reduce bus bandwidth is below this fraction of the "
        "profile's inter_node_gbs x comm_efficiency (what the estimate assumes).",
    )
    kubernetes: KubernetesConfig = knob(help="cluster.launcher=kubernetes: the TrainJob or JobSet.", factory=KubernetesConfig)
    skypilot: SkyPilotConfig = knob(help="cluster.launcher=skypilot: the SkyPilot task.", factory=SkyPilotConfig)
    rdzv_endpoint: str | None = knob(None, help="host:port of the rendezvous for multi-node runs.")
    efficiency: float | None = knob(
        None,
        range="(0, 1]",
        help="null: the estimator times each kernel with the hardware profile's calibrated rates; a number in (0, 1]: "
        "it assumes every FLOP runs at that fraction of peak instead.",
    )
    timeout_s: int = knob(
        300,
        range="[1, inf)",
        help="A stuck rank ends the job after this many seconds: collectives time out after it (after the first step; "
        "before it, data preparation, build and compile get at least 600 s), and a rank silent for half of it is named and stopped.",
    )
    max_restarts: int = knob(
        0,
        range="[0, inf)",
        help="After a rank fails, restart every rank up to N times (torchrun --max-restarts); they resume from the newest complete "
        "checkpoint.",
    )
    health: HealthConfig = knob(
        help="The run's health watch: hangs found from the loop's progress, stragglers named, accelerators checked (docs/launch.md).",
        factory=HealthConfig,
    )


@dataclass
class WandbConfig:
    mode: WandbMode = knob(WandbMode.AUTO, help="auto (online with WANDB_API_KEY or a login, else offline), online, offline or disabled.")
    project: str = knob("llmforge", help="W&B project.")
    entity: str | None = knob(None, help="W&B entity (team or user).")


@dataclass
class LoggingConfig:
    console: bool = knob(True, help="Show the Rich progress bar.")
    tensorboard: bool = knob(
        False, help="Also log every metric to TensorBoard in run.dir/tensorboard (needs pip install 'llmforge[tensorboard]')."
    )
    wandb: WandbConfig = knob(help="Weights & Biases.", factory=WandbConfig)


@dataclass
class GenerateConfig:
    max_tokens: int = knob(64, range="[1, inf)", help="llmforge generate: tokens to generate after the prompt.")
    temperature: float = knob(
        1.0, range="[0, inf)", help="llmforge generate: sampling temperature; 0 = greedy (always the most likely token)."
    )
    top_k: int = knob(0, range="[0, inf)", help="llmforge generate: sample among the k most likely tokens only (0 = all).")
    top_p: float = knob(
        1.0, range="(0, 1]", help="llmforge generate: sample among the most likely tokens whose probabilities sum to p (1.0 = all)."
    )
    seed: int = knob(0, range="[0, inf)", help="llmforge generate: seed of the sampling.")
    stop_at_eos: bool = knob(True, help="llmforge generate: stop at the end-of-document token.")
    kv_cache: bool = knob(
        True,
        help="llmforge generate: keep each layer's keys and values so a new token costs the same at any prefix length "
        "(false: run the model over the whole context for every token).",
    )


@dataclass
class RunConfigSection:
    dir: str = knob("runs/${run.name}", help="Run directory: plan.json, metrics.jsonl, checkpoints/.")
    name: str = knob("tiny", help="Run name (W&B run name, default run folder).")


@dataclass
class RunConfig:
    """The whole composed configuration of one run."""

    recipe: str = knob("tiny", help="The recipe this configuration came from.")
    model: ModelConfig = knob(help="Transformer shape and flavour.", factory=ModelConfig)
    parallel: ParallelConfig = knob(help="Parallel layout and strategy.", factory=ParallelConfig)
    precision: PrecisionConfig = knob(help="Numeric precision.", factory=PrecisionConfig)
    data: DataConfig = knob(help="Training data.", factory=DataConfig)
    checkpoint: CheckpointConfig = knob(help="Checkpointing.", factory=CheckpointConfig)
    train: TrainConfig = knob(help="Batch sizes, steps, learning rate, seed.", factory=TrainConfig)
    optim: OptimConfig = knob(help="Optimizer and learning-rate schedule.", factory=OptimConfig)
    cluster: ClusterConfig = knob(help="Where the run executes.", factory=ClusterConfig)
    logging: LoggingConfig = knob(help="Console and Weights & Biases logging.", factory=LoggingConfig)
    run: RunConfigSection = knob(help="Run directory and name.", factory=RunConfigSection)
    generate: GenerateConfig = knob(help="Text generation from a checkpoint (llmforge generate).", factory=GenerateConfig)
    eval: EvalConfig = knob(help="Downstream tasks through lm-evaluation-harness (llmforge eval, eval.interval).", factory=EvalConfig)


GROUPS = ("model", "parallel", "precision", "data", "checkpoint", "optim", "cluster", "logging")


def iter_keys(cls: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted key, type name, default, help) for every leaf field; a choice's type
    name lists its names (``none|selective|full``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if isinstance(f.type, type) and dataclasses.is_dataclass(f.type):
            yield from iter_keys(f.type, key + ".")
            continue
        sub = _nested_dataclass(cls, f.name)
        if sub is not None:
            yield from iter_keys(sub, key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        allowed = f.metadata.get("range")
        help_text = f.metadata.get("help", "") + (f" Range: {allowed}." if allowed is not None else "")
        kind = choice_type(hints[f.name])
        yield key, "|".join(kind.names()) if kind else str(f.type), plain(default), help_text


def choice_keys(cls: type = RunConfig, prefix: str = "") -> dict[str, type[Choice]]:
    """Every choice key (``parallel.recompute``) with its enum, read from the schema's types."""
    out: dict[str, type[Choice]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        kind = choice_type(hints[f.name])
        if sub is not None:
            out.update(choice_keys(sub, f"{prefix}{f.name}."))
        elif kind is not None:
            out[f"{prefix}{f.name}"] = kind
    return out


def values_by_key(config: Any) -> dict[str, Any]:
    """Every leaf value of a config dataclass (or nested dict) by its dotted key."""
    data = plain(dataclasses.asdict(config)) if dataclasses.is_dataclass(config) and not isinstance(config, type) else config
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(data, "")
    return out


def _nested_dataclass(cls: type, name: str) -> type | None:
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None
