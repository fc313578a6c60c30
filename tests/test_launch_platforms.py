"""Kubernetes (TrainJob, JobSet) and SkyPilot launches: the manifests of a 4-node x 8-GPU plan
validate with the platforms' own SDK models and schema (no cluster), and the script every
node runs gives torchrun the right rendezvous from the platform's variables.

tests/data/skypilot-0.14.1-schemas.json holds SkyPilot's own task, resources and storage schemas,
written from a throwaway environment (SkyPilot pulls ~60 packages, too many for the test extra):
``pip install skypilot==0.14.1`` then ``json.dump({"task": get_task_schema(), "resources":
get_resources_schema(), "storage": get_storage_schema()}, ...)`` from ``sky.utils.schemas``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.errors import UserError
from llmforge.launch.kubernetes import jobset, trainjob
from llmforge.launch.platform import PLAN_ENV, check_platform
from llmforge.launch.skypilot import manifest as skypilot_task
from llmforge.testing.harness import tiny_plan

SKYPILOT_SCHEMAS = Path(__file__).parent / "data" / "skypilot-0.14.1-schemas.json"


def plan_for(launcher: str, tmp_path: Path, *extra: str):
    """4 nodes x 8 H100, with run.dir and the data cache on the platform's shared mounts (here: tmp_path)."""
    mounts = {
        "kubernetes": [
            "cluster.kubernetes.runs_claim=runs",
            "cluster.kubernetes.data_claim=data",
            f"cluster.kubernetes.runs_mount={tmp_path}",
            f"cluster.kubernetes.data_mount={tmp_path / 'data'}",
        ],
        "skypilot": [
            "cluster.skypilot.runs_bucket=s3://bucket/runs",
            "cluster.skypilot.data_bucket=gs://bucket/data",
            f"cluster.skypilot.runs_mount={tmp_path}",
            f"cluster.skypilot.data_mount={tmp_path / 'data'}",
        ],
    }[launcher]
    return tiny_plan(
        [
            f"cluster.launcher={launcher}",
            "cluster.accelerator=h100-80gb",
            "cluster.nodes=4",
            "cluster.devices_per_node=8",
            "parallel.dp=auto",
            "train.global_batch_size=32",
            "train.micro_batch_size=1",
            "run.name=Pretrain_Run",
            "cluster.image=ghcr.io/example/llmforge:1",
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'data' / 'cache'}",
            *mounts,
            *extra,
        ]
    )


def round_trips(model, manifest: dict) -> None:
    """The SDK model parses the manifest and gives back every field (a field it does not know would be dropped)."""
    parsed = model.from_dict(manifest)
    assert parsed.to_dict() == manifest


def torchrun_args(script: str, env: dict, tmp_path: Path):
    """Run a node's script with the platform's variables; a stand-in `python` records the
    torchrun command line, which torchrun's own parser then reads (with the same environment)."""
    from torch.distributed.run import parse_args

    bin_dir, out = tmp_path / "bin", tmp_path / "argv.json"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(
        f'#!/bin/sh\nexec {json.dumps(sys.executable)} -c \'import json,sys; json.dump(sys.argv[1:], open("{out}", "w"))\' "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOSTNAME": "node-x", **env}
    subprocess.run(["bash", "-c", script], env=full, check=True, timeout=30)
    argv = json.loads(out.read_text())
    assert argv[:2] == ["-m", "torch.distributed.run"]
    old = dict(os.environ)
    os.environ.update(env)  # torchrun reads PET_* options from the environment
    try:
        return parse_args(argv[2:])
    finally:
        os.environ.clear()
        os.environ.update(old)


def assert_rendezvous(args, *, master: str, port: int, node_rank: int) -> None:
    assert (args.nnodes, str(args.nproc_per_node), args.node_rank) == ("4", "8", node_rank)
    assert (args.master_addr, args.master_port) == (master, port)
    assert args.module and args.training_script == "llmforge.launch.worker"


def test_trainjob_validates_and_takes_its_rendezvous_from_the_runtime(tmp_path):
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    plan = plan_for("kubernetes", tmp_path)
    job = trainjob(plan)
    round_trips(TrainerV1alpha1TrainJob, job)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob", "pretrain-run")
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]) == (4, 8, "8")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # What the torch runtime sets on node 2 of the TrainJob's 4 (its JobSet's leader pod is the master).
    pet = {
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "8",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "pretrain-run-node-0-0.pretrain-run",
        "PET_MASTER_PORT": "29400",
        PLAN_ENV: trainer["env"][0]["value"],
    }
    args = torchrun_args(trainer["command"][2], pet, tmp_path)
    assert_rendezvous(args, master="pretrain-run-node-0-0.pretrain-run", port=29400, node_rank=2)
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["derived"]["world_size"] == 32


