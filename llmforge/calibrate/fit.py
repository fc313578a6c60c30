"""From timings to a hardware profile's keys (no torch).

The step-time model (``llmforge.estimate.kernels``) times a matmul ``[m x k] @ [k x n]``
as ``2mkn / (peak x matmul_efficiency) x (1 + matmul_dim (1/m + 1/k + 1/n))``, fused
attention as ``0.5 F (1 + matmul_dim / head_dim) / (peak x attention_efficiency)``
forward and 2.5 times that backward, memory-bound work as bytes / (memory bandwidth x
bandwidth_efficiency), each kernel at least ``kernel_floor_us`` (the host time per kernel of
a training step whose kernels have next to no work), and a collective as
its bytes over the group's bus bandwidth. The fits below choose those keys so that the
model reproduces the timings, in relative (log) error.

On a GPU the datasheet's peaks and bandwidths stay (MFU keeps its usual meaning) and the
efficiencies are fitted; on a CPU, whose datasheet figures are guesses, the fitted rates
become the peaks and bandwidths, at efficiency 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmforge.calibrate.probe import LoadReading
from llmforge.estimate.comm import all_reduce_hops, fsdp_collectives

#: Candidate matmul_dim values (the rest of the fit is closed-form).
DIMS = tuple(float(d) for d in [0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512])


@dataclass(frozen=True)
class MatmulSample:
    m: int
    k: int
    n: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def stretch_terms(self) -> float:
        return 1 / self.m + 1 / self.k + 1 / self.n


@dataclass(frozen=True)
class AttentionSample:
    batch_heads: int
    seq: int
    head_dim: int
    forward_s: float
    total_s: float  # forward and backward

    @property
    def flops(self) -> float:
        """Forward FLOPs, scores counted in full (the estimator's convention)."""
        return 4.0 * self.batch_heads * self.seq * self.seq * self.head_dim


@dataclass(frozen=True)
class BandwidthSample:
    kind: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class CommSample:
    op: str
    link: str  # "intra" (inside a node) or "inter" (across nodes)
    ranks: int
    nbytes: int
    seconds: float

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.ranks)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op == "send_recv" else (n - 1) / n


@dataclass(frozen=True)
class FsdpSample:
    """Host seconds one FSDP2 step adds to the unsharded one (``llmforge.calibrate.host_probe``):
    a GPT of ``blocks`` blocks and ``params`` parameter tensors, ``microbatches`` a step, ZeRO ``zero``."""

    blocks: int
    microbatches: int
    zero: int
    params: int
    seconds: float

    def counts(self) -> tuple[float, float, float]:
        """(unit visits: FSDP units x microbatches, gathers and reduce-scatters, parameters)."""
        gathers, scatters = fsdp_collectives(zero=self.zero, pp=1, blocks=self.blocks, microbatches=self.microbatches)
        return float((self.blocks + 1) * self.microbatches), float(gathers + scatters), float(self.params)


@dataclass
class ComputeSamples:
    """What ``llmforge.calibrate.compute.measure`` found on one device."""

    device: str  # "cpu" or "cuda"
    device_name: str
    threads: int
    floor_s: float = 0.0
    #: Host seconds per kernel of an eager training step (``compute.step_floor``; 0: not measured).
    step_floor_s: float = 0.0
    #: Host seconds a DTensor operator call adds to the plain one (CPU; 0: not measured).
    dtensor_op_s: float = 0.0
    #: FSDP2's host seconds per unit visit, per gather or reduce-scatter, per parameter (CPU; ``FSDP_COSTS``).
    fsdp_unit_s: float = 0.0
    fsdp_collective_s: float = 0.0
    fsdp_param_s: float = 0.0
    memory_bytes: int = 0
    reserved_bytes: int = 0
    matmul: dict[str, list[MatmulSample]] = field(default_factory=dict)
    attention: dict[str, list[AttentionSample]] = field(default_factory=dict)
    bandwidth: list[BandwidthSample] = field(default_factory=list)
    #: The host: its memory (one node's) and, on a GPU, copies to and from the device ("h2d", "d2h").
    host_memory_bytes: int = 0
    host_copies: list[BandwidthSample] = field(default_factory=list)
    #: The interleaved passes these samples are the medians of (``llmforge.calibrate.trust``).
    passes: list[ComputeSamples] = field(default_factory=list)
    #: CPU load from other processes during each pass (``llmforge.calibrate.probe``).
    load: list[LoadReading] = field(default_factory=list)

    @property
    def reference_dtype(self) -> str:
        """The dtype the single-valued keys are fitted on: what training runs there by default."""
        return "bf16" if self.device == "cuda" and "bf16" in self.matmul else "fp32"


