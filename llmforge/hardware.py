"""Hardware profiles named by ``cluster.accelerator``.

A profile is a small YAML file: device memory, dense peak FLOP/s per dtype,
memory bandwidth, per-device bandwidth inside a node and between nodes, and the
devices per node. The built-in ones live in ``llmforge/hardware_profiles/``.
Users add their own in a ``profiles/`` folder of any folder on
``LLMFORGE_CONFIG_PATH`` (a profile there shadows a built-in one of the same
name), or point ``cluster.accelerator`` straight at a ``.yaml`` file.

Bandwidths are per device and per direction, in GB/s (1e9 bytes): NVLink's
900 GB/s "bidirectional" H100 figure is 450 here. Peak FLOP/s are dense (no
structured sparsity). The optional ``matmul_efficiency``, ``matmul_dim``,
``attention_efficiency``, ``attention_backward_efficiency``, ``bandwidth_efficiency``, ``comm_sm_share`` and
``kernel_floor_us`` (and ``dtensor_op_us``, the host cost of one DTensor operator call, and ``comm_sync_us`` and
``comm_sync_share``, what a collective inside a tensor-parallel step waits beyond its back-to-back time, per call and
per second of the compute before it: ``llmforge.estimate.host``)
are the step-time model's rates (``llmforge.estimate.kernels``; ``comm_sm_share``, the
share of the compute units a running collective holds, and ``comm_latency_us``, one collective between two
ranks, paid once per ring hop: ``llmforge.estimate.comm``). ``peak_tflops.fp8`` is optional: a profile without it has
no FP8 tensor cores, and ``precision.fp8`` is refused there (unless emulated).
``peak_approximate: true`` marks peaks that are a rough guess (the built-in ``cpu``): MFU
against them is shown as approximate, unless the profile was measured (``calibrated``).
The optional ``host_memory_gib`` (per node), ``host_link_gbs`` (per device and
direction: PCIe or NVLink-C2C) and ``host_memory_bandwidth_gbs`` (per node) describe
the host for CPU offload (``parallel.offload``, ``llmforge.estimate.offload``).
``calibration`` is the provenance of a measured
profile (device, versions, date, command): a profile with it is ``calibrated``.

``llmforge calibrate`` writes its profiles to ``profiles/`` under ``LLMFORGE_HOME``
(default ``~/.cache/llmforge``), which shadows the built-in ones as a user folder
does. On the CPU it writes one profile per machine (``machine_profile_path``: CPU
model, threads per rank, torch version), which ``cluster.accelerator=cpu`` uses in
place of the built-in guess.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from llmforge.config.dtypes import DTYPES
from llmforge.errors import Problem, UserError, nearest

BUILTIN_DIR = Path(__file__).resolve().parent / "hardware_profiles"
GIB = 1024**3
REQUIRED = ("name", "memory_gib", "peak_tflops", "memory_bandwidth_gbs", "intra_node_gbs", "inter_node_gbs", "devices_per_node")
#: The step-time model's rates (see llmforge.estimate.kernels); defaults in Profile.
SPEED_KEYS = (
    "matmul_efficiency",
    "matmul_dim",
    "attention_efficiency",
    "attention_backward_efficiency",
    "bandwidth_efficiency",
    "comm_sm_share",
    "kernel_floor_us",
    "dtensor_op_us",
    "comm_sync_us",
    "comm_sync_share",
    "fsdp_unit_us",
    "fsdp_collective_us",
    "fsdp_param_us",
)
#: The host side, for CPU offload (llmforge.estimate.offload); defaults in Profile.
HOST_KEYS = ("host_memory_gib", "host_link_gbs", "host_memory_bandwidth_gbs")
OPTIONAL = ("runtime_reserved_gib", "comm_efficiency", "comm_latency_us", "calibration", "peak_approximate") + SPEED_KEYS + HOST_KEYS


@dataclass(frozen=True)
class Profile:
    """One accelerator: what the estimator needs to know about it."""

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    runtime_reserved_bytes: int = 0
    comm_efficiency: float = 0.7
    #: The step-time model's rates (llmforge.estimate.kernels). The defaults are the
    #: h100-80gb calibration; a profile measured on its own hardware sets its own.
    matmul_efficiency: float = 0.81
    matmul_dim: float = 48.0
    attention_efficiency: float = 0.7
    #: The fused attention's backward (2.5x its forward FLOPs); 0: as ``attention_efficiency``.
    attention_backward_efficiency: float = 0.0
    bandwidth_efficiency: float = 0.7
    #: Share of the compute units a running collective's kernels hold (NCCL: one SM per
    #: channel): compute that overlaps communication runs that much slower.
    comm_sm_share: float = 0.0
    kernel_floor_us: float = 5.0
    #: Host microseconds one DTensor operator call adds to the plain one (sharding propagation,
    #: wrapping): tensor-parallel ranks pay it per call (``llmforge.estimate.host``); 0: not measured.
    dtensor_op_us: float = 0.0
    #: What a collective the host blocks on waits beyond its back-to-back time: ``comm_sync_us``
    #: per call (a blocked rank's threads woken, and on CPU ranks given a core; fitted from real
    #: tensor-parallel steps, ``llmforge.calibrate.tp_wait``) plus, on a tensor-parallel rank,
    #: ``comm_sync_share`` of the compute and host time before it (ranks that drift apart over it;
    #: set by hand). Charged by ``llmforge.estimate.host.sync_seconds``; 0: none.
    comm_sync_us: float = 0.0
    comm_sync_share: float = 0.0
    #: FSDP2's host work on a rank, microseconds: its hooks per unit (a block, or the root) and
    #: microbatch, each gather's and reduce-scatter's own, and the for-loop AdamW and clip per
    #: DTensor parameter (``llmforge.calibrate.host_probe``; ``llmforge.estimate.host.fsdp_host_seconds``);
    #: 0: not measured.
    fsdp_unit_us: float = 0.0
    fsdp_collective_us: float = 0.0
    fsdp_param_us: float = 0.0
    #: Fixed seconds-equivalent of one collective, microseconds (alpha of alpha + bytes/bandwidth).
    comm_latency_us: float = 0.0
    #: Host memory of one node, bytes (None: 2 x the node's device memory).
    host_memory: int | None = None
    #: Host link per device and direction (PCIe 5.0 x16 ~ 50 GB/s achieved, Grace C2C 450), bytes/s.
    host_link_bandwidth: float = 25e9
    #: Host memory bandwidth of one node (all its CPU sockets), bytes/s.
    host_memory_bandwidth: float = 200e9
    #: The peak is a rough guess rather than a datasheet figure or a measurement (the
    #: built-in ``cpu``): MFU measured against it is shown as approximate (``MFU ~40%``).
    peak_approximate: bool = False
    description: str = ""
    source: str = field(default="", compare=False)
    #: Where a measured profile came from (``llmforge calibrate``); empty for a datasheet one.
    calibration: Mapping[str, object] = field(default_factory=dict, compare=False, hash=False)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype``."""
        return self.peak_flops[dtype]

    @property
    def host_memory_bytes(self) -> int:
        """Host memory of one node."""
        return self.host_memory if self.host_memory is not None else 2 * self.memory_bytes * self.devices_per_node

    @property
    def calibrated(self) -> bool:
        """Measured on its hardware by ``llmforge calibrate`` (else a datasheet's figures;
        the built-in ``cpu`` profile's peak is a guess)."""
        return bool(self.calibration)

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores (the profile gives ``peak_tflops.fp8``)."""
        return "fp8" in self.peak_flops


def llmforge_home() -> Path:
    """The per-user folder of measured profiles: ``LLMFORGE_HOME``, default ``~/.cache/llmforge``
    (``$XDG_CACHE_HOME/llmforge`` where that is set)."""
    if os.environ.get("LLMFORGE_HOME"):
        return Path(os.environ["LLMFORGE_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "llmforge"


def home_profiles() -> Path:
    """Where ``llmforge calibrate`` writes a named profile (``cluster.accelerator=NAME`` finds it)."""
    return llmforge_home() / "profiles"


def _user_dirs() -> list[Path]:
    env = [p for p in os.environ.get("LLMFORGE_CONFIG_PATH", "").split(os.pathsep) if p]
    return [Path(p).expanduser() / "profiles" for p in env] + [home_profiles()]


def cpu_threads(ranks_per_node: int = 1) -> int:
    """Threads one CPU rank computes with: ``OMP_NUM_THREADS`` where set, else this
    process's CPUs shared by the ranks on the node (what the launcher gives torchrun's ranks,
    and what a run in the launching process and ``llmforge calibrate`` set)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, ranks_per_node))