def test_jobset_validates_and_meets_at_the_leader_pod(tmp_path):
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet
    from kubernetes.client import ApiClient

    plan = plan_for("kubernetes", tmp_path, "cluster.kubernetes.kind=jobset", "cluster.max_restarts=3")
    js = jobset(plan)
    round_trips(JobsetV1alpha2JobSet, js)
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    client = ApiClient()

    class Response:
        data = json.dumps(job["template"])

    pod = client.deserialize(Response, "V1PodTemplateSpec")  # the kubernetes client's own model of a pod template
    assert client.sanitize_for_serialization(pod) == job["template"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3} and js["spec"]["network"]["enableDNSHostnames"]
    container = job["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {"JOB_COMPLETION_INDEX": "3", PLAN_ENV: container["env"][0]["value"]}
    args = torchrun_args(container["command"][2], env, tmp_path)
    assert_rendezvous(args, master="pretrain-run-node-0-0.pretrain-run", port=29500, node_rank=3)


def skypilot_validator(schema: dict):
    """SkyPilot's validator (sky.utils.validator): JSON Schema draft 7 with its two enum keywords."""
    import jsonschema

    def enum(*, fold):
        def check(validator, enums, instance, schema):
            if (instance.lower() if fold else instance) not in [e.lower() if fold else e for e in enums]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

        return check

    keywords = {"case_insensitive_enum": enum(fold=True), "case_sensitive_enum": enum(fold=False)}
    return jsonschema.validators.extend(jsonschema.Draft7Validator, validators=keywords)(schema)


def test_skypilot_task_validates_against_skypilots_schema_and_ranks_by_its_variables(tmp_path):
    import jsonschema

    schemas = json.loads(SKYPILOT_SCHEMAS.read_text())  # sky.utils.schemas' task, resources and storage schemas (SkyPilot 0.14.1)
    plan = plan_for("skypilot", tmp_path, "cluster.max_restarts=2")
    task = skypilot_task(plan)
    skypilot_validator(schemas["task"]).validate(task)
    skypilot_validator(schemas["resources"]).validate(task["resources"])
    for mount in task["file_mounts"].values():
        skypilot_validator(schemas["storage"]).validate(mount)
    with pytest.raises(jsonschema.ValidationError):  # the schema does check: a misspelt mode is refused
        skypilot_validator(schemas["storage"]).validate({**mount, "mode": "MOUNTED"})
    assert (task["num_nodes"], task["resources"]["accelerators"]) == (4, "H100:8")
    assert task["resources"]["job_recovery"] == {"max_restarts_on_errors": 2}  # restarts: a managed job
    env = {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8\n10.0.0.9\n10.0.0.10",
        "SKYPILOT_NUM_NODES": "4",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        PLAN_ENV: task["envs"][PLAN_ENV],
    }
    args = torchrun_args(task["run"], env, tmp_path)
    assert_rendezvous(args, master="10.0.0.7", port=29500, node_rank=1)


def test_skypilot_runs_an_elastic_plan_as_a_managed_job_on_its_node_range(tmp_path):
    plan = plan_for("skypilot", tmp_path, "cluster.min_nodes=2", "cluster.max_restarts=3", "train.global_batch_size=96")
    task = skypilot_task(plan)
    assert task["resources"]["job_recovery"] == {"max_restarts_on_errors": 3}
    env = {
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "10.0.0.7",
        "SKYPILOT_NUM_NODES": "4",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYPILOT_TASK_ID": "sky-1",
        PLAN_ENV: task["envs"][PLAN_ENV],
    }
    args = torchrun_args(task["run"], env, tmp_path)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.max_restarts) == (
        "2:4",
        "c10d",
        "10.0.0.7:29500",
        "sky-1",
        3,
    )


