"""The estimator without torch: profiles, published formulas, pipeline, memory, output."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from llmforge.errors import UserError
from llmforge.estimate import activations as act
from llmforge.estimate import comm as cm
from llmforge.estimate import flops as fl
from llmforge.estimate.core import estimate
from llmforge.estimate.inventory import inventory
from llmforge.estimate.memory import model_states
from llmforge.estimate.params import total_params
from llmforge.estimate.pipeline import bubble_fraction, inflight_microbatches, simulate, simulated_bubble
from llmforge.estimate.shape import Job, Shape
from llmforge.hardware import GIB, get_profile, known_profiles
from llmforge.layout import Layout

BUILTIN = ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200", "cpu")


def gpt(*, layers=24, hidden=2048, heads=16, vocab=51200, seq=2048, **kw) -> Shape:
    """A GPT-3 style shape: 4h MLP, GELU, LayerNorm with biases, learned positions, tied."""
    return Shape(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab, seq=seq, **kw)


def job(*, dtype="bf16", accel="h100-80gb", batch=64, **kw) -> Job:
    return Job(global_batch=batch, param_dtype=dtype, reduce_dtype="fp32", profile=get_profile(accel), **kw)


# ---------------------------------------------------------------- profiles


def test_builtin_profiles_are_complete():
    profiles = known_profiles()
    for name in BUILTIN:
        p = profiles[name]
        assert p.memory_bytes > 0 and p.devices_per_node >= 1
        assert min(p.peak(d) for d in ("fp32", "bf16", "fp16")) > 0
        assert name == "cpu" or p.peak("bf16") > p.peak("fp32")
        assert p.intra_node_bandwidth >= p.inter_node_bandwidth > 0
    assert profiles["h100-80gb"].memory_bytes == 80 * GIB
    assert profiles["h100-80gb"].peak("bf16") == pytest.approx(989.4e12)


def test_user_profile_from_config_path_and_file(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    folder.mkdir()
    text = (
        "# my lab's card\nname: lab-24gb\nmemory_gib: 24\npeak_tflops: {fp32: 80, bf16: 160, fp16: 160}\n"
        "memory_bandwidth_gbs: 1000\nintra_node_gbs: 32\ninter_node_gbs: 12.5\ndevices_per_node: 4\n"
    )
    (folder / "lab-24gb.yaml").write_text(text)
    monkeypatch.setenv("LLMFORGE_CONFIG_PATH", str(tmp_path))
    prof = get_profile("lab-24gb")
    assert prof.memory_bytes == 24 * GIB and prof.devices_per_node == 4 and prof.description == "my lab's card"
    assert get_profile(str(folder / "lab-24gb.yaml")).peak("bf16") == 160e12


def test_unknown_or_broken_profile_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="did you mean 'h100-80gb'"):
        get_profile("h100-80g")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmemory_gib: 8\nspeed: fast\n")
    with pytest.raises(UserError) as err:
        get_profile(str(bad))
    text = str(err.value)
    assert "peak_tflops" in text and "unknown profile key" in text and "devices_per_node" in text


# ---------------------------------------------------------------- published formulas

# Narayanan et al. 2021, Table 1: (parameters in billions, heads, hidden, layers); V=51200, s=2048
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize("billions,heads,hidden,layers", NARAYANAN_TABLE1)
def test_parameter_counts_of_narayanan_table1(billions, heads, hidden, layers):
    shape = gpt(layers=layers, hidden=hidden, heads=heads)
    n = total_params(shape)
    # the published closed form, plus the final LayerNorm (2h) it leaves out
    closed = 12 * layers * hidden**2 + 13 * layers * hidden + (51200 + 2048) * hidden + 2 * hidden
    assert n == closed
    assert round(n / 1e9, 1) == pytest.approx(billions, abs=0.1)


@pytest.mark.parametrize("billions,heads,hidden,layers", NARAYANAN_TABLE1[:6])
def test_flops_per_iteration_match_narayanan(billions, heads, hidden, layers):
    shape, batch = gpt(layers=layers, hidden=hidden, heads=heads), 512
    tokens = batch * 2048
    expected = fl.narayanan_flops(batch=batch, seq=2048, layers=layers, hidden=hidden, vocab=51200)
    assert fl.model_flops(shape, tokens) == pytest.approx(expected, rel=1e-12)
    # hardware FLOPs with full recompute: Narayanan's 96 B s L h^2 (...) minus the last matmul of each
    # block (torch's checkpoint stops before it) plus the fused attention backward's score recompute
    full = fl.hardware_flops(shape, Layout(recompute="full"), tokens)
    published = fl.narayanan_flops(batch=batch, seq=2048, layers=layers, hidden=hidden, vocab=51200, full_recompute=True)
    tail = layers * tokens * 2 * hidden * 4 * hidden
    score_recompute = layers * tokens * 0.5 * 4 * 2048 * hidden
    assert full == pytest.approx(published - tail + score_recompute, rel=1e-12)


def _per_token(shape: Shape, layout: Layout, jb: Job, recompute: str) -> float:
    return act.block_activations(shape, layout, jb, moe=False, recompute=recompute).per_token


def test_activations_against_korthikanti_table2():
    """Korthikanti et al. 2022: s b h (10 + 24/t + 5 a s/(h t)) bytes per layer with TP (16-bit).

    llmforge keeps exactly the 24/t part (with the fused kernel's 4a-byte log-sum-exp in
    place of the 5as/h score matrices). Its replicated part, with the residual stream in
    bf16 (the default), is 8h + 8 instead of 10h: the paper's 16-bit norm inputs and the
    linears' shared inputs, no dropout masks at dropout 0 (-2h), 16-bit LayerNorm
    statistics (+8 bytes). With ``precision.fp32_residual`` it is 12h + 16: fp32 norm
    inputs (+4h); autocast casts each norm's output once, for the fused q/k/v and the MLP."""
    h, a = 12288, 96
    shape = gpt(layers=96, hidden=h, heads=a)
    bf16, fp32_residual = job(dtype="bf16"), replace(job(dtype="bf16"), fp32_residual=True)
    for t in (1, 2, 4, 8):
        got = _per_token(shape, Layout(tp=t), bf16, "none")
        assert got == pytest.approx(8 * h + 8 + (24 * h + 4 * a) / t, rel=1e-12)
        assert _per_token(shape, Layout(tp=t), fp32_residual, "none") == pytest.approx(12 * h + 16 + (24 * h + 4 * a) / t, rel=1e-12)
        korthikanti = 10 * h + 24 * h / t + 5 * a * shape.seq / t
        assert got < korthikanti  # no s x s term
    # sequence parallel: everything is split over t, as Megatron's 34/t; the column-parallel
    # linears keep the 16-bit sequence shard of their input (2 x 2h / t), gathered again in backward
    for t in (2, 4, 8):
        got = _per_token(shape, Layout(tp=t, sequence_parallel=True), bf16, "none")
        assert got == pytest.approx((4 * h + 8 + 4 * h + 24 * h + 4 * a) / t, rel=1e-12)
        got = _per_token(shape, Layout(tp=t, sequence_parallel=True), fp32_residual, "none")
        assert got == pytest.approx((8 * h + 16 + 4 * h + 24 * h + 4 * a) / t, rel=1e-12)
    # full recompute: the block input only, the paper's 2 s b h in 16 bits; 4 s b h with an fp32 residual stream
    assert _per_token(shape, Layout(), bf16, "full") == 2 * h
    assert _per_token(shape, Layout(tp=8, sequence_parallel=True), bf16, "full") == 2 * h / 8
    assert _per_token(shape, Layout(), fp32_residual, "full") == 4 * h
    assert _per_token(shape, Layout(tp=8, sequence_parallel=True), fp32_residual, "full") == 4 * h / 8


