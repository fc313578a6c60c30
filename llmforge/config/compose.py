"""Recipe + command-line overrides -> a typed RunConfig, through Hydra's compose API.

Overrides use Hydra's syntax: ``recipe=NAME`` picks a recipe, ``GROUP=OPTION`` a
group option, ``a.b=value`` a single key. Users add their own config folders
(with ``model/``, ``parallel/``, ``recipe/``, ... inside) through ``--config-dir``
or the ``LLMFORGE_CONFIG_PATH`` environment variable (``os.pathsep``-separated);
their options shadow the built-in ones of the same name.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmforge.config.choices import Choice, choice_problem
from llmforge.config.schema import GROUPS, RunConfig, choice_keys, iter_keys
from llmforge.errors import Problem, UserError, nearest

BUILTIN_CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf"
SELECTABLE_GROUPS = ("recipe",) + GROUPS
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_save"}
_SCHEMA_NAME = "llmforge_schema"
_ROOT_NAME = "llmforge_root"


@dataclass(frozen=True)
class OptionInfo:
    group: str
    name: str
    description: str
    path: Path


def config_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    """Config folders searched, highest priority first: explicit, environment, built-in."""
    env = [p for p in os.environ.get("LLMFORGE_CONFIG_PATH", "").split(os.pathsep) if p]
    named = [("--config-dir", Path(p)) for p in extra] + [("LLMFORGE_CONFIG_PATH", Path(p)) for p in env]
    problems = [Problem(where, str(path), "is not a folder", _folder_fix(where)) for where, path in named if not path.expanduser().is_dir()]
    if problems:
        raise UserError(problems)
    return [*(path.expanduser().resolve() for _, path in named), BUILTIN_CONFIG_DIR]


def _folder_fix(where: str) -> str:
    if where == "LLMFORGE_CONFIG_PATH":
        return f"set LLMFORGE_CONFIG_PATH to existing folders (separated by {os.pathsep!r}), or unset it"
    return "pass an existing folder"


def available_options(dirs: Sequence[Path]) -> dict[str, dict[str, OptionInfo]]:
    """Every selectable option per group, with the first comment line as its description."""
    found: dict[str, dict[str, OptionInfo]] = {g: {} for g in SELECTABLE_GROUPS}
    for d in reversed(list(dirs)):  # later (higher-priority) folders overwrite
        for group in SELECTABLE_GROUPS:
            for path in sorted((d / group).glob("*.yaml")):
                found[group][path.stem] = OptionInfo(group, path.stem, _description(path), path)
    return found


def _description(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("# @package"):
            return text.lstrip("# ").strip()
    return ""


def check_overrides(overrides: Sequence[str], options: dict[str, dict[str, OptionInfo]]) -> list[str]:
    """Translate aliases and report malformed overrides, unknown keys and unknown options at once."""
    known_keys = {k for k, *_ in iter_keys()}
    problems: list[Problem] = []
    translated: list[str] = []
    for raw in overrides:
        if "=" not in raw:
            problems.append(Problem(raw, raw, "an override must look like key=value", "write e.g. train.steps=10 or parallel=tp2"))
            continue
        key, value = raw.split("=", 1)
        prefix = key[: len(key) - len(key.lstrip("+~"))]
        bare = KEY_ALIASES.get(key.lstrip("+~"), key.lstrip("+~"))
        if not bare:
            problems.append(Problem(raw, "", "an override needs a key before '='", "write key=value, e.g. train.steps=10 or parallel=tp2"))
            continue
        if bare in options:
            if value not in options[bare]:
                valid = ", ".join(sorted(options[bare]))
                problems.append(Problem(bare, value, f"no such {bare} option{nearest(value, options[bare])}", f"choose one of: {valid}"))
        elif bare not in known_keys and not any(k.startswith(bare + ".") for k in known_keys):
            problems.append(
                Problem(bare, value, f"unknown key{nearest(bare, known_keys | set(options))}", "see `llmforge keys` for every key")
            )
        else:
            problems += _syntax(f"{prefix}{bare}={value}", key=bare)
        translated.append(f"{prefix}{bare}={value}")
    if problems:
        raise UserError(problems, title="bad overrides")
    return translated


def _syntax(override: str, *, key: str) -> list[Problem]:
    """Hydra's parse of one override, as a problem naming the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    value = override.split("=", 1)[1]
    quote = f"quote a value with brackets, braces, spaces, commas or '=' in it: {key}='...' (in a shell: \"{key}='...'\")"
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as exc:
        why = str(exc).splitlines()[0].split(" expecting")[0] if str(exc).strip() else "syntax error"
        fix = f"write {key}={value.lstrip('=')}" if value.startswith("=") and value.lstrip("=") else quote
        return [Problem(key, value, f"cannot be read as a value ({why})", fix)]
    if parsed.is_sweep_override():
        return [Problem(key, value, "several values (a sweep) are not supported", f"give one value, or {quote}")]
    return []


