"""Plan -> processes: checks before a run, then training in this process, through
torchrun (one process per rank, on one node or several) or as a SLURM script.

``run``: ``launch(plan, ...)``, what every training command hands its plan to;
``torchrun`` and ``slurm``: the command lines; ``worker``: what torchrun starts on
each rank; ``watch``: ranks that die with their launcher and the failure report;
``guard``: the optional check that collectives get tensors on the rank's device.
"""

from llmforge.launch.run import launch

__all__ = ["launch"]