def test_rmsnorm_keeps_its_input_on_a_gpu_and_fp32_copies_on_a_cpu():
    """CUDA's fused rms_norm keeps the input (residual dtype) and an fp32 statistic (measured on
    an H200, torch 2.11); torch's composite one on a CPU an fp32 upcast and the fp32 normalised
    input: 6h more per norm under bf16, two norms per block."""
    h = 4096
    llama = replace(gpt(hidden=h, heads=32), norm="rmsnorm", activation="swiglu", position="rope", bias=False)
    gpu, cpu = job(dtype="bf16"), job(dtype="bf16", accel="cpu")
    assert _per_token(llama, Layout(), cpu, "none") - _per_token(llama, Layout(), gpu, "none") == 2 * 6 * h
    # with an fp32 residual stream the CPU keeps the same norm tensors, and autocast casts each norm's
    # output once for its one fused consumer: the 16-bit copy a 16-bit stream's linears share anyway
    assert _per_token(llama, Layout(), replace(cpu, fp32_residual=True), "none") == _per_token(llama, Layout(), cpu, "none")
    assert replace(gpu, fp32_residual=True).residual_bytes == 4 and gpu.residual_bytes == 2


ZERO_PAPER = {0: lambda n, d: 16 * n, 1: lambda n, d: 4 * n + 12 * n / d, 2: lambda n, d: 2 * n + 14 * n / d, 3: lambda n, d: 16 * n / d}


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_against_the_zero_paper(zero, reduce):
    """ZeRO's (2 + 2 + K) bytes with K = 12, bf16 compute. Stages 0 and 3 are equal;
    stage 1 accumulates whole gradients in the reduce dtype (Megatron's fp32
    gradient buffer: 2 more bytes; with bf16 reduction exactly the paper), stage 2
    keeps an fp32 gradient shard (2/d more)."""
    shape, d = gpt(layers=8, hidden=1024, heads=16, vocab=51200, seq=1024), 8
    jb = Job(global_batch=64, param_dtype="bf16", reduce_dtype=reduce, profile=get_profile("h100-80gb"))
    n, weights, grads, optimizer = model_states(inventory(shape, Layout(dp=d, zero=zero)), 0, jb)
    ours = weights + grads + optimizer
    paper = ZERO_PAPER[zero](n, d)
    extra = {0: 0, 1: 2 * n if reduce == "fp32" else 0, 2: 2 * n / d, 3: 0}[zero]
    assert ours == pytest.approx(paper + extra, rel=1e-4)  # FSDP pads dim 0 to a multiple of d


