"""``llmforge resume``: the saved plan, the user's overrides, and what may not change.

The plan is the one stored in the checkpoint. Overrides apply on top of it, composed
by ``llmforge.config.saved`` with the saved config as base: ``GROUP=OPTION``
replaces a whole group (``parallel=dp2``), ``a.b=value`` one key.
Settings that training state depends on (model shape, data and tokenizer, seed)
cannot change; every such difference is listed in one error before launch.
The run continues in the checkpoint's run folder unless ``run.dir`` is given; another
folder must hold no run (``llmforge.launch`` refuses it as ``pretrain`` does).

A checkpoint whose plan is not its run folder's (a step folder copied in from another
run) is refused: resuming it there would replace that run's plan.json, rotate its
checkpoints away and mix two models in its metrics. ``--from-other-run`` accepts such
a checkpoint and starts a new run from it, in a ``run.dir`` that holds no run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from llmforge.checkpoint.locate import Located, locate
from llmforge.checkpoint.objstore import read_json
from llmforge.checkpoint.owner import free_prefix
from llmforge.checkpoint.store import train_state_of
from llmforge.config.saved import compose_saved
from llmforge.config.schema import values_by_key
from llmforge.errors import Problem, UserError, fail, override_arg, pasteable
from llmforge.plan import RunPlan
from llmforge.storage import is_url, join

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


def split_ckpt(overrides: list[str]) -> tuple[str, list[str]]:
    """Take ``ckpt=PATH`` out of the overrides."""
    ckpts = [o.split("=", 1)[1] for o in overrides if o.startswith("ckpt=")]
    rest = [o for o in overrides if not o.startswith("ckpt=")]
    if len(ckpts) != 1 or not ckpts[0]:
        raise UserError(
            [
                Problem(
                    "ckpt",
                    ckpts or None,
                    "resume needs exactly one ckpt=PATH",
                    "pass ckpt=runs/NAME/checkpoints/latest, a run folder, or a step_N folder",
                )
            ],
            title="bad overrides",
        )
    return ckpts[0], rest


def fixed_changes(old: Any, new: Any) -> list[tuple[str, Any, Any, str]]:
    """(key, old value, new value, why it is fixed) for every fixed setting that differs."""
    before, after = values_by_key(old), values_by_key(new)
    changes = []
    for key in sorted(before):
        if before[key] == after.get(key) or key in MAY_CHANGE:
            continue
        fixed = next((f for f in FIXED if key == f or (f.endswith(".") and key.startswith(f))), None)
        if fixed is not None:
            changes.append((key, before[key], after.get(key), _WHY[fixed]))
    return changes


def differences(old: Any, new: Any) -> list[Problem]:
    """One problem per setting that changed but must not."""
    return [
        Problem(key, value, f"cannot change on resume (saved: {saved!r}); {why}", f"drop the override or set {key}={saved}")
        for key, saved, value, why in fixed_changes(old, new)
    ]


def plan_for_resume(overrides: list[str], *, from_other_run: bool = False, config_dir: Sequence[Path] = ()) -> tuple[RunPlan, Any]:
    """The plan to continue with and the verified checkpoint folder to restore."""
    console = Console(stderr=True, markup=False, soft_wrap=True)
    ckpt, rest = split_ckpt(overrides)
    found = locate(ckpt)
    for note in found.notes:
        console.print(note, style="yellow", markup=False, highlight=False)
    if not any(o.split("=", 1)[0] == "run.dir" for o in rest):
        rest = [*rest, override_arg("run.dir", found.run_dir)]
    old, new = saved_config(found.path), saved_config(found.path, rest, extra_dirs=config_dir)
    check_same_run(found, saved=old, run_dir=Path(new.run.dir), from_other_run=from_other_run)
    step = train_state_of(found.path)["step"]
    problems = differences(old, new)
    problems += shared_storage(old, new, found=found)
    if new.train.steps <= step:
        problems.append(
            Problem("train.steps", new.train.steps, f"the checkpoint is already at step {step}", f"set train.steps above {step}")
        )
    if problems:
        raise UserError(problems, title=f"cannot resume from {found.path}")
    plan = RunPlan.build(new)
    console.print(f"resuming from {found.path} (step {step}) into {plan.run_dir}, layout {plan.layout}", markup=False, highlight=False)
    return plan, found.path


def shared_storage(old: Any, new: Any, *, found: Located) -> list[Problem]:
    """A resume into another run.dir starts a new run: with the same object-storage
    checkpoint.dir it would rotate and set aside the checkpoints of the run it came from."""
    same_url = old.checkpoint.dir and new.checkpoint.dir and old.checkpoint.dir.rstrip("/") == new.checkpoint.dir.rstrip("/")
    if not same_url or Path(new.run.dir).resolve() == found.run_dir.resolve():
        return []
    return [
        Problem(
            "checkpoint.dir",
            new.checkpoint.dir,
            f"is where the run in {found.run_dir} keeps its checkpoints, and run.dir={new.run.dir} starts another run",
            f"give the new run its own prefix, e.g. checkpoint.dir={free_prefix(new.checkpoint.dir)}",
        )
    ]


def saved_plan(path: Any) -> dict[str, Any]:
    """The plan.json stored in a checkpoint (a folder or an object-storage URL), as a dict."""
    if is_url(path):
        try:
            data = read_json(join(path, "plan.json"))
        except (OSError, ValueError) as exc:
            raise fail(f"{join(path, 'plan.json')}: unreadable ({exc})", title="damaged checkpoint") from None
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
            raise fail(f"{join(path, 'plan.json')}: unreadable (no config section)", title="damaged checkpoint")
        return data
    try:
        data = json.loads((path / "plan.json").read_text())
        if not isinstance(data.get("config"), dict):
            raise ValueError("no config section")
        return data
    except (OSError, ValueError) as exc:
        title = "damaged checkpoint" if (path / "manifest.json").is_file() else "damaged run folder"
        raise fail(f"{path / 'plan.json'}: unreadable ({exc})", title=title) from None


def saved_config(folder: Any, overrides: Sequence[str] = (), *, extra_dirs: Sequence[Path] = ()) -> Any:
    """The RunConfig in ``folder``'s plan.json (a checkpoint's or a run folder's), ``overrides``
    applied (group options also from the ``extra_dirs`` config folders)."""
    source = join(folder, "plan.json") if is_url(folder) else folder / "plan.json"
    return compose_saved(saved_plan(folder)["config"], overrides, source=source, extra_dirs=extra_dirs)


def checkpoint_plan(path: Any, overrides: Sequence[str] = ()) -> RunPlan:
    """The plan a checkpoint was saved with, ``overrides`` applied (export, generate)."""
    return RunPlan.build(saved_config(path, overrides))


def check_same_run(found: Located, *, saved: Any, run_dir: Path, from_other_run: bool) -> None:
    """Refuse a checkpoint whose fixed settings (model, data, tokenizer, seed) are not those
    of the run folder it sits in, unless ``from_other_run``: then the run continues in a
    new folder, never in the one holding the checkpoint."""
    if from_other_run:
        if not is_url(found.path) and run_dir.resolve() in found.path.resolve().parents:
            raise UserError(
                [
                    Problem(
                        "run.dir",
                        str(run_dir),
                        f"--from-other-run starts a new run, but {run_dir} holds {found.path}",
                        "pass run.dir=NEW, a folder that holds no run",
                    )
                ],
                title="cannot resume into this folder",
            )
        return
    home = found.run_dir / "plan.json"
    if not home.is_file():
        return
    changes = fixed_changes(saved_config(found.run_dir), saved)
    if changes:
        title = f"{found.path} is a checkpoint of another run than {found.run_dir} (whose plan is {home})"
        fix = (
            f"resume the run the checkpoint came from, or start a new run from it: "
            f"`llmforge resume {pasteable('ckpt', found.path, override=False)} run.dir=NEW --from-other-run`"
        )
        raise UserError(
            [Problem(key, theirs, f"the checkpoint has {theirs!r}, {home} has {ours!r}", fix) for key, ours, theirs, _ in changes],
            title=title,
        )
