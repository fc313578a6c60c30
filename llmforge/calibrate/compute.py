"""One device's compute, timed: matmuls, fused causal attention, memory-bound kernels,
the per-kernel launch floor, usable memory and, on a CPU, the host cost of a DTensor call
(``llmforge.calibrate.host_probe``; ``llmforge.calibrate.fit`` fits them).

Shapes follow transformer training: for a width ``h`` and ``t`` tokens the MLP's
forward ``[t x h] @ [h x 4h]``, its input gradient ``[t x 4h] @ [4h x h]``, its weight
gradient ``[h x t] @ [t x 4h]`` and a projection ``[t x h] @ [h x h]``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmforge.calibrate.fit import AttentionSample, BandwidthSample, ComputeSamples, MatmulSample
from llmforge.calibrate.host_probe import in_subprocess
from llmforge.calibrate.probe import CpuLoad
from llmforge.calibrate.timing import seconds_per_call
from llmforge.calibrate.trust import PASSES, combine
from llmforge.config.choices import Dtype
from llmforge.config.dtypes import TORCH_NAMES
from llmforge.config.schema import ModelConfig
from llmforge.estimate.kernels import microbatch_kernels
from llmforge.estimate.shape import shape_from_config
from llmforge.hardware import cpu_model
from llmforge.models.gpt import GPT
from llmforge.models.layers import gelu

Tick = Callable[[str], None]


@dataclass(frozen=True)
class Grid:
    """What one calibration measures (``grid_for``)."""

    widths: Sequence[int]
    tokens: Sequence[int]
    attention: Sequence[tuple]  # (sequence length, head dim)
    attention_tokens: int
    elements: Sequence[int]  # memory-bound kernel sizes
    budget_s: float  # per timing

    def matmul_shapes(self) -> list[tuple]:
        out = []
        for h in self.widths:
            for t in self.tokens:
                out += [(t, h, 4 * h), (t, 4 * h, h), (h, t, 4 * h), (t, h, h)]
        return out


def grid_for(device: torch.device, *, quick: bool) -> Grid:
    """Transformer-sized shapes for the device: small ones on a CPU, fewer with ``quick``."""
    if device.type == "cpu":
        if quick:
            return Grid((128, 256, 512), (512, 2048), ((128, 32), (512, 64)), 2048, (2**16, 2**18, 2**20, 2**22, 2**24), 0.03)
        return Grid(
            (128, 256, 512, 1024), (512, 2048, 4096), ((128, 32), (512, 64), (1024, 64)), 4096, (2**16, 2**18, 2**20, 2**22, 2**24), 0.15
        )
    # memory-bound sizes from 256 MiB of fp32 up: far beyond the L2 cache (50-126 MB), and kernels
    # long enough that the host's launches stay ahead of them
    if quick:
        return Grid((1024, 4096), (4096,), ((2048, 128),), 16384, (2**26, 2**28), 0.05)
    return Grid(
        (768, 1024, 2048, 4096, 8192), (2048, 8192, 16384), ((1024, 64), (2048, 128), (4096, 128)), 32768, (2**26, 2**27, 2**28), 0.2
    )


def supported_dtypes(device: torch.device) -> list[str]:
    """Precision names whose matmuls this device runs (every one on a CPU and a recent GPU)."""
    names = ["fp32", "bf16", "fp16"]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        names.remove("bf16")
    return names


def has_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")


def time_matmul(m: int, k: int, n: int, *, dtype: str, device: torch.device, budget_s: float) -> float:
    if dtype == "fp8":
        return _time_fp8(m, k, n, device=device, budget_s=budget_s)
    tdt = getattr(torch, TORCH_NAMES[dtype])
    a = torch.randn(m, k, device=device, dtype=tdt)
    b = torch.randn(k, n, device=device, dtype=tdt)
    return seconds_per_call(lambda: a @ b, device=device, budget_s=budget_s)


def _time_fp8(m: int, k: int, n: int, *, device: torch.device, budget_s: float) -> float:
    """A tensorwise-scaled float8 matmul (torch._scaled_mm, as torchao's Float8Linear runs it)."""
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return seconds_per_call(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device=device, budget_s=budget_s
    )


def matmuls(grid: Grid, *, dtype: str, device: torch.device, tick: Tick) -> list[MatmulSample]:
    """The grid's matmuls in ``dtype``; on a CPU only the reference dtype (fp32) runs the whole
    grid, the others (often emulated, up to 100x slower) one small MLP shape."""
    out = []
    shapes = (
        grid.matmul_shapes() if device.type == "cuda" or dtype == Dtype.FP32 else [(grid.tokens[0], grid.widths[0], 4 * grid.widths[0])]
    )
    for m, k, n in shapes:
        out.append(MatmulSample(m, k, n, time_matmul(m, k, n, dtype=dtype, device=device, budget_s=grid.budget_s)))
        tick(f"matmul {dtype} {m}x{k}x{n}")
    return out


def attention(grid: Grid, *, dtype: str, device: torch.device, tick: Tick) -> list[AttentionSample]:
    """Causal SDPA, forward and forward + backward, at ``grid.attention_tokens`` tokens of 8 heads."""
    tdt = getattr(torch, TORCH_NAMES[dtype])
    out = []
    for seq, head_dim in grid.attention:
        batch = max(1, grid.attention_tokens // seq)
        q, k, v = (torch.randn(batch, 8, seq, head_dim, device=device, dtype=tdt, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, 8, seq, head_dim, device=device, dtype=tdt)
        forward, both = attention_calls(q, k, v, grad)
        with torch.no_grad():
            fwd = seconds_per_call(forward, device=device, budget_s=grid.budget_s)
        total = seconds_per_call(both, device=device, budget_s=grid.budget_s)
        out.append(AttentionSample(batch * 8, seq, head_dim, fwd, total))
        tick(f"attention {dtype} seq {seq} head {head_dim}")
    return out


def attention_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[Callable, Callable]:
    """(causal SDPA forward, its forward and backward). The backward returns the gradients
    (``autograd.grad``) instead of accumulating them into ``.grad``: the accumulation is a kernel
    that training's activations never run."""

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> tuple:
        return torch.autograd.grad(forward(), (q, k, v), grad)

    return forward, both


def bandwidth(grid: Grid, *, device: torch.device, tick: Tick) -> list[BandwidthSample]:
    """The memory-bound kernels of a training step, fp32, at each size: copies (read + write),
    additions (two reads, one write), and the elementwise kernels a block and the loss run
    forward and backward (GELU, layer norm over rows of a model's width, log-softmax over rows of
    4096), each counted as the kernel model counts it: a forward reads and writes the tensor once,
    a backward reads two and writes one (20 bytes per element for both). Bytes are those read
    plus those written, as a datasheet's memory bandwidth counts them (a copy of N bytes moves
    2N). On a GPU all of them run at the memory's speed; on a CPU the transcendentals make GELU
    and softmax slower than their bytes, and the fit's time-weighted rate follows what a step
    spends there."""
    out = []
    for n in grid.elements:
        out += _bandwidth_at(n, device=device, budget_s=grid.budget_s)  # its tensors freed before the next size's
        tick(f"memory-bound {n:,} elements")
    return out


def _bandwidth_at(n: int, *, device: torch.device, budget_s: float) -> list[BandwidthSample]:
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    dst = torch.empty_like(a)
    out = [
        BandwidthSample("copy", 8 * n, seconds_per_call(lambda: dst.copy_(a), device=device, budget_s=budget_s)),
        BandwidthSample("add", 12 * n, seconds_per_call(lambda: a + b, device=device, budget_s=budget_s)),
    ]
    x, grad = torch.randn(n, device=device, requires_grad=True), torch.randn(n, device=device)
    for kind, run in training_kernels(x, grad, width=norm_width(device)).items():
        out.append(BandwidthSample(kind, 20 * n, seconds_per_call(run, device=device, budget_s=budget_s)))
    return out


def norm_width(device: torch.device) -> int:
    """The layer norm's row: a CPU model's width (the tiny recipe's 128), a GPU model's (1024)."""
    return 128 if device.type == "cpu" else 1024


def training_kernels(x: torch.Tensor, grad: torch.Tensor, *, width: int) -> dict:
    """Forward-and-backward closures of the elementwise kernels over the fp32 elements of ``x``
    (its gradient ``grad``; layer norm over rows of ``width``): GELU as the model runs it
    (``llmforge.models.layers.gelu``, the tanh form, which on a CPU takes four times the exact
    one's time), the layer norm and the loss's log-softmax. Each returns the input's gradient
    (``autograd.grad``) instead of accumulating it into ``x.grad``: the accumulation would add a
    kernel (12 bytes an element) that training's activations never run, uncounted."""
    n = x.numel()
    forwards = {"gelu": lambda: gelu(x)}
    if n % width == 0:
        forwards["layer_norm"] = lambda: F.layer_norm(x.view(-1, width), (width,)).view(-1)
    if n % 4096 == 0:
        forwards["log_softmax"] = lambda: F.log_softmax(x.view(-1, 4096), dim=-1).view(-1)
    return {kind: (lambda forward=forward: torch.autograd.grad(forward(), x, grad)) for kind, forward in forwards.items()}


def launch_floor(*, device: torch.device, budget_s: float) -> float:
    """Seconds per small eager op as training issues them: autograd recording each one."""
    x = torch.randn(16, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(100):
            y = y * 1.0001
        return y

    return seconds_per_call(chain, device=device, budget_s=budget_s) / 100


#: The step floor's model: llmforge's GPT at a width where no kernel has work to speak of.
FLOOR_MODEL = ModelConfig(num_layers=2, hidden_size=16, num_heads=2, ffn_hidden_size=64, vocab_size=64, seq_len=8)
FLOOR_BATCH = 2


def step_floor(*, device: torch.device, budget_s: float) -> float:
    """Host seconds per kernel of an eager training step: one microbatch of ``FLOOR_MODEL``
    forward and backward, its gradients accumulated, over the estimator's count of that
    microbatch's kernels (``llmforge.estimate.kernels.microbatch_kernels``). Besides issuing
    each kernel, a step records autograd's graph, runs its engine, calls the modules and the
    view and shape ops between kernels: on a CPU several times ``launch_floor``."""
    torch.manual_seed(0)
    model = GPT(FLOOR_MODEL).to(device)
    tokens = torch.randint(0, FLOOR_MODEL.vocab_size, (FLOOR_BATCH, FLOOR_MODEL.seq_len + 1), device=device)

    def step() -> None:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1)).backward()

    kernels = microbatch_kernels(shape_from_config(FLOOR_MODEL), micro_batch_size=FLOOR_BATCH)
    return seconds_per_call(step, device=device, budget_s=budget_s) / kernels


def host_costs() -> dict[str, float]:
    """Host seconds of parallelism per call on a CPU (``llmforge.calibrate.host_probe``): a DTensor
    call's (``dtensor_op``) and FSDP2's (``fit.FSDP_COSTS``). A GPU's host runs ahead of its
    kernels: ``measure`` asks only on a CPU."""
    return in_subprocess()


def host_memory_bytes() -> int:
    """This machine's memory, or its container's limit where lower (cgroup v2 ``memory.max``)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total


def usable_memory(device: torch.device) -> tuple[int, int]:
    """(device memory bytes, bytes the runtime already holds) of ``device``."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    return host_memory_bytes(), 0


def host_copies(*, device: torch.device, quick: bool, budget_s: float) -> list[BandwidthSample]:
    """Copies between pinned host memory and a GPU, each way (``h2d``, ``d2h``): what CPU offload
    moves over the host link. None on a CPU, whose host is the device."""
    if device.type != "cuda":
        return []
    numel = (64 if quick else 256) * 2**20 // 4
    host, dev = torch.empty(numel, pin_memory=True), torch.empty(numel, device=device)
    up = seconds_per_call(lambda: dev.copy_(host, non_blocking=True), device=device, budget_s=budget_s)
    down = seconds_per_call(lambda: host.copy_(dev, non_blocking=True), device=device, budget_s=budget_s)
    return [BandwidthSample("h2d", 4 * numel, up), BandwidthSample("d2h", 4 * numel, down)]


def device_name(device: torch.device, *, threads: int) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({threads} thread{'s' if threads != 1 else ''})"


def measure(
    device: torch.device, *, quick: bool, threads: int, tick: Tick, passes: int = PASSES, load: Callable[[], object] | None = None
) -> ComputeSamples:
    """Every compute figure of ``device`` (on a CPU with ``threads`` threads): ``passes`` passes
    over the grid, every other one in reverse order, each with the CPU load of other processes
    during it (``load``: a ``CpuLoad`` maker), combined into their medians (``trust.combine``),
    and the host costs of parallelism (``host_costs``)."""
    if device.type == "cpu":
        torch.set_num_threads(threads)
    full = grid_for(device, quick=quick)
    grid = dataclasses.replace(full, budget_s=full.budget_s / passes)
    runs = []
    for index in range(passes):
        probe = load() if load else CpuLoad(threads=threads if device.type == "cpu" else 1)
        probe.start()
        samples = one_pass(device, grid=grid, quick=quick, threads=threads, tick=tick, reverse=index % 2 == 1)
        reading = probe.stop()
        samples.load = [reading] if reading else []
        runs.append(samples)
    combined = combine(runs)
    # once, not per pass: the probe takes the fastest of its own rounds, in a process of its own
    if device.type == "cpu":
        for name, seconds in host_costs().items():
            setattr(combined, f"{name}_s", seconds)
        tick("host costs of parallelism")
    return combined


def one_pass(device: torch.device, *, grid: Grid, quick: bool, threads: int, tick: Tick, reverse: bool) -> ComputeSamples:
    """One pass over the grid, its sections in order or (``reverse``) the other way round."""
    dtypes = supported_dtypes(device) + (["fp8"] if has_fp8(device) else [])
    samples = ComputeSamples(
        device=device.type, device_name=device_name(device, threads=threads), threads=threads, matmul={d: [] for d in dtypes}
    )  # its keys decide the reference dtype

    def floor() -> None:
        samples.floor_s = launch_floor(device=device, budget_s=grid.budget_s)
        samples.step_floor_s = step_floor(device=device, budget_s=grid.budget_s)
        samples.memory_bytes, samples.reserved_bytes = usable_memory(device)
        samples.host_memory_bytes = host_memory_bytes()
        tick("launch floor")

    def attention_all() -> None:
        for dtype in supported_dtypes(device):
            samples.attention[dtype] = attention(grid, dtype=dtype, device=device, tick=tick) if dtype == samples.reference_dtype else []
            if dtype != samples.reference_dtype:
                tick(f"attention {dtype}: not measured")

    def memory_bound() -> None:
        samples.bandwidth = bandwidth(grid, device=device, tick=tick)
        samples.host_copies = host_copies(device=device, quick=quick, budget_s=grid.budget_s)
        if samples.host_copies:
            tick("host copies")

    def matmuls_in(dtype: str) -> Callable[[], None]:
        return lambda: samples.matmul.update({dtype: matmuls(grid, dtype=dtype, device=device, tick=tick)})

    sections = [floor, *(matmuls_in(d) for d in dtypes), attention_all, memory_bound]
    for section in reversed(sections) if reverse else sections:
        section()
    return samples


def steps(device: torch.device, *, quick: bool, passes: int = PASSES) -> int:
    """How many ticks ``measure`` makes (the progress bar's total)."""
    grid = grid_for(device, quick=quick)
    matmuls = len(grid.matmul_shapes()) * (len(supported_dtypes(device)) + has_fp8(device) if device.type == "cuda" else 1)
    matmuls += 0 if device.type == "cuda" else len(supported_dtypes(device)) - 1
    host = 1 if device.type == "cuda" else 0
    per_pass = 1 + matmuls + len(grid.attention) + len(supported_dtypes(device)) - 1 + len(grid.elements) + host
    return passes * per_pass + (1 if device.type == "cpu" else 0)  # and the host costs, once
