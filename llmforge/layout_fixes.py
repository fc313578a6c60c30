"""The values a layout problem's fix suggests, computed from the rule that checks them, so
that pasting a suggested ``key=value`` makes that rule pass (llmforge.layout_rules,
llmforge.elastic).

This module imports no torch.
"""

from __future__ import annotations

import math

from llmforge.config.schema import RunConfig
from llmforge.layout import FILLING_SCHEDULES, MULTI_CHUNK_SCHEDULES


def node_counts(config: RunConfig) -> range:
    """The node counts a plan runs on: its elastic range (``cluster.min_nodes``) or ``cluster.nodes``."""
    c = config.cluster
    elastic = c.min_nodes is not None and c.devices_per_node is not None and 1 <= c.min_nodes < c.nodes
    return range(c.min_nodes if elastic and c.min_nodes is not None else c.nodes, c.nodes + 1)


def _dp_at(config: RunConfig, nodes: int) -> int:
    p, c = config.parallel, config.cluster
    if p.dp != "auto":
        return max(int(p.dp), 1)
    if c.devices_per_node is None:
        return 1
    return max(nodes * c.devices_per_node // (p.tp * p.pp * p.cp), 1)


def global_batch_fix(config: RunConfig) -> tuple[int, int]:
    """(a global batch that splits into whole microbatches and fills the pipeline on every node
    count of the plan, the multiple every such batch is): the current one rounded down to that
    multiple, or the least that fills the pipeline."""
    t, p = config.train, config.parallel
    multiple, least = 1, 1
    for nodes in node_counts(config):
        per_step = t.micro_batch_size * _dp_at(config, nodes)
        chunked = p.pp > 1 and p.pp_schedule in MULTI_CHUNK_SCHEDULES
        multiple = math.lcm(multiple, per_step * (p.pp if chunked else 1))
        if p.pp > 1 and p.pp_schedule in FILLING_SCHEDULES:
            least = max(least, p.pp * per_step)
    rounded = t.global_batch_size // multiple * multiple
    return max(rounded, -(-least // multiple) * multiple, multiple), multiple


def world_fix(config: RunConfig) -> str:
    """The overrides (alternatives joined by ' or ') that make dp x tp x pp x cp fill nodes x
    devices_per_node when a fixed parallel.dp does not."""
    p, c = config.parallel, config.cluster
    model_parallel = p.tp * p.pp * p.cp
    per_node = c.devices_per_node or 1
    need = int(p.dp) * model_parallel
    options = []
    if (c.nodes * per_node) % model_parallel == 0:
        options.append("parallel.dp=auto")
    if need % c.nodes == 0 and need // c.nodes >= p.tp:
        options.append(f"cluster.devices_per_node={need // c.nodes}")
    if need % per_node == 0 and per_node >= p.tp:
        options.append(f"cluster.nodes={need // per_node}")
    if len(options) < 2:
        options.append(f"cluster.nodes=1 cluster.devices_per_node={need}")
    return "set " + " or ".join(options)
