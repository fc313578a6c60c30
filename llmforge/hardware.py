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
``attention_efficiency``, ``bandwidth_efficiency`` and ``kernel_floor_us`` are
the step-time model's rates (``llmforge.estimate.kernels``). ``peak_approximate: true``
marks peaks that are a rough guess (the measured MFU is then shown as approximate; a
profile measured on its machine leaves it out). ``peak_tflops.fp8`` is optional: a profile without it has
no FP8 tensor cores, and ``precision.fp8`` is refused there (unless emulated).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Mapping

from llmforge.config.dtypes import DTYPES
from llmforge.errors import Problem, UserError, nearest

BUILTIN_DIR = Path(__file__).resolve().parent / "hardware_profiles"
GIB = 1024**3
REQUIRED = ("name", "memory_gib", "peak_tflops", "memory_bandwidth_gbs", "intra_node_gbs", "inter_node_gbs", "devices_per_node")
#: The step-time model's rates (see llmforge.estimate.kernels); defaults in Profile.
SPEED_KEYS = ("matmul_efficiency", "matmul_dim", "attention_efficiency", "bandwidth_efficiency", "kernel_floor_us")
OPTIONAL = ("runtime_reserved_gib", "comm_efficiency", "peak_approximate") + SPEED_KEYS


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
    bandwidth_efficiency: float = 0.7
    kernel_floor_us: float = 5.0
    #: The peak is a rough guess rather than a datasheet figure or a measurement (the
    #: built-in ``cpu``): MFU measured against it is shown as approximate (``MFU ~40%``).
    peak_approximate: bool = False
    description: str = ""
    source: str = field(default="", compare=False)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype``."""
        return self.peak_flops[dtype]

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores (the profile gives ``peak_tflops.fp8``)."""
        return "fp8" in self.peak_flops


def _user_dirs() -> List[Path]:
    env = [p for p in os.environ.get("LLMFORGE_CONFIG_PATH", "").split(os.pathsep) if p]
    return [Path(p).expanduser() / "profiles" for p in env]


def _load_yaml(path: Path) -> dict:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(path.read_text(), Loader=loader)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError([Problem("cluster.accelerator", str(path), f"cannot read the profile: {exc}", "fix or remove the file")]) from None
    if not isinstance(data, dict):
        raise UserError([Problem("cluster.accelerator", str(path), "a profile must be a YAML mapping", "see llmforge/hardware_profiles/h100-80gb.yaml")])
    return data


def _description(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def parse_profile(data: dict, *, source: str = "", description: str = "") -> Profile:
    """Check a profile mapping and turn it into a Profile (UserError listing every problem)."""
    problems = [Problem(f"{source}:{k}", None, "missing", f"add `{k}:`") for k in REQUIRED if k not in data]
    peaks = data.get("peak_tflops") or {}
    problems += [Problem(f"{source}:peak_tflops.{d}", None, "missing", f"add the dense {d} TFLOP/s") for d in DTYPES if d not in peaks]
    unknown = set(data) - set(REQUIRED) - set(OPTIONAL)
    problems += [Problem(f"{source}:{k}", data[k], "unknown profile key", f"use only {', '.join(REQUIRED + OPTIONAL)}") for k in sorted(unknown)]
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
            **{k: float(data[k]) for k in SPEED_KEYS if k in data},
            peak_approximate=_flag(data.get("peak_approximate", False), key=f"{source}:peak_approximate"),
            description=description,
            source=source,
        )
    except (TypeError, ValueError) as exc:
        raise UserError([Problem(source, "", f"a profile value has the wrong type: {exc}", "use numbers for sizes and speeds")], title="invalid hardware profile") from None


def _flag(value: object, *, key: str) -> bool:
    if not isinstance(value, bool):
        raise UserError([Problem(key, value, "must be true or false", "write peak_approximate: true (or leave it out)")], title="invalid hardware profile")
    return value


@lru_cache(maxsize=8)
def _profiles_in(dirs: tuple) -> Dict[str, Profile]:
    found: Dict[str, Profile] = {}
    for d in reversed(dirs):  # earlier folders take priority
        for path in sorted(Path(d).glob("*.yaml")):
            found[path.stem] = parse_profile(_load_yaml(path), source=str(path), description=_description(path))
    return found


def known_profiles() -> Dict[str, Profile]:
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
        "cluster.accelerator", name, f"no such hardware profile{nearest(name, names)}",
        f"use one of {', '.join(sorted(names))}, or a path to a profile .yaml (see docs/estimator.md)",
    )


def get_profile(name: str) -> Profile:
    """The profile for ``cluster.accelerator`` (a name or a YAML path); UserError if unknown."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError([Problem("cluster.accelerator", name, "profile file not found", "pass an existing .yaml path or a profile name")])
        return parse_profile(_load_yaml(path), source=str(path), description=_description(path))
    profiles = known_profiles()
    if name not in profiles:
        raise UserError([unknown_problem(name)])
    return profiles[name]