def cpu_model() -> str:
    """This machine's CPU model name (Linux: /proc/cpuinfo), else the platform's word for it."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def torch_version() -> str:
    """The installed torch's version, read from its metadata (torch is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def machine_key(threads: int) -> str:
    """What a CPU measurement holds for: CPU model, threads per rank, torch version."""
    import re

    raw = f"{cpu_model()}-{threads}t-torch{torch_version()}"
    return re.sub(r"[^A-Za-z0-9.+]+", "-", raw).strip("-").lower()


def machine_profile_path(threads: int) -> Path:
    """This machine's calibrated cpu profile for ``threads`` per rank (may not exist yet)."""
    return llmforge_home() / "profiles" / "machines" / f"cpu-{machine_key(threads)}.yaml"


#: A cpu profile this run's launcher measured but could not cache (``llmforge.calibrate.auto``):
#: ``cpu`` means it for this run and its ranks, in place of the built-in guess.
UNCACHED_ENV = "LLMFORGE_UNCACHED_CPU_PROFILE"


def forget_profiles() -> None:
    """Drop the cached profile folders' contents (after ``llmforge calibrate`` wrote one)."""
    _profiles_in.cache_clear()


def _load_yaml(path: Path) -> dict:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(
            [Problem("cluster.accelerator", str(path), f"cannot read the profile: {exc}", _remedy(str(path)))],
            title="invalid hardware profile",
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            [
                Problem(
                    "cluster.accelerator",
                    str(path),
                    "a profile must be a YAML mapping",
                    f"{_remedy(str(path))} (see llmforge/hardware_profiles/h100-80gb.yaml)",
                )
            ],
            title="invalid hardware profile",
        )
    return data


