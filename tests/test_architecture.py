"""The package's import graph, read from the source with ``ast`` (nothing is imported):
the light layers import no torch and nothing that runs models, no module and no package
is part of an import cycle, packages import only the layers below them, and ``llmforge``
imports sit at the top of modules (except in ``cli.py`` and ``commands/``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmforge"
#: Modules (and packages, by prefix) that must stay light: no torch, nothing below.
LIGHT = (
    "llmforge.estimate",
    "llmforge.config",
    "llmforge.plan",
    "llmforge.layout",
    "llmforge.layout_rules",
    "llmforge.elastic",
    "llmforge.hardware",
    "llmforge.errors",
    "llmforge.blockspec",
)
#: What the light layers must not import.
HEAVY = (
    "torch",
    "llmforge.train",
    "llmforge.parallel",
    "llmforge.models",
    "llmforge.launch",
    "llmforge.commands",
    "llmforge.cli",
    "llmforge.rehearse",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports (at any depth, lazily or not), with its line."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    return {_module_name(p): list(_imports(p, _module_name(p))) for p in PACKAGE.rglob("*.py")}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_light_layers_import_no_torch_and_nothing_that_runs_models(graph):
    bad = [
        f"{m}:{line} imports {target}" for m, deps in graph.items() if _under(m, LIGHT) for target, line in deps if _under(target, HEAVY)
    ]
    assert not bad, "\n".join(bad)


def _resolve(target: str, modules: set[str]) -> str:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle_in_the_package(graph):
    modules = set(graph)
    edges = {m: {_resolve(t, modules) for t, _ in deps if t.startswith("llmforge")} - {m, ""} for m, deps in graph.items()}
    assert not _cycles(edges)


#: Imports point one way: cli -> commands -> launch -> train -> parallel -> models.
#: Each layer on the left must not import the ones on the right.
FORBIDDEN = {
    "llmforge.models": ("llmforge.parallel", "llmforge.train", "llmforge.plan", "torch.distributed"),
    "llmforge.parallel": (
        "llmforge.train",
        "llmforge.plan",
        "llmforge.launch",
        "llmforge.checkpoint",
        "llmforge.estimate",
        "llmforge.commands",
        "llmforge.rundir",
    ),
    "llmforge.train": ("llmforge.launch", "llmforge.commands", "llmforge.cli", "llmforge.testing", "llmforge.rehearse"),
    "llmforge.rehearse": ("llmforge.commands", "llmforge.cli"),
    "llmforge.launch": ("llmforge.commands", "llmforge.cli", "llmforge.testing"),
    "llmforge.checkpoint": ("llmforge.train", "llmforge.launch", "llmforge.commands"),
    "llmforge.data": ("llmforge.train", "llmforge.parallel", "llmforge.launch", "llmforge.commands"),
}


def test_imports_point_one_way(graph):
    bad = [
        f"{m}:{line} imports {target}"
        for layer, banned in FORBIDDEN.items()
        for m, deps in graph.items()
        if _under(m, (layer,))
        for target, line in deps
        if _under(target, banned)
    ]
    assert not bad, "\n".join(bad)


#: The packages (and top-level modules) of llmforge, lowest layer first. A package imports
#: only packages of the layers before its own (at module level or inside a function).
LAYERS = (
    ("errors", "files"),
    ("storage",),
    ("config",),
    ("layout", "hardware", "blockspec"),
    ("layout_fixes",),
    ("layout_rules",),
    ("elastic",),
    ("plan",),
    ("data", "observe", "rundir", "report", "processes"),
    ("estimate",),
    ("models",),
    ("parallel",),
    ("checkpoint", "evaluate"),
    ("calibrate",),
    ("train",),
    ("launch", "generate"),
    ("rehearse", "testing"),
    ("commands",),
    ("cli",),
    ("__main__",),
)


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _package_edges(graph) -> dict[str, set[tuple[str, str]]]:
    """package -> {(package it imports, 'module:line'), ...} (imports within a package left out)."""
    modules = set(graph)
    edges: dict[str, set[tuple[str, str]]] = {}
    for m, deps in graph.items():
        for target, line in deps:
            if not target.startswith("llmforge."):
                continue
            source, dest = _package(m), _package(_resolve(target, modules))
            if dest and dest != source:
                edges.setdefault(source, set()).add((dest, f"{m}:{line}"))
    return edges


def _back_edges(edges: dict[str, set[tuple[str, str]]]) -> list[str]:
    tier = {name: i for i, names in enumerate(LAYERS) for name in names}
    return sorted(
        f"{where} ({source}) imports {dest}"
        for source, out in edges.items()
        for dest, where in out
        if tier.get(dest, -1) >= tier.get(source, -1)
    )


def test_every_package_has_a_layer(graph):
    known = {name for names in LAYERS for name in names}
    assert {_package(m) for m in graph} - {""} <= known


def test_no_import_cycle_between_packages(graph):
    edges = {p: {dest for dest, _ in out} for p, out in _package_edges(graph).items()}
    for deps in list(edges.values()):
        for dest in deps:
            edges.setdefault(dest, set())
    assert not _cycles(edges)


def test_packages_import_only_the_layers_below(graph):
    bad = _back_edges(_package_edges(graph))
    assert not bad, "\n".join(bad)


def test_a_back_edge_is_found():
    assert _back_edges({"config": {("plan", "llmforge.config.x:1")}}) == ["llmforge.config.x:1 (config) imports plan"]
    assert _back_edges({"launch": {("calibrate", "m:1")}, "calibrate": {("processes", "m:2")}}) == []


#: Where ``llmforge`` imports may sit inside functions: the CLI's start-up time is the reason
#: (``llmforge --help`` and the light commands must not pay for the heavy packages).
LAZY_IMPORTS_ALLOWED = ("llmforge.cli", "llmforge.commands")


def _function_level_imports(source: str) -> Iterator[tuple[str, int]]:
    """(module, line) of each llmforge (or relative) import inside a function of ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    targets = [a.name for a in inner.names] if isinstance(inner, ast.Import) else [inner.module or "."]
                    if getattr(inner, "level", 0) or any(t.startswith("llmforge") for t in targets):
                        yield ", ".join(targets), inner.lineno


def test_llmforge_imports_sit_at_the_top_of_modules():
    bad = [
        f"{_module_name(p)}:{line} imports {what} inside a function"
        for p in PACKAGE.rglob("*.py")
        if not _under(_module_name(p), LAZY_IMPORTS_ALLOWED)
        for what, line in _function_level_imports(p.read_text())
    ]
    assert not bad, "\n".join(sorted(set(bad)))


def test_a_function_level_import_is_found():
    source = (
        "import torch\nfrom llmforge.plan import RunPlan\n\ndef f():\n    import json\n    from llmforge.errors import fail\n    from . "
        "import x\n"
    )
    assert sorted(set(_function_level_imports(source))) == [(".", 7), ("llmforge.errors", 6)]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
