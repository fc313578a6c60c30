"""A calibrated profile on disk: the datasheet it started from, where it goes, its
provenance, and the YAML text (checked by ``llmforge.hardware.parse_profile`` before it
replaces anything)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

from llmforge.errors import Problem, UserError
from llmforge.files import write_text_atomic
from llmforge.hardware import BUILTIN_DIR, GIB, SPEED_KEYS, Profile, forget_profiles, get_profile, llmforge_home, parse_profile


def datasheet_profile(name: str) -> Profile:
    """The profile a calibration starts from: the built-in one of that name (not an earlier
    calibration that shadows it), else the user's profile or file."""
    builtin = BUILTIN_DIR / f"{name}.yaml"
    return get_profile(str(builtin)) if builtin.is_file() else get_profile(name)


#: The step-time model's rates, which every profile has; its other speed keys' 0 means "as another
#: key" or "not measured", and a written profile leaves them out.
ALWAYS_SET = ("matmul_efficiency", "matmul_dim", "attention_efficiency", "bandwidth_efficiency", "kernel_floor_us")


def as_mapping(p: Profile) -> dict:
    """A profile as the YAML keys it was read from (``parse_profile`` of it gives ``p`` back):
    every key a calibration does not measure is kept from the profile it started from."""
    out = {
        "name": p.name,
        "memory_gib": round(p.memory_bytes / GIB, 2),
        "peak_tflops": {d: v / 1e12 for d, v in p.peak_flops.items()},
        "memory_bandwidth_gbs": p.memory_bandwidth / 1e9,
        "intra_node_gbs": p.intra_node_bandwidth / 1e9,
        "inter_node_gbs": p.inter_node_bandwidth / 1e9,
        "devices_per_node": p.devices_per_node,
        "runtime_reserved_gib": round(p.runtime_reserved_bytes / GIB, 2),
        "comm_efficiency": p.comm_efficiency,
        "comm_latency_us": p.comm_latency_us,
    }
    out.update({k: getattr(p, k) for k in SPEED_KEYS if getattr(p, k) or k in ALWAYS_SET})
    if p.host_memory is not None:
        out["host_memory_gib"] = round(p.host_memory / GIB, 2)
    out["host_link_gbs"] = p.host_link_bandwidth / 1e9
    out["host_memory_bandwidth_gbs"] = p.host_memory_bandwidth / 1e9
    if p.peak_approximate:
        out["peak_approximate"] = True
    return out


#: What ``--name`` may be: a plain name that ``cluster.accelerator=NAME`` finds in the profiles folder.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]*"


def check_name(name: str | None) -> None:
    """Refuse a ``--name`` that is a path, hidden, empty or a file name (exit code 2, before measuring)."""
    import re

    if name is None:
        return
    if not re.fullmatch(NAME_PATTERN, name) or name.endswith((".yaml", ".yml")):
        raise UserError(
            [
                Problem(
                    "--name",
                    name,
                    "a profile name is a plain name (letters, digits, '.', '_', '+', '-'; no folder, no .yaml), "
                    "written to LLMFORGE_HOME/profiles/NAME.yaml",
                    "pass a name such as --name my-card, or --out PATH.yaml to write the profile elsewhere",
                )
            ],
            title="cannot calibrate",
        )


def check_out(path: Path, *, given: bool = True) -> None:
    """Refuse an output path before anything is measured (exit code 2, nothing written): the
    ``--out`` the user ``given``, else the default under ``LLMFORGE_HOME``, which is named."""
    problem = None
    if path.suffix not in (".yaml", ".yml"):
        problem = "a profile is a .yaml file"
    elif path.is_dir():
        problem = "is a folder"
    else:
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            problem = f"{folder} is not a writable folder"
    if problem and not given:
        raise UserError(
            [
                Problem(
                    "LLMFORGE_HOME",
                    str(llmforge_home()),
                    f"cannot write the profile {path} there: {problem}",
                    "set LLMFORGE_HOME to a writable folder (default ~/.cache/llmforge), or pass --out PATH.yaml",
                )
            ],
            title="cannot write the profile",
        )
    if problem:
        raise UserError(
            [Problem("--out", str(path), problem, "pass a writable path ending in .yaml, e.g. --out profiles/my-card.yaml")],
            title="cannot write the profile",
        )


def provenance(*, device: str, threads: int | None, ranks: int, quick: bool, started_from: Profile, command: str) -> dict:
    """Where a calibrated profile came from (the ``calibration`` section)."""
    import torch

    out = {
        "device": device,
        "torch": str(torch.__version__),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "host": platform.node(),
        "ranks": ranks,
        "quick": quick,
        "started_from": f"{started_from.name} ({started_from.source})",
    }
    if threads is not None:
        out["threads"] = threads
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["driver"] = _driver()
    return out


def _driver() -> str:
    try:
        import torch

        version = torch._C._cuda_getDriverVersion()  # e.g. 13000 for CUDA 13.0
        return f"CUDA driver API {version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - provenance only
        return "unknown"


def profile_text(data: dict, *, description: str) -> str:
    """The YAML of ``data``, after ``parse_profile`` accepted it."""
    import yaml

    parse_profile(data, source="calibrated profile")
    return f"# {description}\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)


def write_profile(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    forget_profiles()