# ---------------------------------------------------------------- pipeline


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_interleaved", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_simulated_schedule_matches_the_bubble_formula(schedule, v, p, m):
    layout = Layout(pp=p, pp_schedule=schedule, pp_virtual_stages=v)
    slots = simulate(layout, m)
    units = 3 if schedule == "zb_interleaved" else 2
    assert sum(len(r) for r in slots.values()) == p * v * m * (units if units == 3 else 2)
    assert simulated_bubble(slots) == pytest.approx(bubble_fraction(layout, m, w=1.0), abs=1e-9)


def test_zbv_timeline_runs_every_action_and_bubble_is_below_1f1b():
    layout = Layout(pp=4, pp_schedule="zbv", pp_virtual_stages=2)
    slots = simulate(layout, 8)
    assert sum(len(r) for r in slots.values()) == 4 * 2 * 8 * 3
    assert simulated_bubble(slots) < bubble_fraction(Layout(pp=4, pp_schedule="1f1b"), 8)
    assert bubble_fraction(layout, 8, w=1.0) == 0.0 < bubble_fraction(layout, 8, w=0.8)


def test_bubble_formulas_and_inflight_microbatches():
    assert bubble_fraction(Layout(pp=4, pp_schedule="1f1b"), 12) == pytest.approx(3 / 15)
    assert bubble_fraction(Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 12) == pytest.approx(3 / 27)
    assert inflight_microbatches(Layout(pp=4, pp_schedule="gpipe"), stage=3, microbatches=12) == 12
    assert [inflight_microbatches(Layout(pp=4, pp_schedule="1f1b"), stage=s, microbatches=12) for s in range(4)] == [4, 3, 2, 1]
    # Korthikanti: interleaving multiplies the first stage's activations by 1 + (p-1)/(p v)
    p, v = 4, 2
    got = inflight_microbatches(Layout(pp=p, pp_schedule="interleaved_1f1b", pp_virtual_stages=v), stage=0, microbatches=64)
    assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))


