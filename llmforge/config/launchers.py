"""Typed keys of the platform launchers: ``cluster.kubernetes`` (a Kubeflow Trainer v2
TrainJob or a JobSet) and ``cluster.skypilot`` (a SkyPilot task). Used by
``llmforge.config.schema.ClusterConfig``; this module imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import KubernetesKind, Launcher
from llmforge.config.fields import knob

#: Launchers that write a job for a platform to run elsewhere (nothing runs or is written here).
PLATFORM_LAUNCHERS = (Launcher.KUBERNETES, Launcher.SKYPILOT)


@dataclass
class KubernetesConfig:
    kind: KubernetesKind = knob(
        KubernetesKind.TRAINJOB,
        help="trainjob: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on the runtime cluster.kubernetes.runtime; "
        "jobset: a JobSet (jobset.x-k8s.io/v1alpha2) that needs only the JobSet controller.",
    )
    namespace: str = knob("default", help="Namespace the job is created in.")
    runtime: str = knob("torch-distributed", help="trainjob only: the ClusterTrainingRuntime (a torch runtime) the TrainJob references.")
    data_claim: str | None = knob(
        None,
        help="A PersistentVolumeClaim mounted at cluster.kubernetes.data_mount on every node (data.cache_dir, data.path); null = none.",
    )
    data_mount: str = knob("/data", help="Where cluster.kubernetes.data_claim is mounted in the pods.")
    runs_claim: str | None = knob(
        None,
        help="A PersistentVolumeClaim (ReadWriteMany) mounted at cluster.kubernetes.runs_mount on every node: run.dir and its "
        "checkpoints must be there. Required.",
    )
    runs_mount: str = knob("/runs", help="Where cluster.kubernetes.runs_claim is mounted in the pods; run.dir must be inside it.")
    port: int = knob(
        29500, range="[1, 65535]", help="jobset only: the rendezvous port on the leader pod (a TrainJob's runtime sets its own)."
    )


@dataclass
class SkyPilotConfig:
    infra: str | None = knob(None, help="SkyPilot's resources.infra (aws, gcp, k8s, aws/us-east-1, ...); null = any enabled infra.")
    accelerators: str | None = knob(
        None, help="SkyPilot's accelerator name (H100, A100-80GB, ...); null = the one of cluster.accelerator's built-in profile."
    )
    use_spot: bool = knob(False, help="Run on spot/preemptible instances (launched as a managed job, which recovers from preemptions).")
    managed: bool | None = knob(
        None,
        help="Launch as a SkyPilot managed job (sky jobs launch), which relaunches the job after failures and preemptions "
        "(resources.job_recovery); null = when cluster.max_restarts > 0, cluster.min_nodes is set or skypilot.use_spot.",
    )
    setup: str | None = knob(
        None, help="Shell commands run once per node before the job (e.g. pip install llmforge) when cluster.image is null."
    )
    data_bucket: str | None = knob(
        None, help="A bucket URL (s3://, gs://, r2://, ...) mounted read-only at cluster.skypilot.data_mount on every node; null = none."
    )
    data_mount: str = knob("/data", help="Where cluster.skypilot.data_bucket is mounted.")
    runs_bucket: str | None = knob(
        None,
        help="A bucket URL mounted (MOUNT_CACHED) at cluster.skypilot.runs_mount on every node: run.dir and its checkpoints must be "
        "there. Required.",
    )
    runs_mount: str = knob("/runs", help="Where cluster.skypilot.runs_bucket is mounted; run.dir must be inside it.")
    port: int = knob(29500, range="[1, 65535]", help="The rendezvous port on the first node.")
