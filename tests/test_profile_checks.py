"""Every hardware profile is checked when read, built-in, cached or given as a path: a peak or
bandwidth that is negative, zero or NaN, or a file that is not UTF-8, ends in one message
naming the file, the key and the fix (exit 2), never in a wrong estimate or a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.hardware import BUILTIN_DIR, cpu_threads, forget_profiles, known_profiles, machine_profile_path

runner = CliRunner()
CPU = (BUILTIN_DIR / "cpu.yaml").read_text(encoding="utf-8")


def estimate(*args: str):
    return runner.invoke(
        app, ["estimate", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.ffn_hidden_size=128", *args]
    )


def refused(result, *words: str) -> str:
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert all(w in text for w in words), text
    return text


@pytest.mark.parametrize(
    "line, value",
    [
        ("fp32: 0.1,", "fp32: -3,"),
        ("fp32: 0.1,", "fp32: .nan,"),
        ("memory_bandwidth_gbs: 20", "memory_bandwidth_gbs: 0"),
        ("inter_node_gbs: 1.25", "inter_node_gbs: -1"),
        ("memory_gib: 16", "memory_gib: 0"),
        ("devices_per_node: 64", "devices_per_node: 0"),
        ("host_link_gbs: 20", "host_link_gbs: .nan"),
    ],
)
def test_a_profile_with_a_bad_number_is_named_with_its_key(tmp_path, line, value):
    path = tmp_path / "bad profile é.yaml"
    path.write_text(CPU.replace(line, value), encoding="utf-8")
    key = value.split(":")[0]
    refused(estimate(f"cluster.accelerator='{path}'"), str(path), key, "Fix:")  # quoted, as the hint for a space says


def test_a_profile_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"# \xff\xfe\nname: x\n")
    refused(estimate(f"cluster.accelerator={path}"), str(path), "cannot read the profile", "Fix:")


def test_a_bad_cached_profile_says_measure_again_or_delete_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    machine = machine_profile_path(cpu_threads(1))
    machine.parent.mkdir(parents=True)
    machine.write_text(CPU.replace("memory_bandwidth_gbs: 20", "memory_bandwidth_gbs: -20"), encoding="utf-8")
    forget_profiles()
    refused(estimate("cluster.accelerator=cpu"), str(machine), "llmforge calibrate", f"delete {machine}")
    named = tmp_path / "profiles" / "ours.yaml"
    named.write_text(CPU.replace("fp32: 0.1,", "fp32: 0,"), encoding="utf-8")
    forget_profiles()
    refused(estimate("cluster.accelerator=ours"), str(named), "peak_tflops.fp32", f"delete {named}")
    named.unlink()
    forget_profiles()


def test_every_builtin_profile_passes_the_checks():
    builtin = {name: p for name, p in known_profiles().items() if Path(p.source).parent == BUILTIN_DIR}
    assert len(builtin) == len(list(BUILTIN_DIR.glob("*.yaml")))
    assert all(p.memory_bandwidth > 0 and min(p.peak_flops.values()) > 0 for p in builtin.values())
