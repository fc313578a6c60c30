"""What the platform launchers (``cluster.launcher=kubernetes`` or ``skypilot``) share: the
checks a plan must pass to run there, the script every node runs, and the dry run.

Nothing runs or is written on this machine. The plan travels inside the manifest (the
``LLMFORGE_PLAN`` environment variable); each node writes it to ``run.dir/plan.json`` on
the shared volume or bucket and starts the same torchrun command as a SLURM node does,
with the rendezvous taken from the platform's own variables. The ranks resume from the
newest complete checkpoint in ``run.dir`` when there is one, so a job the platform
restarts (or a manifest submitted again) continues the run.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex

from llmforge.config.choices import KubernetesKind, Launcher
from llmforge.elastic import is_elastic
from llmforge.errors import Problem, UserError
from llmforge.plan import RunPlan

#: The environment variable that carries the plan (plan.json's text) to every node.
PLAN_ENV = "LLMFORGE_PLAN"
#: The worker's flag: continue from run.dir's newest complete checkpoint when there is one.
RESUME_NEWEST = "--resume-newest"


def job_name(plan: RunPlan, *, limit: int = 40) -> str:
    """run.name as a Kubernetes/SkyPilot name (DNS-1123: lower-case letters, digits and '-';
    short enough that a pod's host name, ``NAME-node-0-0``, stays under 63 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", plan.config.run.name.lower()).strip("-")[:limit].strip("-")
    return name if name and name[0].isalpha() else f"llmforge-{name}".strip("-")


def mounts(plan: RunPlan) -> dict:
    """{"data"|"runs": (source, mount path)} of the launcher's volumes or buckets that are set."""
    c = plan.config.cluster
    if c.launcher == Launcher.KUBERNETES:
        k = c.kubernetes
        found = {"data": (k.data_claim, k.data_mount), "runs": (k.runs_claim, k.runs_mount)}
    else:
        s = c.skypilot
        found = {"data": (s.data_bucket, s.data_mount), "runs": (s.runs_bucket, s.runs_mount)}
    return {k: v for k, v in found.items() if v[0]}


def _inside(path: str, folder: str) -> bool:
    path, folder = posixpath.normpath(path), posixpath.normpath(folder)
    return posixpath.isabs(path) and (path == folder or path.startswith(folder.rstrip("/") + "/"))


def _prefix(plan: RunPlan) -> str:
    """The launcher's own keys: ``cluster.kubernetes`` or ``cluster.skypilot``."""
    return "cluster.kubernetes" if plan.config.cluster.launcher == Launcher.KUBERNETES else "cluster.skypilot"


def _source_key(plan: RunPlan, kind: str) -> str:
    """The key that sets the ``kind`` ("data" or "runs") volume or bucket."""
    return f"{_prefix(plan)}.{kind}_claim" if plan.config.cluster.launcher == Launcher.KUBERNETES else f"{_prefix(plan)}.{kind}_bucket"


def _source_example(plan: RunPlan, kind: str) -> str:
    if plan.config.cluster.launcher == Launcher.KUBERNETES:
        return "NAME (a ReadWriteMany PersistentVolumeClaim)" if kind == "runs" else "NAME"
    return f"s3://BUCKET/{kind}" + (" (or gs://, r2://, ...)" if kind == "runs" else "")


def platform_problems(plan: RunPlan) -> list[Problem]:
    """What a plan needs before it can be written for ``cluster.launcher`` (kubernetes or skypilot)."""
    out = _software_problems(plan) + _mount_problems(plan)
    found = {kind: mount for kind, (_, mount) in mounts(plan).items() if posixpath.isabs(mount)}
    if not any(p.key.endswith("_mount") for p in out):
        out += _run_dir_problems(plan, found) + _cache_problems(plan, found)
    return out + _elastic_problems(plan)


def _software_problems(plan: RunPlan) -> list[Problem]:
    """The nodes need llmforge: an image (Kubernetes), or an image or setup commands (SkyPilot)."""
    c = plan.config.cluster
    if c.image or (c.launcher == Launcher.SKYPILOT and c.skypilot.setup):
        return []
    if c.launcher == Launcher.KUBERNETES:
        why, fix = "the pods need a container image with llmforge and torch installed", "set cluster.image=REGISTRY/IMAGE:TAG"
    else:
        why = "the nodes need llmforge and torch, and a stock image has neither"
        fix = "set cluster.image=REGISTRY/IMAGE:TAG, or 'cluster.skypilot.setup=pip install llmforge' (commands each node runs first)"
    return [Problem("cluster.image", None, why, fix)]


def _mount_problems(plan: RunPlan) -> list[Problem]:
    """The runs volume is set, and every mount point is an absolute path on the nodes."""
    out = []
    if "runs" not in mounts(plan):
        key = _source_key(plan, "runs")
        why = "run.dir and its checkpoints must be on storage every node shares and that outlives the job"
        out.append(Problem(key, None, why, f"set {key}={_source_example(plan, 'runs')}"))
    for kind, (_, mount) in mounts(plan).items():
        if not posixpath.isabs(mount):
            key = f"{_prefix(plan)}.{kind}_mount"
            fixed = posixpath.normpath(posixpath.join("/", mount))
            out.append(Problem(key, mount, "must be an absolute path on the nodes", f"set {key}={fixed}"))
    return out


def _run_dir_problems(plan: RunPlan, found: dict[str, str]) -> list[Problem]:
    if "runs" not in found or _inside(plan.config.run.dir, found["runs"]):
        return []
    mount = found["runs"]
    return [
        Problem(
            "run.dir",
            plan.config.run.dir,
            f"is not on the runs volume, which is mounted at {_prefix(plan)}.runs_mount={mount}",
            f"set run.dir={posixpath.join(mount, job_name(plan))}",
        )
    ]


def _cache_problems(plan: RunPlan, found: dict[str, str]) -> list[Problem]:
    """A multi-node run prepares its data once, on a mount every node reads."""
    cache_dir = plan.config.data.cache_dir
    if plan.config.cluster.nodes <= 1 or any(_inside(cache_dir, m) for m in found.values()):
        return []
    if found:
        shared = found.get("data", found.get("runs", ""))
        fix = f"set data.cache_dir={posixpath.join(shared, 'cache')} (a folder on a mounted volume or bucket)"
    else:
        key, mount = _source_key(plan, "data"), _data_mount(plan)
        fix = f"set {key}={_source_example(plan, 'data')} data.cache_dir={posixpath.join(mount, 'cache')}"
    why = "rank 0 prepares the data there and the other nodes read it, so it must be on a shared mount"
    return [Problem("data.cache_dir", cache_dir, why, fix)]


def _data_mount(plan: RunPlan) -> str:
    """Where the data volume or bucket is mounted once it is set."""
    c = plan.config.cluster
    mount = c.kubernetes.data_mount if c.launcher == Launcher.KUBERNETES else c.skypilot.data_mount
    return posixpath.normpath(posixpath.join("/", mount))


def _elastic_problems(plan: RunPlan) -> list[Problem]:
    """An elastic plan runs where the platform has a mechanism for it (docs/launch.md)."""
    c = plan.config.cluster
    if not is_elastic(plan.config) or c.launcher == Launcher.SKYPILOT:
        return []
    kind = c.kubernetes.kind
    why = (
        (
            "a TrainJob takes its node count and torchrun settings from its runtime, and Kubeflow Trainer's torch policy has no "
            "elastic range (the v1alpha1 API as of Trainer 2.3)"
        )
        if kind == KubernetesKind.TRAINJOB
        else "a JobSet runs a fixed number of pods and restarts all of them together (failurePolicy), so no smaller world ever forms"
    )
    return [
        Problem(
            "cluster.min_nodes",
            c.min_nodes,
            f"elastic training cannot run as a {kind}: {why}",
            "set cluster.min_nodes=null (cluster.max_restarts still restarts the job from its newest checkpoint), or use "
            "cluster.launcher=skypilot or slurm",
        )
    ]


def check_platform(plan: RunPlan) -> None:
    problems = platform_problems(plan)
    if problems:
        raise UserError(problems, title=f"the plan cannot be written for {plan.config.cluster.launcher}")


def plan_text(plan: RunPlan) -> str:
    """plan.json's content, compact: the value of ``LLMFORGE_PLAN``."""
    return json.dumps(plan.to_dict(), separators=(",", ":"))


def node_script(plan: RunPlan, *, torchrun: list[str], prelude: list[str] | None = None) -> str:
    """The shell script every node runs: write plan.json from ``$LLMFORGE_PLAN`` into run.dir
    (atomically: every node writes the same text), then torchrun the worker. ``torchrun``
    holds torchrun's options, with shell variables (``$JOB_COMPLETION_INDEX``) left to expand."""
    run_dir = posixpath.normpath(plan.config.run.dir)
    plan_file = posixpath.join(run_dir, "plan.json")
    q = shlex.quote
    worker = ["-m", "llmforge.launch.worker", "--plan", plan_file, RESUME_NEWEST]
    restart = ["export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] if plan.config.cluster.max_restarts > 0 else []
    lines = [
        "set -euo pipefail",
        *(prelude or []),
        f"mkdir -p {q(run_dir)}",
        f'printenv {PLAN_ENV} > {q(plan_file)}."$HOSTNAME"',
        f'mv -f {q(plan_file)}."$HOSTNAME" {q(plan_file)}',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        *restart,
        "exec python -m torch.distributed.run " + " ".join([*torchrun, *(q(a) for a in worker)]),
    ]
    return "\n".join(lines) + "\n"


def to_yaml(manifest: dict) -> str:
    """A manifest as YAML, multi-line strings (the node script) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    Dumper.add_multi_representer(str, text)  # str subclasses too: the choice keys (llmforge.config.choices)
    return yaml.dump(manifest, Dumper=Dumper, sort_keys=False, width=200)