@pytest.mark.parametrize("kind", ["trainjob", "jobset"])
def test_kubernetes_refuses_an_elastic_plan_with_the_reason(tmp_path, kind):
    plan = plan_for(
        "kubernetes",
        tmp_path,
        f"cluster.kubernetes.kind={kind}",
        "cluster.min_nodes=2",
        "cluster.max_restarts=3",
        "train.global_batch_size=96",
    )
    with pytest.raises(UserError) as err:
        check_platform(plan)
    assert "cluster.min_nodes" in err.value.message() and f"cannot run as a {kind}" in err.value.message()


def test_a_platform_plan_needs_its_image_and_shared_storage(tmp_path):
    plan = tiny_plan(
        ["cluster.launcher=kubernetes", "cluster.nodes=2", "cluster.devices_per_node=1", "parallel.dp=2", f"run.dir={tmp_path}/run"]
    )
    with pytest.raises(UserError) as err:
        check_platform(plan)
    text = err.value.message()
    for key in ("cluster.image", "cluster.kubernetes.runs_claim", "data.cache_dir"):
        assert key in text


def test_dry_run_prints_the_manifest_and_submitting_without_a_cluster_says_what_to_configure(tmp_path, monkeypatch):
    import yaml

    args = [
        "pretrain",
        "cluster.launcher=kubernetes",
        "cluster.kubernetes.kind=jobset",
        "cluster.image=img:1",
        "cluster.kubernetes.runs_claim=runs",
        "run.dir=/runs/tiny",
        "logging=quiet",
    ]
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert yaml.safe_load(dry.stdout)["kind"] == "JobSet"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    real = CliRunner().invoke(app, args)
    assert real.exit_code == 2 and "no Kubernetes cluster is configured" in real.output
    assert not Path("/runs/tiny").exists()


@pytest.mark.slow
def test_a_restarted_platform_job_continues_from_the_newest_checkpoint(tmp_path, small_data):
    """What every node of a platform job runs (worker --resume-newest) after a restart: the run
    goes on from run.dir's newest complete checkpoint with the losses of an uninterrupted run."""
    import shutil

    run_dir = tmp_path / "run"
    args = [*small_data, "train.steps=4", "checkpoint.interval=2", "train.log_interval=1", "logging=quiet", f"run.dir={run_dir}"]
    assert CliRunner().invoke(app, ["pretrain", *args]).exit_code == 0
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    shutil.rmtree(run_dir / "checkpoints" / "step_4")  # the job was lost after its step-2 checkpoint
    worker = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "llmforge.launch.worker",
        "--plan",
        str(run_dir / "plan.json"),
        "--resume-newest",
    ]
    done = subprocess.run(worker, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'step_2'}" in done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    again = {r["step"]: r["loss"] for r in records}
    assert again[4] == pytest.approx(losses[4], rel=1e-6) and (run_dir / "checkpoints" / "step_4").is_dir()


def test_launching_on_skypilot_without_it_says_what_to_install(tmp_path, monkeypatch):
    from rich.console import Console

    from llmforge.launch import skypilot

    plan = plan_for("skypilot", tmp_path)
    monkeypatch.setattr(skypilot.shutil, "which", lambda name: None)
    with pytest.raises(UserError) as err:
        skypilot.submit(plan, skypilot_task(plan), console=Console(quiet=True))
    assert "pip install 'skypilot[aws]'" in err.value.message() and "sky check" in err.value.message()
