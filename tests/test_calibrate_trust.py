"""A calibration you can trust: robust statistics of interleaved passes, the load of other
processes, retries and the flag on a busy machine's figures, one calibration at a time, and
the closing line that says when the profile looks wrong. Every figure is injected: nothing
here depends on how busy the machine running the tests is."""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
import threading
import time

import pytest
import yaml
from calibrate_fake import FakeMachine, QuietLoad
from rich.console import Console

from llmforge.calibrate import auto, lock, run, trust
from llmforge.calibrate.advice import profile_warning
from llmforge.calibrate.fit import BandwidthSample, ComputeSamples, MatmulSample, fit_compute
from llmforge.calibrate.probe import CpuLoad, LoadReading, busy_cpu_seconds, own_cpu_seconds
from llmforge.commands.plans import build_plan
from llmforge.errors import UserError
from llmforge.hardware import UNCACHED_ENV, cpu_threads, get_profile, machine_profile_path


def _pass(rate: float, *, others: float = 0.0) -> ComputeSamples:
    shapes = [(t, h, 4 * h) for h in (128, 512) for t in (512, 2048)]
    samples = ComputeSamples(device="cpu", device_name="fake", threads=2, floor_s=1e-6)
    samples.matmul["fp32"] = [MatmulSample(m, k, n, 2 * m * k * n / rate) for m, k, n in shapes]
    samples.bandwidth = [BandwidthSample("copy", 8 * 2**20, 8 * 2**20 / 1e10)]
    samples.load = [LoadReading(wall_s=2.0, others_cpu_s=2.0 * others, cpus=2, threads=2)]
    return samples


def test_the_median_of_the_passes_outlives_one_disturbed_pass_and_the_disagreement_is_caught():
    combined = trust.combine([_pass(1e11), _pass(3e10), _pass(1e11)])
    assert fit_compute(combined).rates["fp32"] == pytest.approx(1e11)
    verdict = trust.judge(combined)
    assert not verdict.trusted and "disagree" in verdict.reasons[0] and verdict.spread == pytest.approx(1e11 / 3e10 - 1)
    assert trust.judge(trust.combine([_pass(1e11), _pass(1.05e11), _pass(1e11)])).trusted


def test_other_processes_on_the_calibrations_cpus_make_it_untrusted():
    busy = trust.judge(trust.combine([_pass(1e11), _pass(1e11, others=1.6), _pass(1e11)]))
    assert not busy.trusted and "other processes kept 1.6 of the 2 CPUs" in busy.reasons[0]
    assert busy.provenance()["trusted"] is False and busy.provenance()["other_processes_cpus"] == 1.6
    assert trust.judge(trust.combine([_pass(1e11, others=0.1)] * 3)).trusted  # a daemon's crumbs
    spare = LoadReading(wall_s=1.0, others_cpu_s=1.0, cpus=4, threads=2)
    assert spare.contention == 0.0  # the others ran on the CPUs it left idle


def test_the_load_probe_counts_busy_cpu_time_less_its_own(tmp_path):
    clock, busy, own = iter([10.0, 12.0]), iter([100.0, 103.5]), iter([5.0, 7.0])
    probe = CpuLoad(threads=2, cpus=frozenset({0, 1}), busy=lambda: next(busy), own=lambda: next(own), clock=lambda: next(clock))
    probe.start()
    assert probe.stop() == LoadReading(wall_s=2.0, others_cpu_s=1.5, cpus=2, threads=2)
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 1000 20 0 0 10 0 0\ncpu1 200 0 0 5000 0 0 0 0 0 0\n")
    tick = __import__("os").sysconf("SC_CLK_TCK")
    assert busy_cpu_seconds(frozenset({0, 1}), stat=stat) == pytest.approx(360 / tick)  # idle and iowait left out, steal counted
    assert busy_cpu_seconds(frozenset({0, 7}), stat=stat) is None  # a CPU the kernel does not list: no reading


def _reading_with_a_child(*, others_s: float) -> LoadReading:
    """A 2 s stretch on 2 CPUs in which this process computed 0.2 s and a subprocess it waited
    for (the host probe) 1.4 s, and other processes ``others_s``."""
    times = iter([os.times_result((1.0, 0.0, 0.0, 0.0, 0.0)), os.times_result((1.2, 0.0, 1.4, 0.0, 0.0))])
    clock, busy = iter([0.0, 2.0]), iter([50.0, 51.6 + others_s])
    probe = CpuLoad(
        threads=2,
        cpus=frozenset({0, 1}),
        busy=lambda: next(busy),
        own=lambda: own_cpu_seconds(lambda: next(times)),
        clock=lambda: next(clock),
    )
    probe.start()
    reading = probe.stop()
    assert reading is not None
    return reading