def _description(path: Path) -> str:
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def _remedy(source: str) -> str:
    """How to repair a bad profile: a measured one is measured again or deleted, any other fixed."""
    if source and Path(source).parent == BUILTIN_DIR:
        return "reinstall llmforge (a built-in profile was changed)"
    try:
        cached = Path(source).resolve().is_relative_to(llmforge_home().resolve())
    except (OSError, ValueError):
        cached = False
    if cached:
        builtin = Path(source).parent.name == "machines" or (BUILTIN_DIR / Path(source).name).is_file()
        return f"measure it again with `llmforge calibrate`, or delete {source}" + (
            " (the built-in profile is used then)" if builtin else ""
        )
    return f"correct {source or 'the profile'}, or measure this machine with `llmforge calibrate`"


#: Each numeric key's rule: (lowest, lowest allowed itself, highest or None). Every value must be a finite number.
_BOUNDS = {
    "memory_gib": (0.0, False, None),
    "memory_bandwidth_gbs": (0.0, False, None),
    "intra_node_gbs": (0.0, False, None),
    "inter_node_gbs": (0.0, False, None),
    "devices_per_node": (1.0, True, None),
    "runtime_reserved_gib": (0.0, True, None),
    "comm_efficiency": (0.0, False, 1.0),
    "comm_latency_us": (0.0, True, None),
    "matmul_efficiency": (0.0, False, None),
    "matmul_dim": (0.0, True, None),
    "attention_efficiency": (0.0, False, None),
    "attention_backward_efficiency": (0.0, True, None),
    "bandwidth_efficiency": (0.0, False, None),
    "comm_sm_share": (0.0, True, 0.99),
    "kernel_floor_us": (0.0, True, None),
    "dtensor_op_us": (0.0, True, None),
    "comm_sync_us": (0.0, True, None),
    "comm_sync_share": (0.0, True, None),
    "fsdp_unit_us": (0.0, True, None),
    "fsdp_collective_us": (0.0, True, None),
    "fsdp_param_us": (0.0, True, None),
    "host_memory_gib": (0.0, False, None),
    "host_link_gbs": (0.0, False, None),
    "host_memory_bandwidth_gbs": (0.0, False, None),
}


