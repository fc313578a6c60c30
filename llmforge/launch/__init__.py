"""Plan -> processes: checks before a run, then training in this process, through
torchrun (one process per rank, on one node or several), as a SLURM script, or as a
Kubernetes or SkyPilot job.

``run``: ``launch(plan, ...)``, what every training command hands its plan to;
``checks``: what is refused before anything starts; ``local``: one rank in this
process; ``torchrun`` and ``slurm``: the command lines;
``kubernetes`` (TrainJob, JobSet), ``skypilot`` and what they share, ``platform``: the
manifests and their submission; ``netcheck``: the pre-flight network check;
``worker``: what torchrun starts on each rank (torchrun's agent, the rank watch and
the failure report are ``llmforge.processes``, shared with ``llmforge calibrate``); ``guard``: the optional check that collectives get
tensors on the rank's device (``LLMFORGE_CHECK_COLLECTIVES``).
"""

from llmforge.launch.run import launch

__all__ = ["launch"]