def fit_matmul(samples: Sequence[MatmulSample], *, floor_s: float, dims: Sequence[float] = DIMS) -> tuple[float, float]:
    """(rate FLOP/s = peak x matmul_efficiency, matmul_dim) that best reproduce the timings.

    Launch-bound samples (under three launch floors) say nothing about the rate and are left out."""
    used = [s for s in samples if s.seconds > 3 * floor_s] or list(samples)
    best = (math.inf, 0.0, 0.0)
    for dim in dims:
        logs = [math.log(s.flops * (1 + dim * s.stretch_terms) / s.seconds) for s in used]
        log_rate = sum(logs) / len(logs)
        error = sum((x - log_rate) ** 2 for x in logs)
        if error < best[0] - 1e-12:
            best = (error, math.exp(log_rate), dim)
    return best[1], best[2]


def fit_attention(samples: Sequence[AttentionSample], *, peak: float, matmul_dim: float) -> float:
    """attention_efficiency against ``peak`` (geometric mean over the shapes)."""
    logs = [math.log(1.75 * s.flops * (1 + matmul_dim / s.head_dim) / (peak * s.total_s)) for s in samples]
    return math.exp(sum(logs) / len(logs))


def fit_bandwidth(samples: Sequence[BandwidthSample], *, floor_s: float) -> float:
    """Achieved bytes/s of memory-bound kernels: all their bytes over all their time (those
    above three launch floors), so the slow kernels weigh by the time a step spends in them."""
    used = [s for s in samples if s.seconds > 3 * floor_s] or list(samples)
    return sum(s.nbytes for s in used) / sum(s.seconds for s in used)


#: The three FSDP2 host costs ``fit_fsdp_host`` returns, in the order of ``FsdpSample.counts``.
FSDP_COSTS = ("fsdp_unit", "fsdp_collective", "fsdp_param")


