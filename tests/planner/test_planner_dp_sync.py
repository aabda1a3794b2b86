"""The planner's data-parallel sync: priced per stage, simulated as REDUCE_GRAD ops, and the launch tuple."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy, estimate, plan
from mt_dualpipe.planner import runnable as runnable_module
from mt_dualpipe.planner.dp_sync import param_gather_time, stage_sync_times
from mt_dualpipe.planner.estimate import stage_items
from mt_dualpipe.planner.runnable import RUNTIME_RECOMPUTE, launch, short_reason, unrunnable_reasons
from mt_dualpipe.schedules import Costs, add_grad_reduction, build_schedule, simulate

H800 = PRESETS["h800"]
LLAMA2_7B = {"model_name": "llama2-7b", "hidden_size": 4096, "num_layers": 32, "ffn_hidden_size": 11008,
             "vocab_size": 32000, "num_attention_heads": 32}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "llama2-7b.json"
    path.write_text(json.dumps(LLAMA2_7B))
    return ModelSpec.load(str(path))


@pytest.fixture(scope="module")
def v3():
    return ModelSpec.load("deepseek-v3")


def plain_costs(costs: Costs) -> Costs:
    return replace(costs, dp_sync=0.0)


@pytest.mark.parametrize("schedule,pp,dp,zero,across,copies", [
    ("1f1b", 4, 16, 0, True, 1),      # all-reduce (two passes) over 16 ranks: two nodes
    ("1f1b", 4, 2, 1, False, 1),      # ZeRO-1 reduce-scatter (one pass) inside a node
    ("dualpipe", 4, 2, 1, False, 2),  # mirrored stages: both copies x 2 replicas, 4 x 2 ranks fit in a node
    ("dualpipe", 4, 4, 0, True, 2),   # 4 x 4 ranks leave the node
    ("1f1b", 4, 2, 3, False, 1),      # FSDP: the reduce-scatter, one pass
    ("dualpipe", 4, 2, 3, False, 2),  # FSDP on mirrored stages: all-reduced over both copies (two passes)
])
def test_stage_sync_time_by_hand(llama, schedule, pp, dp, zero, across, copies):
    st = Strategy(pp, schedule, 8, dp=dp, zero=zero)
    stages = stage_items(llama, st, H800)
    sched = build_schedule(schedule, pp, 8)
    bw, lat = H800.link(across)
    g = dp * copies
    passes = 2 if zero == 0 or (zero == 3 and copies > 1) else 1
    want = [passes * (sum(i.params for i in items) * 2 * (g - 1) / g / bw + lat) for items in stages]
    assert stage_sync_times(st, H800, stages, sched) == pytest.approx(want, rel=1e-12)
    est = estimate(llama, H800, st)
    assert est.costs.dp_sync == pytest.approx(want, rel=1e-12)


def test_step_time_is_the_simulated_makespan_with_each_stages_reduction(v3):
    for st in (Strategy(16, "dualpipe", 120, ep=64, dp=128, dtype="fp8"),
               Strategy(8, "zbv", 32, ep=8, dp=64, dtype="fp8"),
               Strategy(8, "1f1b", 32, ep=8, dp=64, dtype="fp8", zero=0)):
        est = estimate(v3, H800, st)
        plain = build_schedule(st.schedule, st.pp, st.num_microbatches)
        with_sync = simulate(add_grad_reduction(plain), est.costs)
        gather = param_gather_time(st, H800, stage_items(v3, st, H800), plain)
        assert (gather > 0) == (st.zero == 1)
        assert est.step_time == pytest.approx(with_sync.makespan + gather + est.optimizer_time, rel=1e-12)
        base = simulate(plain, plain_costs(est.costs))
        assert est.pipeline_time == pytest.approx(base.makespan, rel=1e-12)
        assert est.bubble_rate == pytest.approx(base.bubble_rate, rel=1e-9)
        assert est.dp_sync_time == pytest.approx(est.step_time - est.pipeline_time - est.optimizer_time, rel=1e-12)
        # unhidden: the most loaded rank's reductions, one after the other, plus the gather
        total = max(sum(est.costs.dp_sync[s] for _, s in plain.local_stages(r)) for r in range(st.pp)) + gather
        assert est.dp_sync_total == pytest.approx(total, rel=1e-12)
        assert 0 < est.dp_sync_time <= est.dp_sync_total + 1e-12
        d = est.to_dict()
        assert (d["dp_sync_exposed_s"], d["dp_sync_total_s"]) == (est.dp_sync_time, est.dp_sync_total)


def test_dualpipe_hides_part_of_its_sync_a_linear_schedule_none_of_rank_zeros(v3):
    dual = estimate(v3, H800, Strategy(16, "dualpipe", 120, ep=64, dp=128, dtype="fp8"))
    assert dual.dp_sync_time < dual.dp_sync_total  # the W tail hides part of the reduce-scatter
    linear = estimate(v3, H800, Strategy(16, "1f1b", 120, ep=64, dp=128, dtype="fp8", zero=0))
    # 1F1B: rank 0 ends with stage 0's last BW, so its all-reduce adds in full
    first = linear.costs.dp_sync[0]
    assert linear.dp_sync_time >= first - 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-1f1b"])
def test_one_replica_leaves_every_figure_as_the_plain_simulation(llama, schedule):
    opts = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    st = Strategy(4, schedule, 8, dp=1, virtual_stages=opts.get("virtual_stages", 1))
    est = estimate(llama, H800, st)
    res = simulate(build_schedule(schedule, 4, 8, **opts), est.costs)
    assert est.costs.dp_sync == 0.0 and est.dp_sync_time == 0.0 and est.dp_sync_total == 0.0
    assert est.step_time - est.optimizer_time == est.pipeline_time == res.makespan
    assert est.bubble_rate == res.bubble_rate and est.peak_activations == max(res.peak_activations)


def test_one_replica_of_dualpipe_still_sums_its_mirrored_copies(llama):
    st = Strategy(4, "dualpipe", 8, dp=1)
    est = estimate(llama, H800, st)
    plain = simulate(build_schedule("dualpipe", 4, 8), plain_costs(est.costs))
    assert est.pipeline_time == pytest.approx(plain.makespan, rel=1e-12)  # compute unchanged
    assert est.bubble_rate == pytest.approx(plain.bubble_rate, rel=1e-9)
    assert all(t > 0 for t in est.costs.dp_sync)  # two copies of every stage: a group of 2
    assert est.step_time > est.pipeline_time


def test_launch_tuple_in_the_runtimes_terms(v3):
    st = Strategy(16, "dualpipe", 120, ep=64, dp=128, dtype="fp8")
    d = estimate(v3, H800, st).to_dict()
    assert d["launch"] == {"pp": 16, "dp": 2, "ep": 64, "tp": 1, "schedule": "dualpipe", "microbatches": 120,
                           "dp_mode": "zero1", "recompute": "selective", "schedule_options": {},
                           "micro_batch_size": 1, "core_attention": "flash", "memory_savers": "none"}
    assert estimate(v3, H800, st).to_dict({"norm", "swiglu"})["launch"]["memory_savers"] == "norm,swiglu"
    L = d["launch"]
    assert L["pp"] * L["dp"] * L["ep"] * L["tp"] == st.gpus == 2048
    assert d["runnable"] is True and d["unrunnable"] == []  # the runtime applies selective recompute
    for policy in ("none", "full"):
        assert estimate(v3, H800, replace(st, recompute=policy)).runnable
    ok = replace(st, recompute="none", zero=0, schedule="interleaved-1f1b", virtual_stages=2)
    assert launch(ok)["dp_mode"] == "allreduce" and launch(ok)["schedule_options"] == {"virtual_stages": 2}
    e = estimate(v3, H800, replace(ok, num_microbatches=32))
    assert e.runnable and e.to_dict()["unrunnable"] == []


def test_runtime_recompute_policies_are_the_families():
    pytest.importorskip("torch")
    from mt_dualpipe.models.recompute import POLICIES

    assert RUNTIME_RECOMPUTE == POLICIES


def test_tensor_parallel_stays_unrunnable():
    @dataclass(frozen=True)
    class WithTp:  # a strategy that carries a tensor-parallel size (the planner's own are tp = 1)
        tp: int
        recompute: str = "full"
        zero: int = 1

    assert unrunnable_reasons(WithTp(1)) == []
    assert unrunnable_reasons(WithTp(2)) == ["tp 2 is not launched by the runtime (runnable: 1)"]
    assert short_reason(unrunnable_reasons(WithTp(4))) == "no: tp"


def test_plan_marks_or_leaves_out_what_the_runtime_cannot_run(v3, monkeypatch):
    # every recompute policy runs now: narrow the runtime's list to exercise the marking and the filter
    monkeypatch.setattr(runnable_module, "RUNTIME_RECOMPUTE", ("none",))
    assert unrunnable_reasons(Strategy(16, "dualpipe", 32, recompute="selective")) == [
        "recompute 'selective' is not applied by the runtime's stages (runnable: none)"]
    opts = {"pp": [16], "ep": [8, 32], "dtype": "fp8", "schedules": ("dualpipe", "zbv")}
    marked = plan(v3, H800.replace(gpu_memory_gb=256), 512, 1024, recompute="selective", **opts)
    assert marked.ranked and all(not e.runnable for e in marked.ranked + marked.rejected)
    assert marked.not_runnable == 0
    left = plan(v3, H800.replace(gpu_memory_gb=256), 512, 1024, recompute="selective", runnable_only=True, **opts)
    assert left.ranked == [] and left.rejected == []
    assert left.not_runnable == len(marked.ranked) + len(marked.rejected)
    assert left.to_dict()["not_runnable_left_out"] == left.not_runnable
    runnable = plan(v3, H800.replace(gpu_memory_gb=256), 512, 1024, recompute="none", runnable_only=True, **opts)
    assert runnable.not_runnable == 0 and all(e.runnable for e in runnable.ranked + runnable.rejected)
    assert len(runnable.ranked) + len(runnable.rejected) == len(marked.ranked) + len(marked.rejected)


@pytest.mark.parametrize("schedule,copies", [("1f1b", 1), ("dualpipe", 2)])
def test_fsdp_gathers_its_parameters_once_a_step_over_its_own_dp_mesh(llama, schedule, copies):
    zero1, fsdp = (Strategy(4, schedule, 8, dp=2, zero=z) for z in (1, 3))
    stages = stage_items(llama, fsdp, H800)
    sched = build_schedule(schedule, 4, 8)
    bw, lat = H800.link(False)

    def ring(values: float, g: int) -> float:
        return values * 2 * (g - 1) / g / bw + lat

    def worst(group: int) -> float:  # the most loaded rank: its stages' all-gathers, one after the other
        return max(sum(ring(sum(i.params for i in stages[s]), group) for _, s in sched.local_stages(r))
                   for r in range(4))

    assert param_gather_time(fsdp, H800, stages, sched) == pytest.approx(worst(2), rel=1e-12)  # dp, not copies x dp
    assert param_gather_time(zero1, H800, stages, sched) == pytest.approx(worst(2 * copies), rel=1e-12)
    assert param_gather_time(replace(fsdp, zero=0), H800, stages, sched) == 0.0
    # memory: the runtime keeps FSDP stages unsharded for the step, so the peak is ZeRO-1's
    a, b = estimate(llama, H800, zero1), estimate(llama, H800, fsdp)
    assert a.memory_gb == b.memory_gb


def test_fsdp_is_runnable_exactly_where_the_runtime_runs_it(llama, v3):
    dense = Strategy(4, "1f1b", 8, dp=2, zero=3)
    assert launch(dense)["dp_mode"] == "fsdp"
    assert unrunnable_reasons(dense) == [] and estimate(llama, H800, dense).runnable
    moe = Strategy(4, "1f1b", 8, ep=2, dp=4, zero=3)
    assert unrunnable_reasons(moe) == [
        "dp_mode 'fsdp' (zero 3) with ep 2 is not run by the runtime (with expert parallelism: allreduce, zero1, "
        "allreduce_bf16)"]
    # DeepSeek-V3's MTP ties the embedding of the first stage to the last: the runtime refuses fsdp there
    est = estimate(v3, H800, Strategy(16, "1f1b", 64, ep=1, dp=8, dtype="fp8", zero=3))
    assert est.tied_across_stages and est.unrunnable == [
        "dp_mode 'fsdp' (zero 3) cannot reduce weights tied across stages (the MTP module's embedding): the runtime "
        "refuses it (with tied weights: allreduce, zero1, allreduce_bf16)"]
    assert short_reason(est.unrunnable) == "no: dp_mode"
    assert estimate(v3, H800, Strategy(16, "1f1b", 64, ep=1, dp=8, dtype="fp8", zero=1)).runnable
    assert unrunnable_reasons(replace(dense, zero=2)) == ["zero 2 is not run by the runtime (runnable: 0, 1, 3)"]
    assert runnable_module.demo_command(launch(dense)) is None  # the demo's stages are not fully_shard-ed
    assert runnable_module.zero_from_config(2) == 1 and runnable_module.zero_from_config(3) == 3
    with pytest.raises(ValueError, match=r"^zero_state 4 is not a ZeRO stage; allowed: 0, 1, 2 \(run as 1\), 3$"):
        runnable_module.zero_from_config(4)
