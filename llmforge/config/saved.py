"""A saved config (a run's or a checkpoint's ``plan.json``) read back, checked against
this version's schema, with group options and dotted overrides applied on top.

A plan.json written by another llmforge version, or edited by hand, may hold keys or
values this version does not accept: each is reported with the file, the key and what
this version expects, all at once, before anything runs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmforge.config.compose import available_options, check_overrides, config_dirs, split_unknown_names, with_names, with_reset
from llmforge.config.schema import RunConfig, iter_keys, values_by_key
from llmforge.errors import Problem, UserError, fail, nearest

#: How many wrong values one reading reports (each costs one merge).
_MAX_VALUE_PROBLEMS = 20


def compose_saved(
    base: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    source: str | Path,
    extra_dirs: Sequence[str | Path] = (),
    reset: Mapping[str, str] | None = None,
) -> RunConfig:
    """The saved config ``base`` (read from the file ``source``) with the overrides applied:
    ``GROUP=OPTION`` replaces that whole group, ``a.b=value`` one key, and the recipe cannot
    change. ``reset`` as for ``llmforge.config.compose.compose``."""
    from omegaconf import OmegaConf

    overrides = with_reset(overrides, reset)
    options = available_options(config_dirs(extra_dirs))
    cfg = saved_config(base, source=str(source))
    dotted = []
    for item in check_overrides(overrides, options):
        key, value = item.lstrip("+~").split("=", 1)
        if key == "recipe":
            raise UserError(
                [
                    Problem(
                        "recipe",
                        value,
                        "a resumed run keeps its recipe",
                        "override single keys or groups instead (parallel=dp2, train.steps=400)",
                    )
                ],
                title="bad overrides",
            )
        if key in options:
            cfg[key] = _group_option(key, options[key][value].path)
        else:
            dotted.append(f"{key}={value}")
    dotted, unknown_names = split_unknown_names(dotted)
    try:
        if dotted:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotted))
        return with_names(OmegaConf.to_object(cfg), unknown_names)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - OmegaConf validation errors (wrong type, ...)
        raise fail(f"the overrides do not apply to the saved plan: {str(exc).splitlines()[0]}", title="bad overrides") from None


def _group_option(group: str, path: Path) -> Any:
    """One group option's file, checked against its section of the schema."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(OmegaConf.structured(type(getattr(RunConfig(), group))), OmegaConf.load(path))
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
        key = f"{group}.{getattr(exc, 'full_key', '')}".rstrip(".")
        raise UserError(
            [Problem(key, "", f"{str(exc).splitlines()[0]} (in {path})", "fix the file; `llmforge keys` lists every key and its type")],
            title="a configuration file is not valid",
        ) from None


def saved_config(base: Mapping[str, Any], *, source: str) -> Any:
    """``base`` merged onto the schema (a DictConfig); every key or value this version
    does not accept is reported at once, naming ``source``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    types = {key: kind for key, kind, *_ in iter_keys()}
    problems = _unknown_keys(base, types=types, source=source)
    data: dict[str, Any] = copy.deepcopy(dict(base))
    for _ in range(_MAX_VALUE_PROBLEMS):
        for problem in problems:
            _drop(data, problem.key)
        try:
            cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
            break
        except (OmegaConfBaseException, ValueError) as exc:
            key = str(getattr(exc, "full_key", "") or "").split("[", 1)[0]  # a list's item: the list's key
            if not key or any(p.key == key for p in problems):
                problems.append(Problem(key or source, "", f"{str(exc).splitlines()[0]} (in {source})", _SAVED_FIX))
                break
            value = values_by_key(data).get(key)
            problems.append(
                Problem(key, value, f"this version of llmforge expects {_kind(types.get(key, '?'))} here (in {source})", _SAVED_FIX)
            )
    if problems:
        raise UserError(problems, title=f"{source} does not fit this version of llmforge")
    return cfg


_SAVED_FIX = "edit the file to match (`llmforge keys` lists every key and its type), or use the llmforge version that wrote it"


def _unknown_keys(node: Mapping[str, Any], *, types: dict[str, str], source: str, prefix: str = "") -> list[Problem]:
    """A problem per saved key (or section) this version does not know, or a section saved as a single value."""
    problems = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        section = any(k.startswith(key + ".") for k in types)
        if isinstance(value, Mapping) and section:
            problems += _unknown_keys(value, types=types, source=source, prefix=key + ".")
        elif section:
            problems.append(
                Problem(
                    key, value, f"this version of llmforge expects a section of keys here, not a single value (in {source})", _SAVED_FIX
                )
            )
        elif key not in types:
            problems.append(Problem(key, value, f"this version of llmforge has no such key{nearest(key, types)} (in {source})", _SAVED_FIX))
    return problems


def _drop(data: dict[str, Any], key: str) -> None:
    """Remove a dotted key from nested dicts (so the schema's default stands in for it)."""
    *parents, leaf = key.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _kind(type_name: str) -> str:
    """'int | None' -> 'an integer or null', for the message."""
    names = {
        "int": "an integer",
        "float": "a number",
        "str": "a string",
        "bool": "true or false",
        "list[int]": "a list of integers",
        "list[str]": "a list of strings",
    }
    if "|" in type_name.removesuffix(" | None"):  # a choice key (llmforge.config.choices)
        return "one of " + ", ".join(type_name.removesuffix(" | None").split("|"))
    if type_name.endswith(" | None"):
        inner = type_name.removesuffix(" | None")
        return f"{names.get(inner, inner)} or null"
    return names.get(type_name, type_name)