def fit_fsdp_host(samples: Sequence[FsdpSample]) -> dict[str, float]:
    """Seconds per unit visit, per gather or reduce-scatter and per parameter (``FSDP_COSTS``):
    least squares of the samples' added seconds over their counts, none negative (a cost that
    would be is left out and the others fitted again)."""
    import numpy as np

    counts = np.array([s.counts() for s in samples], dtype=float)
    added = np.array([s.seconds for s in samples], dtype=float)
    active = list(range(len(FSDP_COSTS)))
    while active:
        solution, _, rank, _ = np.linalg.lstsq(counts[:, active], added, rcond=None)
        if rank < len(active):  # the probes cannot tell these costs apart
            break
        if (solution >= 0).all():
            out = dict.fromkeys(FSDP_COSTS, 0.0)
            out.update({FSDP_COSTS[i]: float(x) for i, x in zip(active, solution, strict=True)})
            return out
        active = [i for i, x in zip(active, solution, strict=True) if x > 0]
    return dict.fromkeys(FSDP_COSTS, 0.0)


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``seconds = latency + bytes / bandwidth`` over
    (bus bytes, seconds) points, least squares in relative error; latency at least 0."""
    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=False))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=False))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=False))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=False))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    latency = (st - slope * sx) / sw if det > 0 else 0.0
    if latency < 0 or slope <= 0:  # no latency to speak of: bandwidth alone
        latency, slope = 0.0, sum(wi * x * t for wi, (x, t) in zip(w, points, strict=False)) / sxx
    return latency, 1 / slope


@dataclass(frozen=True)
class Fitted:
    """The measured rates, before they are written into a profile."""

    rates: dict[str, float]  # dtype -> matmul FLOP/s at large sizes (peak x efficiency)
    matmul_dim: float
    attention_flops: float  # attention FLOP/s (peak x attention_efficiency), reference dtype
    bandwidth: float  # bytes/s
    floor_s: float
    memory_bytes: int
    reserved_bytes: int
    device: str
    reference_dtype: str
    host_memory_bytes: int = 0
    #: bytes/s one way over the host link (the slower direction); 0: not measured
    host_link: float = 0.0
    #: bytes/s of host memory copies (read + write); 0: not measured
    host_bandwidth: float = 0.0
    #: host seconds per DTensor operator call beyond the plain one; 0: not measured
    dtensor_op_s: float = 0.0
    #: host seconds per kernel of an eager training step; 0: not measured
    step_floor_s: float = 0.0
    #: FSDP2's host seconds (``FSDP_COSTS``); 0: not measured
    fsdp_unit_s: float = 0.0
    fsdp_collective_s: float = 0.0
    fsdp_param_s: float = 0.0


def fit_compute(samples: ComputeSamples, *, dims: Sequence[float] = DIMS) -> Fitted:
    """The rates of ``samples``; ``dims``: the candidate ``matmul_dim`` values (one: that one)."""
    ref = samples.reference_dtype
    rates = {}
    rates[ref], dim = fit_matmul(samples.matmul[ref], floor_s=samples.floor_s, dims=dims)
    for dtype, points in samples.matmul.items():
        if dtype != ref:  # fewer shapes: the reference dtype's size dependence
            rates[dtype] = fit_matmul(points, floor_s=samples.floor_s, dims=(dim,))[0]
    attention = fit_attention(samples.attention[ref], peak=1.0, matmul_dim=dim) if samples.attention.get(ref) else 0.0
    return Fitted(
        rates=rates,
        matmul_dim=dim,
        attention_flops=attention,
        bandwidth=fit_bandwidth(samples.bandwidth, floor_s=samples.floor_s),
        floor_s=samples.floor_s,
        memory_bytes=samples.memory_bytes,
        reserved_bytes=samples.reserved_bytes,
        device=samples.device,
        reference_dtype=ref,
        host_memory_bytes=samples.host_memory_bytes,
        dtensor_op_s=samples.dtensor_op_s,
        step_floor_s=samples.step_floor_s,
        **{f"{name}_s": getattr(samples, f"{name}_s") for name in FSDP_COSTS},
        **_host_rates(samples),
    )


def _host_rates(samples: ComputeSamples) -> dict:
    """The host link (GPU: the slower of the timed directions; CPU: the host is the device, a
    copy's one-way rate) and host memory bandwidth (CPU: the copies' read + write rate)."""
    copies = [s for s in samples.bandwidth if s.kind == "copy"]
    if samples.device == "cpu":
        rate = fit_bandwidth(copies, floor_s=samples.floor_s) if copies else 0.0
        return {"host_link": rate / 2, "host_bandwidth": rate}
    directions = {s.kind for s in samples.host_copies}
    rates = [fit_bandwidth([s for s in samples.host_copies if s.kind == d], floor_s=0.0) for d in directions]
    return {"host_link": min(rates) if rates else 0.0}


def latency_hops(op: str, n: int) -> int:
    """Steps one collective passes, each paying ``comm_latency_us`` as the estimator charges it
    (llmforge.estimate.comm): n - 1 for a ring all-gather, reduce-scatter or all-to-all, an
    all-reduce's ring or tree, one for a send."""
    if op == "send_recv":
        return 1
    return all_reduce_hops(n) if op == "all_reduce" else max(1, n - 1)


def fit_comm(samples: Sequence[CommSample]) -> dict[str, tuple[float, float]]:
    """{link: (latency of one hop s, bus bandwidth bytes/s)} over every op and size measured on
    that link. ``seconds = hops * latency + bus bytes / bandwidth`` is fitted divided by the
    hops, so the latency is per hop whatever the rank count."""
    out = {}
    for link in sorted({s.link for s in samples if s.op != TP_STEP}):
        points = []
        for s in samples:
            if s.link == link and s.op != TP_STEP:
                hops = latency_hops(s.op, s.ranks)
                points.append((s.nbytes * bus_factor(s.op, s.ranks) / hops, s.seconds / hops))
        out[link] = fit_latency_bandwidth(points)
    return out


#: ``CommSample.op`` of a timed tensor-parallel training step (``llmforge.calibrate.tp_wait``): its
#: ``nbytes`` is the probe's index in ``tp_wait.PROBES``, its ``seconds`` the step's.
TP_STEP = "tp_step"