# ---------------------------------------------------------------- whole estimates


def test_most_loaded_device_and_verdict():
    shape = gpt(layers=32, hidden=4096, heads=32, vocab=50304)
    est = estimate(shape, Layout(dp=4, tp=4, pp=2, sequence_parallel=True, zero=1), job(batch=1024, nodes=4))
    assert est.fits and est.worst.stage == 0  # 1F1B: the first stage holds p microbatches
    assert est.worst.total == max(s.total for s in est.stages)
    assert 0 < est.mfu < 1 and est.tokens_per_s == pytest.approx(1024 * 2048 / est.step_s)
    big = Shape(
        num_layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn=28672,
        vocab=128256,
        seq=8192,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
    )
    tiny_card = replace(get_profile("h100-80gb"), memory_bytes=24 * GIB, name="24gb")
    lone = estimate(big, Layout(), Job(global_batch=1, param_dtype="bf16", reduce_dtype="fp32", profile=tiny_card))
    assert not lone.fits and lone.headroom < -1000 * GIB


def test_recompute_and_zero_reduce_memory_as_expected():
    shape, jb = gpt(layers=24, hidden=2048, heads=16), job(batch=64)
    base = estimate(shape, Layout(dp=8, micro_batch_size=8), jb).worst
    full = estimate(shape, Layout(dp=8, micro_batch_size=8, recompute="full"), jb).worst
    sel = estimate(shape, Layout(dp=8, micro_batch_size=8, recompute="selective"), jb).worst
    assert full.activations < sel.activations < base.activations
    z3 = estimate(shape, Layout(dp=8, micro_batch_size=8, zero=3), jb).worst
    assert z3.weights + z3.grads + z3.optimizer == pytest.approx((base.weights + base.grads + base.optimizer) / 8, rel=1e-3)


def test_moe_counts_active_parameters_and_shards_experts():
    shape = Shape(
        num_layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=32000,
        seq=4096,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
        num_experts=8,
        top_k=2,
        moe_ffn=14336,
    )
    est = estimate(shape, Layout(dp=8, ep=8, zero=1), job(batch=64))
    assert round(est.params_total / 1e9, 1) == 46.7 and round(est.params_active / 1e9, 1) == 12.9
    one = estimate(shape, Layout(dp=8, ep=1, zero=1), job(batch=64))
    assert est.worst.params < one.worst.params / 4
    assert est.comm.bytes_of("ep") > 0 and one.comm.bytes_of("ep") == 0


def bandwidth_only(jb: Job) -> Job:
    """``jb`` on its profile without the per-hop latency: collectives cost bytes / bandwidth."""
    return replace(jb, profile=replace(jb.profile, comm_latency_us=0.0))


def test_zero0_allreduce_hides_behind_the_last_backward_but_its_last_bucket():
    jb, d = bandwidth_only(job(batch=64)), 8
    common = dict(dense=10**9, expert=0, microbatches=4, blocks=8, t_fwd=1.0, span=d)

    def all_reduce(layout: Layout, jb: Job, **kw) -> cm.Traffic:
        return cm.dp_traffic(layout, jb, **common, **kw)["dp_all_reduce"]

    ar = all_reduce(Layout(dp=d), jb, t_bwd=10 * t_of(jb), last_bucket=0)
    sent = 2 * 10**9 * (d - 1) / d * 4
    t = t_of(jb)
    assert ar.bytes == pytest.approx(sent) and ar.seconds == pytest.approx(t)
    # a long backward hides all but the last 25 MB bucket (parallel.bucket_mb), launched when backward ends
    assert ar.exposed == pytest.approx(t * 25 * 2**20 / (10**9 * 4)) and ar.hidden == pytest.approx(t - ar.exposed)
    bigger = all_reduce(Layout(dp=d), replace(jb, bucket_bytes=100 * 2**20), t_bwd=10 * t, last_bucket=0)
    assert bigger.exposed == pytest.approx(4 * ar.exposed)
    # an embedding larger than a bucket is that last bucket
    assert all_reduce(Layout(dp=d), jb, t_bwd=10 * t, last_bucket=10**8).exposed == pytest.approx(t / 10)
    # a short backward hides only its own length
    assert all_reduce(Layout(dp=d), jb, t_bwd=t / 2, last_bucket=0).exposed == pytest.approx(t / 2)
    # under a pipeline the schedule runs backward and the all-reduce follows it
    assert all_reduce(Layout(dp=d, pp=2), jb, t_bwd=10 * t, last_bucket=0).exposed == pytest.approx(t)
    # with the overlap switched off (the CPU default) it all follows backward too
    off = replace(jb, overlap_grad_reduce=False)
    assert all_reduce(Layout(dp=d), off, t_bwd=10 * t, last_bucket=0).exposed == pytest.approx(t)