def _judged(reading: LoadReading) -> trust.Verdict:
    samples = _pass(1e11)
    samples.load = [reading]
    return trust.judge(trust.combine([samples] * 3))


def test_a_calibrations_own_subprocess_is_not_other_processes_load():
    idle = _reading_with_a_child(others_s=0.0)
    assert idle.others_cpu_s == pytest.approx(0.0) and _judged(idle).trusted
    busy = _reading_with_a_child(others_s=1.6)
    assert busy.others_cpu_s == pytest.approx(1.6)
    verdict = _judged(busy)
    assert not verdict.trusted and "other processes kept 0.8 of the 2 CPUs" in verdict.reasons[0]


def test_own_cpu_seconds_counts_a_waited_for_child():
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    before, children = own_cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    assert child >= 0.3 and own_cpu_seconds() - before >= child - 0.02


def test_a_busy_machine_is_measured_again_and_its_figures_flagged(monkeypatch):
    monkeypatch.setattr(run, "PAUSE_S", 0.0)
    attempts, said = [], []
    verdicts = iter([trust.Verdict(reasons=["busy"]), trust.Verdict(reasons=["busy"]), trust.Verdict(reasons=["busy"])])
    monkeypatch.setattr(trust, "judge", lambda samples: next(verdicts))

    def measure():
        attempts.append(1)
        return _pass([5e10, 9e10, 7e10][len(attempts) - 1]), []

    compute, _, verdict = run.measure_trusted(measure, attempts=3, say=said.append)
    assert len(attempts) == 3 and len(said) == 2 and "measuring again" in said[0]
    assert not verdict.trusted and fit_compute(compute).rates["fp32"] == pytest.approx(9e10)  # the least disturbed attempt
    verdicts = iter([trust.Verdict(reasons=["busy"]), trust.Verdict()])
    attempts.clear()
    _, _, verdict = run.measure_trusted(measure, attempts=3, say=said.append)
    assert verdict.trusted and len(attempts) == 2


