"""Every benchmark and report under tools/ imports: a renamed or removed llmforge name breaks a
tool at its first run on a GPU, where CI never goes, unless something loads it here."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")), ids=lambda p: p.stem)
def test_the_tool_imports(path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))  # tools import one another (plain_gpt, published_runs)
    monkeypatch.syspath_prepend(str(TOOLS.parent / "tests"))
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def _llmforge_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from llmforge... import name`` in a file, function bodies included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmforge"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")), ids=lambda p: p.stem)
def test_the_tools_names_exist(path: Path) -> None:
    """Tools import most of llmforge inside their functions (a GPU run pays for what it uses)."""
    missing = []
    for line, module_name, name in _llmforge_imports(path):
        module = importlib.import_module(module_name)
        submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{name}") is not None
        if not hasattr(module, name) and not submodule:
            missing.append(f"{path.name}:{line}: {module_name}.{name}")
    assert not missing, missing


def test_a_missing_name_is_found(tmp_path: Path) -> None:
    tool = tmp_path / "tool.py"
    tool.write_text("def main():\n    from llmforge.train.loop import NoSuchHooks\n")
    assert _llmforge_imports(tool) == [(2, "llmforge.train.loop", "NoSuchHooks")]
    with pytest.raises(AssertionError, match="NoSuchHooks"):
        test_the_tools_names_exist(tool)