def check_files(checked: Sequence[str], options: dict[str, dict[str, OptionInfo]]) -> list[Problem]:
    """The YAML files this composition reads must each hold a mapping, and a recipe's
    defaults list must name options that exist."""
    import yaml

    chosen = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in checked}
    recipe = options["recipe"].get(chosen.get("recipe", "tiny"))
    files = [options[g][v].path for g, v in chosen.items() if g in options and v in options[g]]
    files += [recipe.path] if recipe is not None and recipe.path not in files else []
    problems: list[Problem] = []
    for path in files:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            why = " ".join(str(exc).split())[:300]
            problems.append(Problem(str(path), "", f"is not readable YAML ({why})", "fix the YAML syntax"))
            continue
        if not isinstance(data, dict):
            what = "is empty" if data is None else f"holds a YAML {type(data).__name__}, not a mapping of keys"
            problems.append(
                Problem(str(path), "", what, "write `key: value` lines (see `llmforge recipes` for examples), or remove the file")
            )
            continue
        problems += _check_defaults(path, data.get("defaults"), options)
        problems += _check_recipe_header(path) if recipe is not None and path == recipe.path else []
    return problems


def _check_recipe_header(path: Path) -> list[Problem]:
    """A recipe sets keys of every group, so it must be placed at the root: Hydra reads
    ``# @package _global_`` only from the leading ``# @`` lines, before any other comment."""
    from hydra.plugins.config_source import ConfigSource

    try:
        package = ConfigSource._get_header_dict(path.read_text(encoding="utf-8")).get("package")
    except ValueError:
        package = None
    if package == "_global_":
        return []
    return [
        Problem(
            str(path),
            "",
            "a recipe must start with the line `# @package _global_` (missing, or after another comment)",
            "make `# @package _global_` the file's first line, above its description comment",
        )
    ]


def _check_defaults(path: Path, defaults: object, options: dict[str, dict[str, OptionInfo]]) -> list[Problem]:
    """Every ``override /GROUP: OPTION`` entry of a defaults list names an existing option."""
    if defaults is None:
        return []
    if not isinstance(defaults, list):
        return [Problem(f"{path}: defaults", defaults, "must be a list", "write `defaults:` followed by `- override /GROUP: OPTION` lines")]
    problems = []
    for entry in defaults:
        if not isinstance(entry, dict):
            continue
        for name, option in entry.items():
            group = str(name).replace("override", "").strip().lstrip("/").split("@")[0]
            if group in options and isinstance(option, str) and option not in options[group]:
                problems.append(
                    Problem(
                        f"{path}: defaults",
                        f"{name}: {option}",
                        f"no such {group} option{nearest(option, options[group])}",
                        f"choose one of: {', '.join(sorted(options[group]))}",
                    )
                )
    return problems


def _register_schema() -> None:
    import yaml
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=_SCHEMA_NAME, node=RunConfig)
    store.store(name=_ROOT_NAME, node=yaml.safe_load((BUILTIN_CONFIG_DIR / "config.yaml").read_text(encoding="utf-8")))