def test_calibrate_on_a_busy_machine_retries_then_writes_the_profile_flagged(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from llmforge.cli import app

    monkeypatch.setattr(run, "PAUSE_S", 0.0)
    monkeypatch.setattr(QuietLoad, "others_cores", 1.9)
    fake = FakeMachine().install(monkeypatch)
    out = tmp_path / "busy.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count("measuring again") == 2 and "busy machine" in result.output
    assert fake.calls.count("matmul bf16") == 3 * 3  # three attempts of three passes
    calibration = yaml.safe_load(out.read_text())["calibration"]
    assert calibration["trusted"] is False and "other processes" in calibration["untrusted_because"]


def _plan():
    return build_plan(["cluster.accelerator=cpu"])


def test_the_first_run_does_not_cache_a_busy_machines_figures_but_uses_them(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LLMFORGE_AUTO_CALIBRATE", "1")
    monkeypatch.setenv(UNCACHED_ENV, "")  # restored after the test
    monkeypatch.setattr(run, "PAUSE_S", 0.0)
    monkeypatch.setattr(QuietLoad, "others_cores", 1.9)
    fake = FakeMachine().install(monkeypatch)
    text = io.StringIO()
    auto.ensure_cpu_profile(_plan(), console=Console(file=text, width=400))
    assert "busy machine" in text.getvalue() and "not cached" in text.getvalue()
    assert not machine_profile_path(cpu_threads(1)).exists()
    used = get_profile("cpu")
    assert used.calibrated and used.peak("fp32") == pytest.approx(fake.rates["fp32"], rel=5e-3)


def test_an_llmforge_home_that_cannot_hold_the_profile_is_named_and_this_run_uses_the_measurement(monkeypatch, tmp_path):
    home = tmp_path / "home-file"
    home.write_text("x")
    monkeypatch.setenv("LLMFORGE_HOME", str(home))
    monkeypatch.setenv("LLMFORGE_AUTO_CALIBRATE", "1")
    monkeypatch.setenv(UNCACHED_ENV, "")
    fake = FakeMachine().install(monkeypatch)
    text = io.StringIO()
    auto.ensure_cpu_profile(_plan(), console=Console(file=text, width=400))
    assert f"LLMFORGE_HOME={home}" in text.getvalue() and "this run uses it" in text.getvalue()
    assert get_profile("cpu").peak("fp32") == pytest.approx(fake.rates["fp32"], rel=5e-3)
    assert not auto.needs_calibration(_plan())  # measured once for this run, not before every estimate


def test_one_calibration_at_a_time_and_a_waiting_one_says_so(tmp_path):
    path, held, release, said = tmp_path / "calibrate.lock", threading.Event(), threading.Event(), []

    def first():
        with lock.calibration_lock(say=said.append, path=path):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(10)
    with pytest.raises(UserError, match="another llmforge calibration"):
        with lock.calibration_lock(say=said.append, path=path, wait_s=0.2, poll_s=0.05):
            pass
    assert "waiting for it" in said[0]
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    with lock.calibration_lock(say=said.append, path=path, wait_s=10, poll_s=0.05) as locked:
        assert locked and time.monotonic() - started >= 0.25
    thread.join()


def test_two_calibrations_at_once_measure_one_after_the_other_and_leave_one_whole_profile(monkeypatch, tmp_path):
    from llmforge.commands.calibrate import calibrate_command

    monkeypatch.setattr(lock, "lock_path", lambda: tmp_path / "calibrate.lock")
    events, out = [], tmp_path / "p.yaml"
    real = run.measure_here

    def measure_here(req, **kwargs):
        events.append(("start", threading.current_thread().name))
        time.sleep(0.3)
        samples = real(req, **kwargs)
        events.append(("end", threading.current_thread().name))
        return samples

    monkeypatch.setattr(run, "measure_here", measure_here)
    FakeMachine().install(monkeypatch)
    from llmforge.config import compose as composing

    one_at_a_time, real_compose = threading.Lock(), composing.compose

    def compose(*args, **kwargs):  # Hydra's global state is one process's, not one thread's
        with one_at_a_time:
            return real_compose(*args, **kwargs)

    monkeypatch.setattr(composing, "compose", compose)
    console = Console(file=io.StringIO())
    threads = [
        threading.Thread(
            target=calibrate_command,
            name=n,
            args=([],),
            daemon=True,
            kwargs=dict(config_dir=[], quick=True, out=out, name=None, command="test", console=console),
        )
        for n in "ab"
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    names = [name for _, name in events]
    assert len(events) == 4 and names[0] == names[1] and names[2] == names[3]  # never interleaved
    assert get_profile(str(out)).calibrated


@pytest.mark.parametrize(
    "ratio, mfu, flagged", [(1.0, 0.4, False), (1.9, 0.2, False), (0.55, 0.9, False), (2.5, 0.1, True), (0.3, 0.6, True), (0.8, 1.05, True)]
)
def test_the_closing_line_says_when_the_profile_looks_wrong(ratio, mfu, flagged):
    text = profile_warning(ratio=ratio, mfu=mfu, accelerator="cpu", source="p.yaml", calibration={})
    assert bool(text) == flagged
    if flagged:
        assert "profile looks wrong" in text and "llmforge calibrate" in text and "p.yaml" in text


def test_a_run_far_from_its_estimate_ends_with_the_warning():
    from llmforge.estimate.core import estimate_plan
    from llmforge.train.run import RunSummary

    plan = build_plan([])
    est = estimate_plan(plan)
    line = lambda step: RunSummary(1.0, 0.5, 2, 1.0, None, step_time_s=step).describe(plan).plain  # noqa: E731
    assert "profile looks wrong" not in line(est.step_s * 1.1)
    assert "profile looks wrong" in line(est.step_s * 10) and "10.00x" in line(est.step_s * 10)
    gpu = build_plan(["cluster.accelerator=h100-80gb"])
    est = estimate_plan(gpu)
    fast = RunSummary(1.0, 0.5, 2, 1.0, None, step_time_s=est.step_s * est.mfu * 0.9).describe(gpu).plain
    assert "MFU 111% passes 100%" in fast and "llmforge calibrate cluster.accelerator=h100-80gb" in fast


def test_the_first_runs_calibration_measures_in_a_child_and_leaves_this_process_its_memory():
    """What the probes allocate stays in the child: this process's peak resident memory does not
    move while the child measures (the probes' largest arrays alone are 64 MiB each)."""
    from llmforge.calibrate.apart import measure_apart
    from llmforge.train.meter import peak_rss_bytes, reset_peak_rss

    reset_peak_rss()
    before = peak_rss_bytes()
    samples = measure_apart(quick=True, threads=1, passes=1)
    assert samples.device == "cpu" and samples.threads == 1
    assert samples.matmul["fp32"] and samples.bandwidth and samples.step_floor_s > 0
    assert peak_rss_bytes() - before < 32 * 2**20
