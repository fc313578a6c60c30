"""An export that cannot be written ends in one message and leaves nothing: a full disk or the
file-size limit during the write, and quantization without torchao."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console
from test_export import GPT_STYLE, checkpoint_of

from llmforge.commands.checkpoint import export_command, export_quantization
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.testing.faults import file_size_limit


def test_an_export_past_the_file_size_limit_names_the_limit_and_leaves_nothing(tmp_path):
    checkpoint_of(tmp_path, **GPT_STYLE)
    out = tmp_path / "hf"
    with file_size_limit(20_000), pytest.raises(UserError) as info:  # model.safetensors is larger: safetensors (Rust) fails
        export_command([f"ckpt={tmp_path / 'run'}"], out_dir=out, console=Console(file=io.StringIO()), quantize="none")
    message = info.value.message()
    assert "no space for the export" in message and "--out" in message and "ulimit -f unlimited" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(("overrides", "quantize", "key"), [(["precision.qat=int4"], "auto", "precision.qat"), ([], "int4", "--quantize")])
def test_quantizing_an_export_without_torchao_says_what_to_install(monkeypatch, overrides, quantize, key):
    config = compose(["recipe=tiny", *overrides])
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed
    with pytest.raises(UserError) as info:
        export_quantization(config, quantize=quantize, group_size=None)
    assert info.value.problems[0].key == key
    assert "pip install 'llmforge[fp8]'" in info.value.message() and "--quantize none" in info.value.message()
    assert export_quantization(config, quantize="none", group_size=None) is None
