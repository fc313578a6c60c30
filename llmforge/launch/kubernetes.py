"""``cluster.launcher=kubernetes``: a Kubeflow Trainer v2 TrainJob, or a JobSet
(``cluster.kubernetes.kind``), and its submission through the ``kubernetes`` client.

Rendezvous. TrainJob: the torch runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` in every node's container
from ``trainer.numNodes`` and ``trainer.numProcPerNode``, and torchrun reads each
``--x-y`` option it is not given from ``PET_X_Y``: the command names none of them.
JobSet: the leader is the first pod of the replicated job, reachable at
``NAME-node-0-0.NAME`` (the JobSet's headless service), and each pod's node rank is its
Indexed Job's ``JOB_COMPLETION_INDEX``.
"""

from __future__ import annotations

from rich.console import Console

from llmforge.config.choices import KubernetesKind
from llmforge.errors import Problem, UserError
from llmforge.launch.platform import PLAN_ENV, job_name, mounts, node_script, plan_text
from llmforge.launch.torchrun import procs_per_node
from llmforge.plan import RunPlan

TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
#: The replicated job (and container) name: the torch runtimes' own name for their trainer nodes.
NODE = "node"
GPU_RESOURCE = "nvidia.com/gpu"
SUBMIT_HINT = "without it the job is created with the kubernetes Python client, as `kubectl create -f` would"


def manifest(plan: RunPlan) -> dict:
    return trainjob(plan) if plan.config.cluster.kubernetes.kind == KubernetesKind.TRAINJOB else jobset(plan)


def _metadata(plan: RunPlan) -> dict:
    return {
        "name": job_name(plan),
        "namespace": plan.config.cluster.kubernetes.namespace,
        "labels": {"app.kubernetes.io/created-by": "llmforge"},
    }


def _restarts(plan: RunPlan) -> list[str]:
    n = plan.config.cluster.max_restarts
    return [f"--max-restarts={n}"] if n > 0 else []


def _volumes(plan: RunPlan) -> tuple:
    """(pod volumes, container volume mounts): the data and runs claims, and a memory-backed
    /dev/shm (NCCL and the data loader need more than the container's 64 MiB default)."""
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounted = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for name, (claim, path) in mounts(plan).items():
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
        mounted.append({"name": name, "mountPath": path})
    return volumes, mounted


def _resources(plan: RunPlan) -> dict:
    if plan.config.cluster.accelerator == "cpu":
        return {}
    gpus = str(procs_per_node(plan))
    return {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}}


def trainjob(plan: RunPlan) -> dict:
    """A TrainJob on the ClusterTrainingRuntime ``cluster.kubernetes.runtime``; the volumes
    reach the runtime's ``node`` pods through a runtime patch."""
    c = plan.config.cluster
    volumes, mounted = _volumes(plan)
    script = node_script(plan, torchrun=["--monitor-interval=0.2", *_restarts(plan)])
    trainer = {
        "image": c.image,
        "command": ["bash", "-c", script],
        "env": [{"name": PLAN_ENV, "value": plan_text(plan)}],
        "numNodes": c.nodes,
        "numProcPerNode": procs_per_node(plan),
    }
    if _resources(plan):
        trainer["resourcesPerNode"] = _resources(plan)
    pod = {"spec": {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounted}]}}
    patch = {
        "manager": "llmforge",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{"name": NODE, "template": {"spec": {"template": pod}}}]}}},
    }
    return {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": _metadata(plan),
        "spec": {
            "runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime", "name": c.kubernetes.runtime},
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }


def leader_address(plan: RunPlan) -> str:
    """The first pod's DNS name in a JobSet: ``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``."""
    name = job_name(plan)
    return f"{name}-{NODE}-0-0.{name}"