def t_of(jb: Job) -> float:
    """Seconds of the all-reduce of 10^9 fp32 gradients over 8 ranks in a node."""
    return cm.seconds(jb, 2 * 10**9 * 7 / 8 * 4, 8, 8)


def test_fsdp_hides_block_by_block_but_the_ends():
    """ZeRO 3 with a long compute: only the root's and the first block's gathers and the first
    block's and root's reduce-scatters (after backward) are exposed; with no compute, all of it."""
    jb, d, blocks = bandwidth_only(job(batch=64)), 8, 10
    common = dict(dense=10**9, expert=0, microbatches=2, blocks=blocks, span=d, last_bucket=10**8)
    slow = cm.dp_traffic(Layout(dp=d, zero=3), jb, t_fwd=100.0, t_bwd=200.0, **common)
    ag, rs = slow["dp_all_gather"], slow["dp_reduce_scatter"]
    root_ag = ag.seconds / (2 + 2 * 0.9 * (blocks - 1) / blocks) * 0.1  # per forward gather: root is a tenth
    assert ag.exposed == pytest.approx(2 * (root_ag + 0.9 * root_ag / 0.1 / blocks))
    assert rs.exposed == pytest.approx(rs.seconds * (0.1 + 0.9 / blocks))
    idle = cm.dp_traffic(Layout(dp=d, zero=3), jb, t_fwd=0.0, t_bwd=0.0, **common)
    assert idle["dp_all_gather"].exposed == pytest.approx(idle["dp_all_gather"].seconds)
    assert idle["dp_reduce_scatter"].exposed == pytest.approx(idle["dp_reduce_scatter"].seconds)
    once = cm.dp_traffic(Layout(dp=d, zero=1), jb, t_fwd=100.0, t_bwd=200.0, **common)  # ZeRO 1: once per step
    assert once["dp_all_gather"].seconds == pytest.approx(ag.seconds / (2 + 2 * 0.9 * (blocks - 1) / blocks))
    assert once["dp_reduce_scatter"].seconds == pytest.approx(rs.seconds / 2)