def compose(overrides: Sequence[str] = (), *, extra_dirs: Sequence[str | Path] = (), reset: Mapping[str, str] | None = None) -> RunConfig:
    """Compose the recipe and overrides into a validated, typed RunConfig. ``reset``
    (group -> option): those groups take that option, and the overrides that set anything
    in them are left out (``estimate --search`` varies the layout itself, so it starts
    from ``parallel=dp``). A saved plan with overrides on top: ``llmforge.config.saved``."""
    overrides = with_reset(overrides, reset)
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    dirs = config_dirs(extra_dirs)
    options = available_options(dirs)
    checked, unknown_names = split_unknown_names(check_overrides(overrides, options))
    file_problems = check_files(checked, options)
    if file_problems:
        raise UserError(file_problems, title="a configuration file is not valid")
    # Hydra searches its primary config folder before hydra.searchpath, so there is none:
    # every folder goes on the search path, highest priority first, and a user's option
    # shadows a built-in one of the same name. The root config comes from the ConfigStore.
    quoted = ["'file://" + str(d).replace("'", "\\'") + "'" for d in dirs]  # Hydra's quoting: commas, spaces, quotes
    checked.append("hydra.searchpath=[" + ",".join(quoted) + "]")
    _register_schema()
    try:
        with initialize(version_base=None, config_path=None, job_name="llmforge"):
            cfg = hydra_compose(config_name=_ROOT_NAME, overrides=checked)
        cfg = OmegaConf.masked_copy(cfg, [str(f) for f in cfg if f != "hydra"]) if "hydra" in cfg else cfg
        config: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        raise UserError([_explain(exc, options=options)], title="the configuration does not compose") from None
    return with_names(config, unknown_names)


def with_names(config: RunConfig, names: Mapping[str, str]) -> RunConfig:
    """``config`` with these choice keys set to these plain names (RunPlan.build reports the
    unknown ones with every other problem)."""
    for key, value in names.items():
        *path, leaf = key.split(".")
        setattr(functools.reduce(getattr, path, config), leaf, value)
    return config


def split_unknown_names(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The overrides without those giving a choice key none of its names, and those (key -> value):
    OmegaConf would stop at the first, and the plan's checks report them all at once."""
    kinds = choice_keys()
    kept, unknown = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        name = value.strip().strip("'\"")
        if key in kinds and name not in kinds[key].names():
            unknown[key] = name
        else:
            kept.append(item)
    return kept, unknown


def with_reset(overrides: Sequence[str], reset: Mapping[str, str] | None) -> list[str]:
    """``overrides`` without those that set anything in a ``reset`` group, plus ``GROUP=OPTION`` for each."""
    if not reset:
        return list(overrides)
    return [o for o in overrides if _group_of(o) not in reset] + [f"{g}={v}" for g, v in reset.items()]


def _group_of(override: str) -> str:
    """The config group an override sets something in (``parallel`` for ``parallel=tp2``
    and ``+parallel.tp=2``)."""
    return override.split("=", 1)[0].lstrip("+~").split(".", 1)[0]


def _explain(exc: BaseException, *, options: dict[str, dict[str, OptionInfo]]) -> Problem:
    """The most specific message in the exception chain, with the key and file it names."""
    chain: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and len(chain) < 10:
        chain.append(node)
        node = node.__cause__ or node.__context__
    where = next((str(e).split(":")[0] for e in chain if str(e).startswith("In '")), "")
    keyed = next((e for e in chain if getattr(e, "full_key", None)), None)
    root = keyed or chain[-1]
    choice = _choice_of(root)
    if choice is not None:
        return choice_problem(str(getattr(root, "full_key", "")), getattr(root, "value", ""), choice.names())
    # The first paragraph: Hydra appends the available options and its search path.
    text = str(root).split("\n    full_key")[0].split("\n\n")[0].replace("\n", " ").strip() or type(root).__name__
    key = str(getattr(root, "full_key", "") or "")
    source = f" (in {_file_of(where.removeprefix('In ').strip(), options=options)})" if where else ""
    fix = "check the key names and value types in your YAML and overrides (`llmforge keys` lists them)"
    if key and "not in" in text:
        fix = f"remove or rename it{nearest(key, [k for k, *_ in iter_keys()])}; `llmforge keys` lists every key"
    return Problem(key, "", text + source, fix)


def _choice_of(exc: BaseException) -> type[Choice] | None:
    """The choice enum of the field an OmegaConf validation error is about, if it is one."""
    kind = getattr(getattr(exc, "child_node", None), "enum_type", None)
    return kind if isinstance(kind, type) and issubclass(kind, Choice) else None


def _file_of(config_name: str, *, options: dict[str, dict[str, OptionInfo]]) -> str:
    """The file behind Hydra's ``'group/option'`` name, as the search path resolved it."""
    group, _, name = config_name.strip("'").partition("/")
    info = options.get(group, {}).get(name)
    return str(info.path) if info is not None else config_name