def jobset(plan: RunPlan) -> dict:
    """A JobSet of one Indexed Job with a pod per node; cluster.max_restarts restarts the whole
    set (every pod then resumes from the newest checkpoint)."""
    c = plan.config.cluster
    name, port = job_name(plan), c.kubernetes.port
    volumes, mounted = _volumes(plan)
    rendezvous = [
        f"--nnodes={c.nodes}",
        f"--nproc-per-node={procs_per_node(plan)}",
        '--node-rank="$JOB_COMPLETION_INDEX"',
        f"--master-addr={leader_address(plan)}",
        f"--master-port={port}",
        "--monitor-interval=0.2",
    ]
    container = {
        "name": NODE,
        "image": c.image,
        "command": ["bash", "-c", node_script(plan, torchrun=rendezvous)],
        "env": [{"name": PLAN_ENV, "value": plan_text(plan)}],
        "ports": [{"containerPort": port, "name": "rendezvous", "protocol": "TCP"}],
        "volumeMounts": mounted,
    }
    if _resources(plan):
        container["resources"] = _resources(plan)
    job = {
        "parallelism": c.nodes,
        "completions": c.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container], "volumes": volumes}},
    }
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": _metadata(plan),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "failurePolicy": {"maxRestarts": c.max_restarts},
            "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": job}}],
        },
    }


def _client():
    """The kubernetes client, configured from KUBECONFIG/~/.kube/config or the pod's service
    account; a UserError saying what to install or configure otherwise."""
    try:
        import kubernetes
    except ImportError:
        raise UserError(
            [
                Problem(
                    "cluster.launcher",
                    "kubernetes",
                    "submitting needs the kubernetes Python client, which is not installed",
                    "pip install 'llmforge[kubernetes]' (or pip install kubernetes), or print the manifest with --dry-run and kubectl "
                    "create -f it",
                )
            ],
            title="cannot submit the job",
        ) from None
    try:
        kubernetes.config.load_kube_config()
    except Exception:  # noqa: BLE001 - no kubeconfig: try the in-cluster service account
        try:
            kubernetes.config.load_incluster_config()
        except Exception:  # noqa: BLE001
            raise UserError(
                [
                    Problem(
                        "cluster.launcher",
                        "kubernetes",
                        "no Kubernetes cluster is configured (no kubeconfig, and not inside a pod)",
                        "point KUBECONFIG (or ~/.kube/config) at the cluster, e.g. with your provider's get-credentials command, "
                        "or print the manifest with --dry-run",
                    )
                ],
                title="cannot submit the job",
            ) from None
    return kubernetes


def submit(plan: RunPlan, body: dict, *, console: Console) -> None:
    """Create the TrainJob or JobSet (a connect timeout of a few seconds: never a hang)."""
    kubernetes = _client()
    group, version = body["apiVersion"].split("/")
    plural = body["kind"].lower() + "s"
    namespace = body["metadata"]["namespace"]
    api = kubernetes.client.CustomObjectsApi()
    try:
        api.create_namespaced_custom_object(group, version, namespace, plural, body, _request_timeout=(5, 30))
    except kubernetes.client.ApiException as exc:
        fix = (
            (
                f"install {'Kubeflow Trainer v2' if body['kind'] == 'TrainJob' else 'the JobSet controller'} on the cluster, or choose "
                "the other "
                "cluster.kubernetes.kind"
            )
            if exc.status == 404
            else "see the message; --dry-run prints the manifest"
        )
        raise UserError(
            [
                Problem(
                    "cluster.kubernetes.kind",
                    plan.config.cluster.kubernetes.kind,
                    f"the cluster refused the {body['kind']}: {exc.status} {exc.reason}",
                    fix,
                )
            ],
            title="cannot submit the job",
        ) from None
    except Exception as exc:  # noqa: BLE001 - connection refused, timeout, DNS: the cluster is unreachable
        raise UserError(
            [
                Problem(
                    "cluster.launcher",
                    "kubernetes",
                    f"the cluster could not be reached ({type(exc).__name__})",
                    "check the kubeconfig's context (kubectl cluster-info) and the network",
                )
            ],
            title="cannot submit the job",
        ) from None
    name = body["metadata"]["name"]
    console.print(
        f"created {body['kind']} {namespace}/{name}; follow it with: kubectl -n {namespace} get {plural} {name}",
        markup=False,
        highlight=False,
    )
