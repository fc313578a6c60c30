"""CPU offload on one rank, and its plan rules. The offloaded layouts of several ranks
(dp2 ZeRO 1/2/3, cp2, ep2, pp2, dp2 x tp2, dp2 x pp2, HSDP) are in tests/test_parallel.py's
matrix, held to the one-process numbers like every other layout.

FSDP2's CPUOffloadPolicy(pin_memory=False) runs on a gloo CPU mesh, so these check the
wiring and the arithmetic of parallel.offload=states (sharded fp32 states stepped by
torch's fused CPU AdamW, the norm summed on the host) and parallel.offload_activations
(saved activations through the host-copy hooks). The copies, pinning and overlap on a
GPU are tests/gpu/test_offload_gpu.py."""

from __future__ import annotations

import pytest
from test_parallel import max_rel, run_group

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.launch.run import runs_here
from llmforge.plan import RunPlan
from llmforge.testing.harness import tiny_plan, train_layout

STATES = ["parallel.offload=states"]
ACTS = ["parallel.offload_activations=true"]
WORLD1 = {
    "single_zero3": STATES + ["parallel.zero=3"],
    "single_zero1_activations": STATES + ACTS + ["parallel.zero=1", "parallel.recompute=full"],
}


@pytest.mark.slow
def test_one_rank_offload_matches_training_on_the_device(tmp_path):
    """The one-GPU target's path: FSDP2 over a mesh of one, states on the host."""
    got = run_group(tmp_path, nproc=1, layouts=WORLD1, mesh_of_one=True)
    ref = train_layout(tiny_plan([]))
    for layout in WORLD1:
        # the states are FSDP2-offloaded (on a CPU the numbers alone cannot tell): every parameter
        # group has CPUOffloadPolicy, every sharded parameter is kept in host memory, AdamW is fused
        facts = got[layout]["offload"]
        assert facts["fsdp_policies"] == ["CPUOffloadPolicy"] and facts["params_on_host"] and all(facts["params_on_host"]), (layout, facts)
        assert facts["fused_adamw"], layout
        # fused CPU AdamW against the one process's for-loop AdamW: the same update up to rounding
        assert len(got[layout]["losses"]) == 5
        assert max_rel(got[layout]["losses"], ref.losses) < 1e-5, layout
        assert max_rel(got[layout]["grad_norms"], ref.grad_norms) < 1e-5, layout
        for name, value in ref.params.items():
            rel = float((got[layout]["params"][name] - value).norm() / value.norm())
            assert rel < 1e-5, f"{layout} {name}: relative difference {rel:.2e}"


def test_activation_offload_in_one_process_matches():
    ref = train_layout(tiny_plan([]))
    got = train_layout(tiny_plan(ACTS))
    assert got.losses == ref.losses and got.grad_norms == ref.grad_norms
    # the hooks were in place: activations were copied to host memory in forward and read back in backward
    copied, back = got.offload["activations_to_host"], got.offload["activations_back"]
    assert copied > 0 and back > 0, got.offload
    assert ref.offload["activations_to_host"] == 0


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        RunPlan.build(compose(list(overrides)))
    return info.value.message()


def test_offload_is_refused_where_the_backend_cannot_run_it():
    assert "parallel.zero=1" in problems_of("parallel.offload=states")  # ZeRO 0: no FSDP2
    assert "dp x cp = 1 on several ranks" in problems_of("parallel=tp2", "parallel.zero=3", "parallel.offload=states")
    assert "precision.fp8" in problems_of("parallel.zero=3", "parallel.offload=states", "precision.fp8=true", "precision.fp8_emulate=true")
    assert "train.compile=false" in problems_of("parallel.offload_activations=true", "train.compile=true")
    assert "use one of: none, states" in problems_of("parallel.offload=all")


def test_a_one_rank_offloaded_plan_goes_through_torchrun():
    """FSDP2 needs a process group: the plan is not trained inside the llmforge process."""
    assert runs_here(RunPlan.build(compose(["parallel.zero=3"])))
    assert not runs_here(RunPlan.build(compose(["parallel.zero=3", "parallel.offload=states"])))
