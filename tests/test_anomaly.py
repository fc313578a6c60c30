"""Non-finite steps never reach the weights (train.anomaly): the drills of each policy on one
process, dp2 ZeRO-3, tp2 and pp2, each against a reference that skips the same batches by hand.

- skip: a NaN injected at step 3 on one rank gives the final weights of a run without step 3's update;
- rollback: a clean step 3, NaN at steps 4-5 (one skip allowed) rolls back to step_2 at step 5: the
  final weights of a run resumed from step_2 past batches 3-5, at half the learning rate;
- stop: NaN at step 4 ends the run at step 4 naming the step, with step_2 intact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmforge.testing.drill import run_drill
from llmforge.testing.harness import tiny_plan

STEPS = ["train.steps=7", "checkpoint.interval=2", "checkpoint.keep=5"]
LAYOUTS = {"dp2_zero3": (["parallel.dp=2", "parallel.zero=3"], "1", "nan-grad"), "tp2": (["parallel.tp=2"], "1", "nan-loss"),
           "pp2": (["parallel.pp=2"], "0", "nan-grad")}


def drills(layout: list, *, rank: str, kind: str, folder: Path) -> dict:
    """The five runs of one layout: each policy's drill and the references."""
    base = layout + STEPS
    return {
        "skip": {"overrides": base + ["train.anomaly=skip"], "fault": f"{rank}:3:{kind}"},
        "skip_ref": {"overrides": base, "skip": [3, 3]},
        "rollback": {"overrides": base + ["train.anomaly=rollback", "train.max_skipped_steps=1", "train.rollback_lr_factor=0.5"],
                     "fault": f"{rank}:4-5:{kind}", "checkpoints": str(folder / "rollback")},
        "rollback_ref": {"overrides": base, "skip": [3, 5], "lr_factor": 0.5},
        "stop": {"overrides": base + ["train.anomaly=stop"], "fault": f"{rank}:4:{kind}", "checkpoints": str(folder / "stop")},
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every layout's drills: the one-process ones here, the others in one 2-rank group."""
    tmp = tmp_path_factory.mktemp("anomaly")
    out = {}
    for name, spec in drills([], rank="0", kind="nan-loss", folder=tmp / "single").items():
        out[f"single/{name}"] = run_drill(tiny_plan(spec["overrides"]), spec, device=torch.device("cpu"))
    layouts = {f"{layout}/{name}": spec for layout, (overrides, rank, kind) in LAYOUTS.items()
               for name, spec in drills(overrides, rank=rank, kind=kind, folder=tmp / layout).items()}
    spec_file, result_file = tmp / "spec.json", tmp / "out.pt"
    spec_file.write_text(json.dumps({"layouts": layouts}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "llmforge.testing.harness", str(spec_file), str(result_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out.update(torch.load(result_file, weights_only=False))
    return {"runs": out, "tmp": tmp}


ALL = ["single", *LAYOUTS]


def assert_same_params(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("layout", ALL)
def test_skip_leaves_the_weights_of_a_run_without_that_steps_update(results, layout):
    runs = results["runs"]
    skip = runs[f"{layout}/skip"]
    assert skip["error"] == ""
    assert [r["skipped_steps"] for r in skip["records"]] == [0, 0, 1, 1, 1, 1, 1]
    assert_same_params(skip["params"], runs[f"{layout}/skip_ref"]["params"])


@pytest.mark.parametrize("layout", ALL)
def test_rollback_leaves_the_weights_of_a_run_resumed_past_the_bad_batches(results, layout):
    runs, folder = results["runs"], results["tmp"] / layout / "rollback"
    got = runs[f"{layout}/rollback"]
    assert got["error"] == ""
    said = got["said"][0]
    assert len(got["said"]) == 1 and said.startswith("rollback 1 of 3 at step 5: at step 4 the ")
    assert said.endswith(f"2 steps in a row were skipped (steps 4-5), more than train.max_skipped_steps=1. Reloaded {folder}/step_2 "
                         "and skipped the 3 batches of steps 3-5; learning rate x0.5 from now on")
    assert_same_params(got["params"], runs[f"{layout}/rollback_ref"]["params"])
    assert [r["lr"] for r in got["records"]][-1] == pytest.approx(0.5e-3)
    assert got["records"][-1]["rollbacks"] == 1 and got["records"][-1]["rollback_skipped_batches"] == 3
    # the checkpoint saved during the bad steps is set aside, the good ones stay
    assert sorted(p.name for p in folder.iterdir()) == ["diverged-step_4", "step_2", "step_6", "step_7"]


@pytest.mark.parametrize("layout", ALL)
def test_stop_ends_at_the_bad_step_and_names_the_way_on(results, layout):
    runs, folder = results["runs"], results["tmp"] / layout / "stop"
    error = runs[f"{layout}/stop"]["error"]
    assert "stopped at step 4: at step 4 the " in error and "train.anomaly=stop ends the run" in error
    assert f"llmforge resume ckpt={folder}/step_2" in error
    assert sorted(p.name for p in folder.iterdir()) == ["step_2"]
    assert [r["step"] for r in runs[f"{layout}/stop"]["records"]] == [1, 2, 3, 4]
