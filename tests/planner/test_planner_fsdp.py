"""The planner's FSDP (ZeRO-3, dp_mode ``fsdp``) costs, in numbers small enough to check by hand.

The runtime keeps an FSDP stage unsharded for the whole step (``parallel/fsdp.py``): the all-gather
of its parameters runs before the step's first op, the gradients are reduce-scattered at the stage's
REDUCE_GRAD, and the optimizer steps this rank's shard. So the planner counts: memory as ZeRO-1
(whole weights and gradients, optimizer state / dp), one reduce-scatter per stage inside the
schedule (an all-reduce over both copies of a mirrored stage), and one exposed all-gather a step.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy, SystemSpec, estimate
from mt_dualpipe.planner.dp_sync import param_gather_time, stage_sync_times
from mt_dualpipe.planner.estimate import memory_breakdown, stage_items
from mt_dualpipe.planner.model import Item
from mt_dualpipe.schedules import add_grad_reduction, build_schedule, simulate

# one link inside a node: 1e9 bytes/s, 1 us latency (latency_us / 2 inside a node)
TOY = SystemSpec("toy", gpu_memory_gb=80.0, tflops_bf16=100.0, tflops_fp8=200.0, intra_gbs=1.0,
                 intra_efficiency=1.0, latency_us=2.0)
# two stages of 1e9 and 3e9 dense parameters (BF16 on the wire: 2 bytes a value)
STAGES = [[Item("s0", 1e9, 0.0, 0.0, 0.0, 0.0)], [Item("s1", 3e9, 0.0, 0.0, 0.0, 0.0)]]


def _toy(schedule: str, zero: int) -> Strategy:
    return Strategy(2, schedule, 4, dp=4, zero=zero)


@pytest.mark.parametrize("zero,sync,gather", [
    # ring reduce-scatter over dp = 4: 2 bytes x values x 3/4 / 1e9 + 1e-6 per stage
    (3, [1.500001, 4.500001], 4.500001),   # fsdp: rank 1's stage all-gathered once a step, before its first F
    (1, [1.500001, 4.500001], 4.500001),   # zero1: the same reduce-scatter, its all-gather after the step
    (0, [3.000002, 9.000002], 0.0),        # allreduce: two passes, nothing to gather
])
def test_linear_schedule_sync_and_gather_by_hand(zero, sync, gather):
    st, sched = _toy("1f1b", zero), build_schedule("1f1b", 2, 4)
    assert stage_sync_times(st, TOY, STAGES, sched) == pytest.approx(sync, rel=1e-12)
    assert param_gather_time(st, TOY, STAGES, sched) == pytest.approx(gather, rel=1e-12)


@pytest.mark.parametrize("zero,sync,gather", [
    # both copies x 4 replicas = 8 ranks (one node); FSDP all-reduces them: 2 x (2 x values x 7/8 / 1e9 + 1e-6)
    (3, [3.500002, 10.500002], 6.000002),  # gather: each copy over its own dp = 4, rank 0 holds stages 0 and 1
    (1, [1.750001, 5.250001], 7.000002),   # zero1: one reduce-scatter over 8, its all-gather over 8 too
])
def test_mirrored_dualpipe_sync_and_gather_by_hand(zero, sync, gather):
    st, sched = _toy("dualpipe", zero), build_schedule("dualpipe", 2, 4)
    assert stage_sync_times(st, TOY, STAGES, sched) == pytest.approx(sync, rel=1e-12)
    assert param_gather_time(st, TOY, STAGES, sched) == pytest.approx(gather, rel=1e-12)


@pytest.mark.parametrize("zero,optimizer", [(3, 9.0), (1, 9.0), (0, 36.0)])
def test_memory_terms_by_hand(zero, optimizer):
    # stage 1: 3e9 parameters; BF16 weights (2 B), FP32 gradients (4 B), FP32 master + two moments (12 B)
    mem = memory_breakdown(_toy("1f1b", zero), STAGES, [1], 0.0)
    assert mem == pytest.approx({"weights": 6.0, "gradients": 12.0, "optimizer": optimizer, "activations": 0.0,
                                 "total": 18.0 + optimizer}, rel=1e-12)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "llama2-7b.json"
    path.write_text(json.dumps({"model_name": "llama2-7b", "hidden_size": 4096, "num_layers": 32,
                                "ffn_hidden_size": 11008, "vocab_size": 32000, "num_attention_heads": 32}))
    return ModelSpec.load(str(path))


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
def test_step_is_the_simulated_reduce_scatter_plus_one_exposed_gather(llama, schedule):
    h800 = PRESETS["h800"]
    st = Strategy(4, schedule, 8, dp=2, zero=3)
    est = estimate(llama, h800, st)
    plain = build_schedule(schedule, 4, 8)
    gather = param_gather_time(st, h800, stage_items(llama, st, h800), plain)
    assert gather > 0
    makespan = simulate(add_grad_reduction(plain), est.costs).makespan
    assert est.step_time - est.optimizer_time == pytest.approx(makespan + gather, rel=1e-12)
    total = max(sum(est.costs.dp_sync[s] for _, s in plain.local_stages(r)) for r in range(4)) + gather
    assert est.dp_sync_total == pytest.approx(total, rel=1e-12)
    zero1 = estimate(llama, h800, replace(st, zero=1))
    assert est.memory_gb == zero1.memory_gb and est.per_rank_gb == zero1.per_rank_gb
    if schedule == "1f1b":  # one copy of each stage: FSDP moves exactly what ZeRO-1 moves
        assert est.step_time == zero1.step_time and est.dp_sync_total == zero1.dp_sync_total
    else:  # mirrored stages: FSDP all-reduces (two passes) where ZeRO-1 reduce-scatters
        assert est.dp_sync_total > zero1.dp_sync_total