def _value_problems(data: dict, *, source: str) -> list[Problem]:
    """Every numeric value that is not a number, not finite, or out of its range (a zero or negative
    peak or bandwidth would divide by zero or give a negative step time)."""
    import math

    peaks = data.get("peak_tflops")
    if not isinstance(peaks, Mapping):
        return [Problem(f"{source}:peak_tflops", peaks, "must be a mapping of dtype to TFLOP/s", _remedy(source))]
    values = [(k, data[k], _BOUNDS[k]) for k in _BOUNDS if k in data] + [
        (f"peak_tflops.{d}", v, (0.0, False, None)) for d, v in peaks.items()
    ]
    problems = []
    for key, value, (low, low_ok, high) in values:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        whole = key != "devices_per_node" or (number is not None and float(number).is_integer())
        inside = (
            number is not None
            and math.isfinite(number)
            and (number >= low if low_ok else number > low)
            and (high is None or number <= high)
        )
        if not (inside and whole):
            rule = f"must be {'a whole number' if key == 'devices_per_node' else 'a number'} {'>=' if low_ok else '>'} {low:g}" + (
                f" and <= {high:g}" if high is not None else ""
            )
            problems.append(Problem(f"{source}:{key}", value, rule, _remedy(source)))
    return problems


def parse_profile(data: dict, *, source: str = "", description: str = "") -> Profile:
    """Check a profile mapping and turn it into a Profile (UserError listing every problem)."""
    problems = [Problem(f"{source}:{k}", None, "missing", f"add `{k}:`") for k in REQUIRED if k not in data]
    peaks = data.get("peak_tflops") if isinstance(data.get("peak_tflops"), Mapping) else {}
    problems += [Problem(f"{source}:peak_tflops.{d}", None, "missing", f"add the dense {d} TFLOP/s") for d in DTYPES if d not in peaks]
    unknown = set(data) - set(REQUIRED) - set(OPTIONAL)
    problems += [
        Problem(f"{source}:{k}", data[k], "unknown profile key", f"use only {', '.join(REQUIRED + OPTIONAL)}") for k in sorted(unknown)
    ]
    problems = problems or _value_problems(data, source=source)
    if problems:
        raise UserError(problems, title="invalid hardware profile")
    try:
        return Profile(
            name=str(data["name"]),
            memory_bytes=int(float(data["memory_gib"]) * GIB),
            peak_flops={k: float(v) * 1e12 for k, v in peaks.items()},
            memory_bandwidth=float(data["memory_bandwidth_gbs"]) * 1e9,
            intra_node_bandwidth=float(data["intra_node_gbs"]) * 1e9,
            inter_node_bandwidth=float(data["inter_node_gbs"]) * 1e9,
            devices_per_node=int(data["devices_per_node"]),
            runtime_reserved_bytes=int(float(data.get("runtime_reserved_gib", 0.0)) * GIB),
            comm_efficiency=float(data.get("comm_efficiency", 0.7)),
            comm_latency_us=float(data.get("comm_latency_us", 0.0)),
            **{k: float(data[k]) for k in SPEED_KEYS if k in data},
            **_host_fields(data),
            peak_approximate=_flag(data.get("peak_approximate", False), key=f"{source}:peak_approximate"),
            description=description,
            source=source,
            calibration=dict(_mapping(data.get("calibration") or {})),
        )
    except (TypeError, ValueError) as exc:
        raise UserError(
            [Problem(source, "", f"a profile value has the wrong type: {exc}", "use numbers for sizes and speeds")],
            title="invalid hardware profile",
        ) from None


