"""CPU offload in the estimate: device memory without the offloaded states, host memory per
node, copies and the CPU optimizer step; the search proposes offload only where nothing else fits."""

from __future__ import annotations

import pytest

from llmforge.config.compose import compose
from llmforge.estimate.core import estimate_plan
from llmforge.estimate.search import search_plan
from llmforge.hardware import GIB, get_profile, parse_profile
from llmforge.plan import RunPlan

ONE_H100 = [
    "recipe=llama-8b",
    "cluster=h100-node",
    "cluster.nodes=1",
    "cluster.devices_per_node=1",
    "parallel=single",
    "parallel.zero=3",
    "parallel.recompute=full",
    "train.micro_batch_size=1",
]


def est(*overrides: str):
    return estimate_plan(RunPlan.build(compose(list(overrides))))


def test_llama_8b_fits_one_h100_only_with_its_states_offloaded():
    on_device, offloaded = est(*ONE_H100), est(*ONE_H100, "parallel.offload=states")
    assert not on_device.fits and on_device.worst.total > 130 * GIB
    assert offloaded.fits and offloaded.worst.total < 20 * GIB
    w = offloaded.worst
    assert w.weights == w.grads == w.optimizer == 0  # ZeRO 3: gathered block by block, gradients copied down per block
    params = offloaded.params_total
    assert offloaded.host.states_bytes == 16 * params  # fp32 weight, gradient, two moments
    assert offloaded.host.node_bytes == offloaded.host.states_bytes  # one device per node
    assert offloaded.parts["optimizer"] == 0 and offloaded.parts["cpu_optimizer"] > 0
    # ZeRO 3 copies the fp32 shard up for every forward and backward of each of the 512 microbatches
    assert offloaded.host.copy_s == pytest.approx(2 * 512 * 4 * params / get_profile("h100-80gb").host_link_bandwidth)


def test_zero1_offload_keeps_the_compute_copy_and_copies_once_per_step():
    z1 = est(*ONE_H100, "parallel.zero=1", "parallel.offload=states")
    params = z1.params_total
    assert z1.worst.weights == 2 * params and z1.worst.grads == 4 * params  # bf16 compute copy, whole gradients in the fp32 reduce dtype
    assert z1.host.copy_s == pytest.approx(4 * params / get_profile("h100-80gb").host_link_bandwidth)
    assert z1.host.exposed_copy_s < 1e-3 < z1.host.copy_s  # compute hides all but the first block's share


def test_activation_offload_keeps_two_blocks_of_activations():
    base = est(*ONE_H100, "parallel.offload=states", "parallel.recompute=none", "train.micro_batch_size=1")
    moved = est(*ONE_H100, "parallel.offload=states", "parallel.recompute=none", "parallel.offload_activations=true")
    assert moved.worst.activations == pytest.approx(2 * base.worst.activations / 32)  # llama-8b: 32 blocks
    assert moved.host.activations_bytes == pytest.approx(base.worst.activations)


def test_host_memory_is_checked_against_the_profile(tmp_path):
    small = tmp_path / "small-host.yaml"
    small.write_text(
        "name: small-host\nmemory_gib: 80\npeak_tflops: {fp32: 67, tf32: 494.7, bf16: 989.4, fp16: 989.4}\n"
        "memory_bandwidth_gbs: 3350\nintra_node_gbs: 450\ninter_node_gbs: 50\ndevices_per_node: 8\nhost_memory_gib: 64\n"
    )
    e = est(*ONE_H100, f"cluster.accelerator={small}", "parallel.offload=states")
    assert e.worst.total < e.job.profile.memory_bytes and not e.fits and not e.host.fits


def test_profiles_give_host_defaults():
    h100 = get_profile("h100-80gb")
    assert (h100.host_memory_bytes, h100.host_link_bandwidth, h100.host_memory_bandwidth) == (2048 * GIB, 50e9, 600e9)
    bare = parse_profile(
        {
            "name": "x",
            "memory_gib": 10,
            "peak_tflops": {"fp32": 1, "tf32": 1, "bf16": 1, "fp16": 1},
            "memory_bandwidth_gbs": 1,
            "intra_node_gbs": 1,
            "inter_node_gbs": 1,
            "devices_per_node": 4,
        }
    )
    assert bare.host_memory_bytes == 2 * 10 * GIB * 4


def test_search_offloads_only_where_nothing_fits_on_the_devices():
    alone = search_plan(RunPlan.build(compose(ONE_H100)), top=3)
    assert alone.offloaded and alone.ranked and all(e.layout.offload == "states" and e.fits for e in alone.ranked)
    eight = search_plan(RunPlan.build(compose(["recipe=llama-8b", "cluster=h100-node", "cluster.nodes=1"])), top=3)
    assert not eight.offloaded and all(e.layout.offload == "none" for e in eight.ranked)
