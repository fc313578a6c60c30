"""Elastic training: a run that goes on with fewer nodes (``cluster.min_nodes``).

torchrun runs with ``--nnodes=MIN:MAX``. When a node is lost, the surviving agents
restart their workers (``cluster.max_restarts`` counts it) at the smaller world; each
rank then re-derives the plan for the world it finds (``RunPlan.build(config,
world=...)``): ``parallel.dp: auto`` over the new world, the same global batch (the
microbatches per step follow), resharded from the newest complete checkpoint, the data
stream at its global sample position. ``check_elastic`` makes sure, before launch,
that every node count of the range can run the plan.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses

from llmforge.config.schema import RunConfig
from llmforge.errors import Problem
from llmforge.layout_fixes import global_batch_fix
from llmforge.layout_rules import check_batch, check_ep, check_hsdp, check_world, ints


def is_elastic(config: RunConfig) -> bool:
    """Whether the run may go on with fewer nodes than ``cluster.nodes``."""
    c = config.cluster
    return c.min_nodes is not None and ints(c.min_nodes, c.nodes) and c.min_nodes < c.nodes


def at_nodes(config: RunConfig, nodes: int) -> RunConfig:
    """``config`` as it runs on ``nodes`` nodes of its elastic range."""
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, nodes=nodes, min_nodes=None))


def check_elastic(config: RunConfig) -> list[Problem]:
    """An elastic plan sizes its layout from the devices, restarts, and runs on every node count of its range."""
    c, p = config.cluster, config.parallel
    if c.min_nodes is None:
        return []
    if not ints(c.min_nodes, c.nodes) or not 1 <= c.min_nodes <= c.nodes:
        return [
            Problem(
                "cluster.min_nodes",
                c.min_nodes,
                f"must be between 1 and cluster.nodes={c.nodes}",
                "set it to the fewest nodes the run may go on with, or null",
            )
        ]
    if c.min_nodes == c.nodes:
        return []
    out = _settings(config)
    if out or not ints(p.tp, p.pp, p.cp, p.ep) or min(p.tp, p.pp, p.cp, p.ep) < 1:
        return out
    span = f"{c.min_nodes}-{c.nodes}"
    bad_batch = []
    for nodes in range(c.min_nodes, c.nodes):
        smaller = at_nodes(config, nodes)
        if check_batch(smaller):
            bad_batch.append(nodes)
        for problem in check_world(smaller) + check_ep(smaller) + check_hsdp(smaller):
            out.append(
                Problem(
                    problem.key,
                    problem.value,
                    f"with {nodes} node(s) of the elastic range {span}: {problem.rule}",
                    f"{problem.fix}, or raise cluster.min_nodes",
                )
            )
    if bad_batch:
        out.append(_batch_problem(config, bad_batch))
    return out


def _settings(config: RunConfig) -> list[Problem]:
    c, out = config.cluster, []
    if c.devices_per_node is None:
        out.append(
            Problem(
                "cluster.devices_per_node",
                None,
                "an elastic plan sizes its world from the nodes it gets (nodes x devices_per_node)",
                "set cluster.devices_per_node (the ranks each node starts)",
            )
        )
    if config.parallel.dp != "auto":
        out.append(
            Problem(
                "parallel.dp", config.parallel.dp, "an elastic plan's data-parallel size follows the world it gets", "set parallel.dp=auto"
            )
        )
    if not ints(c.max_restarts) or c.max_restarts < 1:
        out.append(
            Problem(
                "cluster.max_restarts",
                c.max_restarts,
                "a lost node reaches the survivors as a failed attempt, which torchrun restarts only with restarts left",
                "set cluster.max_restarts=3 (or more)",
            )
        )
    if not ints(c.elastic_wait_s) or c.elastic_wait_s < 1:
        out.append(Problem("cluster.elastic_wait_s", c.elastic_wait_s, "must be a positive number of seconds", "use e.g. 30"))
    return out


def _batch_problem(config: RunConfig, nodes: list[int]) -> Problem:
    """The global batch does not split over some node counts: the nearest batch that does on all of them."""
    c, t = config.cluster, config.train
    batch, multiple = global_batch_fix(config)
    counts = ", ".join(str(n) for n in nodes)
    return Problem(
        "train.global_batch_size",
        t.global_batch_size,
        f"does not split into whole microbatches (micro_batch_size x dp) or fill the pipeline with {counts} node(s) of the elastic range "
        f"{c.min_nodes}-{c.nodes}",
        f"set train.global_batch_size={batch} (a multiple of {multiple}), or raise cluster.min_nodes",
    )


def world_problems(config: RunConfig, world: int) -> list[Problem]:
    """A world torchrun started that the plan does not allow (outside its elastic range)."""
    c = config.cluster
    if c.devices_per_node is not None and world == c.nodes * c.devices_per_node:
        return []
    if not is_elastic(config) or world % c.devices_per_node or not c.min_nodes <= world // c.devices_per_node <= c.nodes:
        return [
            Problem(
                "cluster.nodes",
                c.nodes,
                f"torchrun started {world} ranks, which this plan's node range does not allow",
                "start the plan's nodes, or set cluster.min_nodes for an elastic run",
            )
        ]
    return []


def describe_change(before, after, *, start: bool = False) -> str:
    """``before`` -> ``after`` (RunPlans of one run on two worlds), in words; ``start``: ``before``
    is the plan as launched and the run starts on fewer nodes."""
    c = after.config.cluster
    what = (
        f"{after.world_size} of the planned {before.world_size} ranks came"
        if start
        else f"the world changed from {before.world_size} to {after.world_size} ranks"
    )
    return (
        f"{what} "
        f"({_nodes(before)} -> {_nodes(after)} of {c.nodes} nodes): layout {before.layout} -> {after.layout}, "
        f"{before.microbatches} -> {after.microbatches} microbatches per data-parallel rank, "
        f"global batch {after.config.train.global_batch_size} sequences as before"
    )


def _nodes(plan) -> int:
    per_node = plan.config.cluster.devices_per_node
    return plan.world_size // per_node if per_node else plan.config.cluster.nodes


def smallest(plan):
    """An elastic plan on the fewest nodes of its range (the plan itself otherwise)."""
    c = plan.config.cluster
    return plan.at_world(c.min_nodes * c.devices_per_node) if is_elastic(plan.config) else plan