def compute_keys(fitted: Fitted, datasheet: dict) -> dict:
    """The profile keys of a compute calibration, on top of the ``datasheet`` profile's mapping."""
    out = {k: v for k, v in datasheet.items() if k != "peak_approximate"}  # measured now
    ref = fitted.reference_dtype
    gib = 1024**3
    out["memory_gib"] = round(fitted.memory_bytes / gib, 2)
    if fitted.device == "cpu":
        out["peak_tflops"] = {d: _round(r / 1e12) for d, r in fitted.rates.items()}
        out["matmul_efficiency"] = 1.0
        out["memory_bandwidth_gbs"] = _round(fitted.bandwidth / 1e9)
        out["bandwidth_efficiency"] = 1.0
        peak = fitted.rates[ref]
    else:
        peak = float(datasheet["peak_tflops"][ref]) * 1e12
        out["matmul_efficiency"] = _round(fitted.rates[ref] / peak)
        out["bandwidth_efficiency"] = _round(fitted.bandwidth / (float(datasheet["memory_bandwidth_gbs"]) * 1e9))
        out["runtime_reserved_gib"] = max(float(datasheet.get("runtime_reserved_gib", 0.0)), round(fitted.reserved_bytes / gib, 2))
    out["matmul_dim"] = fitted.matmul_dim
    if fitted.attention_flops:
        out["attention_efficiency"] = _round(fitted.attention_flops / peak)
    out["kernel_floor_us"] = _round((fitted.step_floor_s or fitted.floor_s) * 1e6)
    if fitted.dtensor_op_s:
        out["dtensor_op_us"] = _round(fitted.dtensor_op_s * 1e6)
    if any(getattr(fitted, f"{name}_s") for name in FSDP_COSTS):
        out.update({f"{name}_us": _round(getattr(fitted, f"{name}_s") * 1e6) for name in FSDP_COSTS})
    if fitted.attention_flops:
        out.pop("attention_backward_efficiency", None)  # the fit covers forward and backward
    return {**out, **host_keys(fitted)}


def host_keys(fitted: Fitted) -> dict:
    """The host keys measured (the others stay the datasheet's): host memory, and the host link
    and host memory bandwidth where they were timed."""
    out = {}
    if fitted.host_memory_bytes:
        out["host_memory_gib"] = round(fitted.host_memory_bytes / 1024**3, 2)
    if fitted.host_link:
        out["host_link_gbs"] = _round(fitted.host_link / 1e9)
    if fitted.host_bandwidth:
        out["host_memory_bandwidth_gbs"] = _round(fitted.host_bandwidth / 1e9)
    return out


def comm_keys(groups: dict[str, tuple[float, float]], datasheet: dict) -> dict:
    """Profile keys from fitted (latency, bus bandwidth) per group kind (``intra``, ``inter``).

    The datasheet's line rate stays where the measurement is below it, and
    ``comm_efficiency`` becomes the measured share of it; the other link's bandwidth is
    rescaled so that its achieved figure is the measured one (or, unmeasured, unchanged)."""
    out = dict(datasheet)
    old_eff = float(datasheet.get("comm_efficiency", 0.7))
    achieved = {k: float(datasheet[f"{k}_node_gbs"]) * 1e9 * old_eff for k in ("intra", "inter")}
    achieved.update({k: bw for k, (_, bw) in groups.items()})
    lead = "intra" if "intra" in groups else "inter"
    line = float(datasheet[f"{lead}_node_gbs"]) * 1e9
    eff = min(1.0, achieved[lead] / line)
    out["comm_efficiency"] = _round(eff)
    for kind in ("intra", "inter"):
        out[f"{kind}_node_gbs"] = _round(achieved[kind] / eff / 1e9)
    out["comm_latency_us"] = _round(max(lat for lat, _ in groups.values()) * 1e6)  # per hop
    return out


def _round(x: float) -> float:
    """Three significant figures (a profile is read by people too)."""
    return float(f"{x:.3g}")


def median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def samples_to_dict(compute: ComputeSamples, comm: Sequence[CommSample]) -> dict:
    """Plain data (JSON) of a calibration's timings: what the ranks hand to the launcher."""
    from dataclasses import asdict

    return {"compute": asdict(compute), "comm": [asdict(s) for s in comm]}


def samples_from_dict(data: dict) -> tuple[ComputeSamples, list[CommSample]]:
    return compute_from_dict(data["compute"]), [CommSample(**s) for s in data["comm"]]


def compute_from_dict(c: dict) -> ComputeSamples:
    lists = ("matmul", "attention", "bandwidth", "host_copies", "passes", "load")
    return ComputeSamples(
        **{k: v for k, v in c.items() if k not in lists},
        matmul={d: [MatmulSample(**s) for s in v] for d, v in c["matmul"].items()},
        attention={d: [AttentionSample(**s) for s in v] for d, v in c["attention"].items()},
        bandwidth=[BandwidthSample(**s) for s in c["bandwidth"]],
        host_copies=[BandwidthSample(**s) for s in c.get("host_copies", [])],
        passes=[compute_from_dict(p) for p in c.get("passes", [])],
        load=[LoadReading(**r) for r in c.get("load", [])],
    )
