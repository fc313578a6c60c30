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


def platform_problems(plan: RunPlan) -> list[Problem]:
    """What a plan needs before it can be written for ``cluster.launcher`` (kubernetes or skypilot)."""
    c = plan.config.cluster
    launcher = c.launcher
    key = "cluster.kubernetes.runs_claim" if launcher == Launcher.KUBERNETES else "cluster.skypilot.runs_bucket"
    mount_key = key.rsplit(".", 1)[0] + ".runs_mount"
    out = []
    if launcher == Launcher.KUBERNETES and not c.image:
        out.append(
            Problem(
                "cluster.image",
                None,
                "the pods need a container image with llmforge and torch installed",
                "set cluster.image=REGISTRY/IMAGE:TAG",
            )
        )
    found = mounts(plan)
    if "runs" not in found:
        example = (
            "NAME (a ReadWriteMany PersistentVolumeClaim)" if launcher == Launcher.KUBERNETES else "s3://BUCKET/runs (or gs://, r2://, ...)"
        )
        out.append(
            Problem(
                key,
                None,
                "run.dir and its checkpoints must be on storage every node shares and that outlives the job",
                f"set {key}={example}",
            )
        )
    elif not _inside(plan.config.run.dir, found["runs"][1]):
        mount = found["runs"][1]
        out.append(
            Problem(
                "run.dir",
                plan.config.run.dir,
                f"is not on the runs volume, which is mounted at {mount_key}={mount}",
                f"set run.dir={posixpath.join(mount, job_name(plan))}",
            )
        )
    if c.nodes > 1 and not any(_inside(plan.config.data.cache_dir, m) for _, m in found.values()):
        out.append(
            Problem(
                "data.cache_dir",
                plan.config.data.cache_dir,
                "rank 0 prepares the data there and the other nodes read it, so it must be on a shared mount",
                f"set data.cache_dir={posixpath.join(found.get('data', found.get('runs', ('', '/data')))[1], 'cache')} (a folder on a "
                "mounted volume or bucket)",
            )
        )
    return out + _elastic_problems(plan)


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
