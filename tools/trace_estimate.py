"""How one ``estimate()`` walks the estimator's modules, and how many caches it leans on.

    python tools/trace_estimate.py [overrides ...]      (default: the default recipe, and recipe=gpt-7b parallel=tp2pp2)

For one cold ``estimate(shape, layout, job)`` (every ``lru_cache`` of ``llmforge.estimate``
cleared first) it counts, with ``sys.setprofile``, inside ``llmforge/estimate/``:

- entries into ``params.py`` from another file (calls of its functions; reads of its classes'
  properties such as ``Tensor.numel`` are counted apart);
- returns to a file the walk had left (a function of file A returning into a caller in file B != A);
- calls in all;

and it lists the ``lru_cache``s and module-level dicts of the package.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections import Counter

import llmforge.estimate as package

ROOT = package.__path__[0]


def _modules() -> list:
    return [importlib.import_module(f"llmforge.estimate.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def caches() -> tuple[list[str], list[str]]:
    """(lru_caches, module-level dicts) of the estimate package."""
    lru, dicts = [], []
    for mod in _modules():
        for name, value in vars(mod).items():
            if isinstance(value, functools._lru_cache_wrapper) and value.__module__ == mod.__name__:
                lru.append(f"{mod.__name__}.{name}")
            elif isinstance(value, dict) and name.startswith("_") and not name.startswith("__"):
                dicts.append(f"{mod.__name__}.{name}")
    return lru, dicts


def clear() -> None:
    """Empty every lru_cache and module-level memo dict of the package."""
    for name in caches()[1]:
        module, _, attr = name.rpartition(".")
        vars(sys.modules[module])[attr].clear()
    for mod in _modules():
        for value in vars(mod).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


@functools.cache
def _params_properties() -> frozenset[str]:
    """Names of the properties of params.py's classes (``Tensor.numel``, ``StageCounts.blocks``): reading one
    is counted apart from calling a function."""
    from llmforge.estimate import params

    names = set()
    for cls in vars(params).values():
        if isinstance(cls, type) and cls.__module__ == params.__name__:
            names |= {n for n, v in vars(cls).items() if isinstance(v, (property, functools.cached_property)) or n == "local_shape"}
    return frozenset(names)


ENTRIES: Counter = Counter()  # (calling file, params.py function): entries, over every walk


def walk(fn, *args, **kwargs) -> Counter:
    counts: Counter = Counter()

    def hook(frame, event, arg):
        if event not in ("call", "return"):
            return
        here = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if not here.startswith(ROOT):
            return
        if event == "call":
            counts["calls"] += 1
            if here.endswith("params.py") and caller != here:
                read = frame.f_code.co_name in _params_properties()
                counts["params_property_reads" if read else "params_entries"] += 1
                ENTRIES[(caller.rpartition("/")[2], frame.f_code.co_name)] += 1
        elif caller.startswith(ROOT) and caller != here:
            counts["returns_to_left_file"] += 1

    sys.setprofile(hook)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return counts


def main() -> None:
    from llmforge.config.compose import compose
    from llmforge.estimate import core
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan

    args = [a for a in sys.argv[1:] if a != "-v"]
    runs = [args] if args else [[], ["recipe=gpt-7b", "parallel=tp2pp2"]]
    for overrides in runs:
        shape, layout, job = from_plan(RunPlan.build(compose(overrides)))
        clear()
        cold = walk(core.estimate, shape, layout, job)
        warm = walk(core.estimate, shape, layout, job)
        print(f"{' '.join(overrides) or '(default recipe)'}: cold {dict(cold)}; warm {dict(warm)}")
    if "-v" in sys.argv:
        for (caller, name), n in ENTRIES.most_common():
            print(f"  {n:4d} {caller} -> params.{name}")
    lru, dicts = caches()
    print(f"lru_caches: {len(lru)}; module-level dicts: {len(dicts)} {dicts}")


if __name__ == "__main__":
    main()
