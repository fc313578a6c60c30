"""``llmforge resume``: the saved plan, the user's overrides, and what may not change.

The plan is the one stored in the checkpoint. Overrides apply on top of it, composed
by ``llmforge.config.compose`` with the saved config as base: ``GROUP=OPTION``
replaces a whole group (``parallel=dp2``), ``a.b=value`` one key.
Settings that training state depends on (model shape, data and tokenizer, seed)
cannot change; every such difference is listed in one error before launch.
The run continues in the checkpoint's run folder unless ``run.dir`` is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from rich.console import Console

from llmforge.checkpoint.locate import locate
from llmforge.checkpoint.manifest import read_train_state
from llmforge.config.compose import compose
from llmforge.config.schema import values_by_key
from llmforge.errors import Problem, UserError, fail
from llmforge.plan import RunPlan

#: Keys (or key prefixes ending in ".") whose change invalidates the saved state.
FIXED = ("model.", "data.", "train.seed", "optim.name")
#: Keys under FIXED that may still change.
MAY_CHANGE = ("model.dropout", "model.init_from", "data.cache_dir", "data.num_proc")
_WHY = {
    "model.": "the saved weights have this model's shape and flavour",
    "data.": "the data position is a position in this data and tokenizer",
    "train.seed": "the data order and random streams follow this seed",
    "optim.name": "the saved optimizer state belongs to this optimizer",
}


def split_ckpt(overrides: List[str]) -> Tuple[str, List[str]]:
    """Take ``ckpt=PATH`` out of the overrides."""
    ckpts = [o.split("=", 1)[1] for o in overrides if o.startswith("ckpt=")]
    rest = [o for o in overrides if not o.startswith("ckpt=")]
    if len(ckpts) != 1 or not ckpts[0]:
        raise UserError([Problem("ckpt", ckpts or None, "resume needs exactly one ckpt=PATH", "pass ckpt=runs/NAME/checkpoints/latest, a run folder, or a step_N folder")], title="bad overrides")
    return ckpts[0], rest


def differences(old: Any, new: Any) -> List[Problem]:
    """One problem per setting that changed but must not."""
    before, after = values_by_key(old), values_by_key(new)
    problems = []
    for key in sorted(before):
        if before[key] == after.get(key) or key in MAY_CHANGE:
            continue
        fixed = next((f for f in FIXED if key == f or (f.endswith(".") and key.startswith(f))), None)
        if fixed is not None:
            problems.append(Problem(key, after.get(key), f"cannot change on resume (saved: {before[key]!r}); {_WHY[fixed]}", f"drop the override or set {key}={before[key]}"))
    return problems


def plan_for_resume(overrides: List[str]) -> Tuple[RunPlan, Path]:
    """The plan to continue with and the verified checkpoint folder to restore."""
    console = Console(stderr=True, markup=False, soft_wrap=True)
    ckpt, rest = split_ckpt(overrides)
    found = locate(ckpt)
    for note in found.notes:
        console.print(note, style="yellow", markup=False, highlight=False)
    saved = saved_plan(found.path)["config"]
    if not any(o.split("=", 1)[0] == "run.dir" for o in rest):
        rest = [*rest, f"run.dir={found.run_dir}"]
    old, new = compose(base=saved), compose(rest, base=saved)
    step = read_train_state(found.path)["step"]
    problems = differences(old, new)
    if new.train.steps <= step:
        problems.append(Problem("train.steps", new.train.steps, f"the checkpoint is already at step {step}", f"set train.steps above {step}"))
    if problems:
        raise UserError(problems, title=f"cannot resume from {found.path}")
    plan = RunPlan.build(new)
    console.print(f"resuming from {found.path} (step {step}) into {plan.run_dir}, layout {plan.layout}", markup=False, highlight=False)
    return plan, found.path


def saved_plan(path: Path) -> Dict[str, Any]:
    """The plan.json stored in a checkpoint, as a dict."""
    try:
        data = json.loads((path / "plan.json").read_text())
        if not isinstance(data.get("config"), dict):
            raise ValueError("no config section")
        return data
    except (OSError, ValueError) as exc:
        raise fail(f"{path / 'plan.json'}: unreadable ({exc})", title="damaged checkpoint") from None


def checkpoint_plan(path: Path, overrides: Sequence[str] = ()) -> RunPlan:
    """The plan a checkpoint was saved with, ``overrides`` applied (export, generate)."""
    return RunPlan.build(compose(list(overrides), base=saved_plan(path)["config"]))