def test_collectives_pay_the_latency_once_per_ring_hop():
    """ZeRO 3 over n ranks: 2 x blocks gathers (forward with the root, backward but the last block)
    and blocks + 1 reduce-scatters per microbatch, each (n - 1) hops; ZeRO 0's buckets all-reduce
    over NCCL's tree where it is shorter than the ring (2 log2 n hops)."""
    jb, blocks = job(batch=64), 10
    alpha = jb.profile.comm_latency_us * 1e-6
    assert alpha > 0
    for d in (8, 128):
        kw = dict(dense=10**9, expert=0, microbatches=1, blocks=blocks, t_fwd=0.0, t_bwd=0.0, span=d, last_bucket=10**8)
        with_lat = cm.dp_traffic(Layout(dp=d, zero=3), jb, **kw)
        without = cm.dp_traffic(Layout(dp=d, zero=3), bandwidth_only(jb), **kw)
        extra = {k: with_lat[k].seconds - without[k].seconds for k in with_lat}
        assert extra["dp_all_gather"] == pytest.approx(2 * blocks * (d - 1) * alpha)
        assert extra["dp_reduce_scatter"] == pytest.approx((blocks + 1) * (d - 1) * alpha)
    kw = dict(dense=10**9, expert=0, microbatches=1, blocks=blocks, t_fwd=0.0, t_bwd=0.0, span=128, last_bucket=0)
    ar, bare = (cm.dp_traffic(Layout(dp=128), j, **kw)["dp_all_reduce"] for j in (jb, bandwidth_only(jb)))
    buckets = -(-4 * 10**9 // jb.bucket_bytes)
    assert ar.seconds - bare.seconds == pytest.approx(buckets * 2 * 7 * alpha)  # tree: 2 log2 128 < 2 x 127


def test_hidden_communication_slows_the_compute_under_it():
    """FSDP2 copies every gathered byte out of its buffer on the compute stream, and while a
    collective runs its kernels hold ``comm_sm_share`` of the SMs: the step pays that share of
    the hidden communication."""
    shape = gpt(layers=24, hidden=2048, heads=16)
    jb = job(batch=64)
    est = estimate(shape, Layout(dp=8, micro_batch_size=8, zero=3), jb)
    hidden = sum(t.hidden for t in est.comm.kinds.values())
    assert hidden > 0 and est.terms["comm_overlap"] == pytest.approx(jb.profile.comm_sm_share * hidden)
    idle = estimate(shape, Layout(dp=8, micro_batch_size=8, zero=3), replace(jb, profile=replace(jb.profile, comm_sm_share=0.0)))
    assert idle.terms["comm_overlap"] == 0 and idle.step_s < est.step_s
    copy_out = 2 * est.comm.kinds["dp_all_gather"].bytes * 8 / 7 / (jb.profile.memory_bandwidth * jb.profile.bandwidth_efficiency)
    replicated = estimate(shape, Layout(dp=8, micro_batch_size=8), jb)  # ZeRO 0 gathers nothing
    assert est.compute.memory - replicated.compute.memory == pytest.approx(copy_out, rel=1e-6)


def test_groups_across_nodes_use_every_nic_of_a_node():
    jb = job(batch=64)
    whole_nodes = cm.seconds(jb, 10**9, 64, 64)  # dp 64 over 8 nodes: 8 members a node
    one_a_node = cm.seconds(jb, 10**9, 64, 8)  # dp 8 with tp 8: 1 member a node
    in_node = cm.seconds(jb, 10**9, 8, 8)
    assert one_a_node == pytest.approx(8 * whole_nodes) and in_node < whole_nodes < one_a_node


def test_zero0_step_time_charges_less_than_the_whole_allreduce():
    shape, jb = gpt(layers=24, hidden=2048, heads=16), job(batch=64)
    est = estimate(shape, Layout(dp=8, micro_batch_size=8), jb)
    assert 0 < est.parts["dp_comm"] < est.comm.seconds_of("dp")
    piped = estimate(shape, Layout(dp=4, pp=2, micro_batch_size=8), jb)
    assert piped.parts["dp_comm"] == pytest.approx(piped.comm.seconds_of("dp"))


def test_overlap_follows_the_plan():
    from llmforge.estimate.shape import job_from_plan

    assert job_from_plan(_plan("parallel=dp2")).overlap_grad_reduce is False  # cpu default
    assert job_from_plan(_plan("parallel=dp2", "parallel.overlap_grad_reduce=true")).overlap_grad_reduce is True
    assert job_from_plan(_plan("recipe=gpt-1b")).overlap_grad_reduce is True  # GPU default


# ---------------------------------------------------------------- command line


def _plan(*overrides):
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    return RunPlan.build(compose(list(overrides)))


def test_json_schema(capsys):
    from rich.console import Console

    from llmforge.commands.estimate import run_estimate

    run_estimate(
        _plan("recipe=gpt-7b", "parallel=tp4pp2"), as_json=True, timeline=False, measure=False, search=False, top=3, console=Console()
    )
    data = json.loads(capsys.readouterr().out)
    assert set(data["params"]) >= {"total", "active", "per_device"}
    assert set(data["memory_bytes"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert set(data["pipeline"]) >= {"schedule", "microbatches", "bubble_fraction"}
    assert set(data["flops"]) >= {"model_per_step", "hardware_per_step"}
    assert set(data["time"]) >= {"step_s", "tokens_per_s", "mfu"}
    assert data["fits"] is True and data["device_memory_bytes"] == 80 * GIB
    assert data["pipeline"]["schedule"] == "1f1b" and data["pipeline"]["microbatches"] == 256
    assert data["memory_bytes"]["total"] == pytest.approx(sum(v for k, v in data["memory_bytes"].items() if k != "total"))
    terms = data["time"]["terms_s"]
    assert set(terms) >= {"matmul", "attention", "memory_bound", "launch_floor", "tp_exposed", "pp_exposed", "bubble", "optimizer"}
    assert sum(terms.values()) == pytest.approx(data["time"]["step_s"]) and data["time"]["compile"] is False
    comm = data["communication"]
    assert set(comm) == {"dp_all_gather", "dp_reduce_scatter", "tp", "pp"}  # the recipe's ZeRO over dp, x tp4 x pp2
    for kind in comm.values():
        assert kind["seconds"] == pytest.approx(kind["exposed_s"] + kind["hidden_s"]) and kind["exposed_s"] >= 0
    assert comm["tp"]["hidden_s"] == 0 and terms["tp_exposed"] == pytest.approx(comm["tp"]["exposed_s"])


def test_rich_output_with_timeline_and_short_summary():
    from rich.console import Console

    from llmforge.commands.estimate import run_estimate
    from llmforge.estimate.report import short_summary

    console = Console(record=True, width=140)
    plan = _plan("recipe=gpt-1b", "parallel=tp2pp2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2")
    run_estimate(plan, as_json=False, timeline=True, measure=False, search=False, top=3, console=console)
    text = console.export_text()
    assert "Verdict: fits" in text and "rank 0" in text and "rank 1" in text and "F0" in text and "B0" in text
    summary, fits = short_summary(
        _plan("recipe=gpt-7b", "parallel=single", "cluster.nodes=1", "cluster.devices_per_node=1", "train.global_batch_size=8")
    )
    assert not fits and "does not fit" in summary


def test_estimate_imports_no_torch():
    code = (
        "import sys\nfrom llmforge.config.compose import compose\nfrom llmforge.plan import RunPlan\n"
        "from llmforge.estimate.report import short_summary, as_dict\nfrom llmforge.estimate.core import estimate_plan\n"
        "plan = RunPlan.build(compose(['recipe=gpt-7b', 'parallel=tp4pp2']))\nas_dict(estimate_plan(plan)); short_summary(plan)\n"
        "bad = [m for m in ('torch', 'datasets', 'wandb') if m in sys.modules]\nassert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_accelerator_fails_validation_with_exit_code_2():
    from typer.testing import CliRunner

    from llmforge.cli import app

    result = CliRunner().invoke(app, ["estimate", "cluster.accelerator=h100-80g"])
    assert result.exit_code == 2
    assert "cluster.accelerator" in result.output and "h100-80gb" in result.output and "Traceback" not in result.output


def test_the_bubble_of_an_unbalanced_pipeline_waits_for_the_other_stages():
    """The tiny recipe at pp2: the last stage also runs the output layer and the loss, so it is
    the slowest; as the pipeline fills and drains it waits for the first stage's forward and
    backward of one microbatch (1F1B: p - 1 of them), not for its own."""
    from llmforge.commands.plans import build_plan
    from llmforge.estimate.core import _stage_seconds, _stage_time, microbatches
    from llmforge.estimate.shape import from_plan

    shape, layout, job = from_plan(build_plan(["parallel=pp2", "cluster.devices_per_node=2"]))
    est = estimate(shape, layout, job)
    inv = inventory(shape, layout)
    m = microbatches(est.layout, job)
    first, last = (_stage_seconds(*_stage_time(inv, job, s, m)) for s in (0, 1))
    assert last > 1.2 * first
    assert est.parts["bubble"] == pytest.approx(first)
    assert est.parts["compute"] + est.parts["tp_ep_comm"] == pytest.approx(m * last, rel=0.02)