def _host_fields(data: dict) -> dict:
    """The optional host keys, in bytes and bytes/s."""
    out: dict = {}
    if "host_memory_gib" in data:
        out["host_memory"] = int(float(data["host_memory_gib"]) * GIB)
    if "host_link_gbs" in data:
        out["host_link_bandwidth"] = float(data["host_link_gbs"]) * 1e9
    if "host_memory_bandwidth_gbs" in data:
        out["host_memory_bandwidth"] = float(data["host_memory_bandwidth_gbs"]) * 1e9
    return out


def _mapping(value: object) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError("calibration must be a mapping (device, torch, date, command, ...)")
    return value


def _flag(value: object, *, key: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(
            [Problem(key, value, "must be true or false", "write peak_approximate: true (or leave it out)")],
            title="invalid hardware profile",
        )
    return value


@lru_cache(maxsize=8)
def _profiles_in(dirs: tuple) -> dict[str, Profile]:
    found: dict[str, Profile] = {}
    for d in reversed(dirs):  # earlier folders take priority
        for path in sorted(Path(d).glob("*.yaml")):
            found[path.stem] = parse_profile(_load_yaml(path), source=str(path), description=_description(path))
    return found


def known_profiles() -> dict[str, Profile]:
    """Every profile by name: the user's folders first, then the built-in ones."""
    return dict(_profiles_in(tuple(str(d) for d in [*_user_dirs(), BUILTIN_DIR])))


def is_known(name: str) -> bool:
    """True if ``name`` is a known profile or an existing profile YAML file."""
    if name.endswith((".yaml", ".yml")):
        return Path(name).expanduser().is_file()
    return name in known_profiles()


def unknown_problem(name: str) -> Problem:
    """The validation problem for an accelerator that names no profile."""
    names = known_profiles()
    return Problem(
        "cluster.accelerator",
        name,
        f"no such hardware profile{nearest(name, names)}",
        f"use one of {', '.join(sorted(names))}, or a path to a profile .yaml (see docs/estimator.md)",
    )


def get_profile(name: str, *, ranks_per_node: int = 1) -> Profile:
    """The profile for ``cluster.accelerator`` (a name or a YAML path); UserError if unknown.

    ``cpu`` with no profile of the user's own is this machine's calibrated profile for the
    threads each of ``ranks_per_node`` ranks gets, where one was measured, else the built-in guess."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(
                [Problem("cluster.accelerator", name, "profile file not found", "pass an existing .yaml path or a profile name")]
            )
        return parse_profile(_load_yaml(path), source=str(path), description=_description(path))
    profiles = known_profiles()
    if name not in profiles:
        raise UserError([unknown_problem(name)])
    found = profiles[name]
    if name == "cpu" and Path(found.source).parent == BUILTIN_DIR:
        machine = Path(os.environ.get(UNCACHED_ENV) or machine_profile_path(cpu_threads(ranks_per_node)))
        if machine.is_file():
            return parse_profile(_load_yaml(machine), source=str(machine), description=_description(machine))
    return found


def machine_memory() -> int:
    """This machine's memory in bytes: physical, or the cgroup's limit where that is lower
    (what CPU ranks share when their profile gives no ``host_memory_gib``)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total
