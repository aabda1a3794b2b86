"""Uneven micro-batches: per-micro-batch costs in the cost model and the simulator, the order a schedule
chooses (``Schedule.microbatch_order``), ``auto`` with uneven costs, token costs, and what is refused."""

from __future__ import annotations

import math
import random

import pytest

from mt_dualpipe.schedules import Costs, Schedule, ScheduleError, build_schedule, simulate, validate
from mt_dualpipe.schedules.auto import Layout, lower_bound
from mt_dualpipe.schedules.auto.order import candidates, improve_order, slot_costs
from mt_dualpipe.schedules.ir import FB, Op
from mt_dualpipe.schedules.ops import OpKind, op_cost
from mt_dualpipe.schedules.tokens import TokenCost, microbatch_costs
from tests.helpers.schedules import order_of

SKEWED = [1, 3, 1]
HAND = {"linear": ("1f1b", "zb-h1", "zb-h2", "gpipe"), "v": ("zbv", "dualpipev"), "dual": ("dualpipe",)}


def _ordered(name: str, P: int, M: int, order: tuple[int, ...] | None) -> Schedule:
    sched = build_schedule(name, P, M)
    sched.microbatch_order = order
    return sched


# ---------------------------------------------------------------- the simulator, by hand ---------
def test_gpipe_with_a_costly_microbatch_by_hand():
    # F costs 1, 3, 1; BW (b + w) 2, 6, 2. Rank 1: F's end 2, 7, 8; BW's 8-10, 10-16, 16-18.
    # Rank 0 runs each BW once rank 1's is done: 10-12, 16-22, 22-24.
    res = simulate(build_schedule("gpipe", 2, 3), Costs(1, 1, 1, mb_scale=SKEWED))
    assert res.makespan == 24
    assert [(e.rank, e.mb, e.start, e.end) for e in res.timeline if e.rank == 0 and e.op == "BW"] == \
        [(0, 0, 10, 12), (0, 1, 16, 22), (0, 2, 22, 24)]
    assert res.busy == [15, 15]  # F 1 + 3 + 1, BW 2 + 6 + 2


def test_weight_gradients_scale_apart():
    # mb_scale_w all 1: a BW is b * k + w, so 2, 4, 2; rank 1's BW's end 10, 14, 16 and rank 0's 12, 18, 20
    res = simulate(build_schedule("gpipe", 2, 3), Costs(1, 1, 1, mb_scale=SKEWED, mb_scale_w=[1, 1, 1]))
    assert res.makespan == 20


@pytest.mark.parametrize("order,makespan", [
    (None, 21),        # the costly micro-batch in the middle: F1 (3) overlaps rank 1's BW0, by hand
    ((1, 0, 2), 24),   # costliest first: everything waits for its forward, then for its backward
    ((0, 2, 1), 24),   # costliest last: its BW's run alone on both ranks
])
def test_1f1b_makespan_depends_on_which_slot_runs_the_costly_microbatch(order, makespan):
    res = simulate(_ordered("1f1b", 2, 3, order), Costs(1, 1, 1, mb_scale=SKEWED))
    assert res.makespan == makespan


def test_an_fb_unit_scales_each_half():
    sc = Costs(2, 3, 1, a2a_f=1, a2a_b=1, mb_scale=[1, 2], mb_scale_w=[1, 4]).per_stage(2)
    scales = sc.slot_scales(None, 2)
    f, b, bw = Op(OpKind.F, 0, 0, 0), Op(OpKind.B, 0, 1, 1), Op(OpKind.BW, 0, 1, 1)
    assert op_cost(f, sc, scales) == 3  # (f + a2a_f) * 1
    assert op_cost(b, sc, scales) == 8  # (b + a2a_b) * 2
    assert op_cost(bw, sc, scales) == 12  # (b + a2a_b) * 2 + w * 4
    assert op_cost(FB(f, b), sc, scales) == 2 + 3 * 2  # halves scaled, all-to-all hidden
    assert op_cost(FB(f, bw), sc, scales) == 2 + 3 * 2 + 1 * 4
    # with fb given the unit's time is split over its halves by their compute: 4.5 * (2, 3, 1) / 6
    fb = Costs(2, 3, 1, fb=4.5, mb_scale=[1, 2], mb_scale_w=[1, 4]).per_stage(2)
    assert op_cost(FB(f, bw), fb, fb.slot_scales(None, 2)) == pytest.approx(1.5 + 2.25 * 2 + 0.75 * 4)
    assert op_cost(FB(f, bw), fb) == 4.5  # no factors: the plain unit


def test_factors_of_one_change_nothing():
    for name in ("dualpipe", "zbv", "zb-h1"):
        sched = build_schedule(name, 4, 8)
        plain = simulate(sched, Costs(1, 2, 1, a2a_f=0.5, a2a_b=0.5, comm=0.2))
        ones = simulate(sched, Costs(1, 2, 1, a2a_f=0.5, a2a_b=0.5, comm=0.2, mb_scale=[1.0] * 8))
        assert ones.makespan == plain.makespan and ones.peak_activations == plain.peak_activations


def test_the_order_permutes_the_factors_it_reads():
    """Slot m costs what micro-batch order[m] costs: the same as giving the factors in slot order."""
    rng = random.Random(3)
    scale = [rng.choice([0.5, 1, 2, 4]) for _ in range(8)]
    for name in ("zb-h1", "dualpipe", "dualpipev"):
        order = tuple(rng.sample(range(8), 8))
        got = simulate(_ordered(name, 4, 8, order), Costs(1, 1, 1, a2a_f=0.5, mb_scale=scale))
        same = simulate(build_schedule(name, 4, 8), Costs(1, 1, 1, a2a_f=0.5, mb_scale=[scale[m] for m in order]))
        assert got.makespan == same.makespan and got.busy == same.busy


# ---------------------------------------------------------------- the order as data ---------------
def test_order_survives_json_and_maps_slots():
    sched = _ordered("zb-h1", 2, 4, (2, 0, 3, 1))
    back = Schedule.from_json(sched.to_json())
    assert back.microbatch_order == (2, 0, 3, 1)
    assert back.to_slots(["a", "b", "c", "d"]) == ["c", "a", "d", "b"]
    assert back.from_slots(back.to_slots(["a", "b", "c", "d"])) == ["a", "b", "c", "d"]
    assert [back.arrival_of(m) for m in range(4)] == [2, 0, 3, 1]
    assert "microbatch_order" not in build_schedule("zb-h1", 2, 4).to_dict()  # none: slot m runs micro-batch m
    costs = Costs(1, 2, 1, mb_scale=[1, 2, 3, 4])
    assert simulate(back, costs).makespan == simulate(sched, costs).makespan
    validate(back)


@pytest.mark.parametrize("order,message", [
    ([0, 1, 1, 2], r"name each micro-batch 0..3 once; missing \[3\]"),
    ([0, 1, 2], "microbatch_order has 3 entries, expected one per micro-batch \\(num_microbatches=4\\)"),
    ([0, 1, 2, 4], r"missing \[3\], out of range \[4\]"),
    ([0, 1, True, 2], "microbatch_order must hold integers"),
    ("0123", "microbatch_order must be a list of micro-batch indices"),
])
def test_bad_orders_are_refused(order, message):
    sched = build_schedule("zb-h1", 2, 4)
    data = sched.to_dict() | {"microbatch_order": order}
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_dict(data)
    with pytest.raises(ScheduleError, match=message):
        Schedule(sched.name, 2, 4, sched.placement, sched.microbatch_chain, sched.ranks, microbatch_order=order)


def test_slot_lists_of_the_wrong_length_are_refused():
    sched = _ordered("zb-h1", 2, 4, (1, 0, 2, 3))
    with pytest.raises(ScheduleError, match="got 3 micro-batches, the schedule runs 4"):
        sched.to_slots([1, 2, 3])
    with pytest.raises(ScheduleError, match="got 5 per-slot results, the schedule runs 4"):
        sched.from_slots([1, 2, 3, 4, 5])


@pytest.mark.parametrize("kwargs,message", [
    (dict(mb_scale=[1, -1]), r"costs.mb_scale must be finite non-negative numbers, got -1.0"),
    (dict(mb_scale=[1, math.nan]), "costs.mb_scale must be finite non-negative numbers, got nan"),
    (dict(mb_scale=[1, math.inf]), "costs.mb_scale must be finite non-negative numbers, got inf"),
    (dict(mb_scale=[]), "costs.mb_scale is empty; give one factor per micro-batch or None"),
    (dict(mb_scale=2.0), "costs.mb_scale must be a list with one factor per micro-batch, got 2.0"),
    (dict(mb_scale=["x"]), r"costs.mb_scale must hold numbers, got \['x'\]"),
    (dict(mb_scale_w=[1, 2]), r"costs.mb_scale_w needs costs.mb_scale with the same number of micro-batches \(0\)"),
    (dict(mb_scale=[1, 2], mb_scale_w=[1]), r"same number of micro-batches \(2\), got 1"),
])
def test_bad_factors_are_refused(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        Costs(1, 1, 1, **kwargs)


def test_factors_must_match_the_step():
    with pytest.raises(ScheduleError, match="costs.mb_scale has 3 factors but the schedule has 4 micro-batches"):
        simulate(build_schedule("zb-h1", 2, 4), Costs(mb_scale=[1, 2, 3]))
    with pytest.raises(ScheduleError, match="costs.mb_scale has 3 factors but the step has 4 micro-batches"):
        build_schedule("auto", 2, 4, costs=Costs(mb_scale=[1, 2, 3]))
    with pytest.raises(ScheduleError, match="solver='cpsat' models micro-batches of equal cost"):
        build_schedule("auto", 2, 4, costs=Costs(mb_scale=[1, 2, 3, 1]), solver="cpsat")


def test_costs_describe_and_scale_keep_the_factors():
    costs = Costs(1, 2, 1, mb_scale=[1, 2], mb_scale_w=[1, 1.5])
    assert costs.describe() == "F=1 B=2 W=1 mb_scale=[1,2] mb_scale_w=[1,1.5]"
    assert costs.scaled(0.5).mb_scale == (1.0, 2.0) and costs.scaled(0.5).f == 0.5
    assert costs.uneven and not Costs(mb_scale=[1, 1]).uneven and not Costs().uneven


# ---------------------------------------------------------------- auto -----------------------------
def _best_arrival(placement: str, P: int, M: int, costs: Costs, limit: int) -> float:
    """The fastest hand schedule of the placement in arrival order within ``limit``."""
    best = math.inf
    for name in HAND[placement]:
        try:
            res = simulate(build_schedule(name, P, M), costs)
        except ScheduleError:
            continue
        if max(res.peak_activations) <= limit:
            best = min(best, res.makespan)
    return best


def test_auto_orders_a_constructed_skew_better_than_arrival():
    # two costly micro-batches arrive first and last: in arrival order both are paid alone
    costs = Costs(1, 1, 1, mb_scale=[4, 1, 1, 1, 1, 1, 1, 4])
    sched = build_schedule("auto", 4, 8, costs=costs, placement="linear", memory_limit=4)
    arrival = _best_arrival("linear", 4, 8, costs, 4)
    assert arrival == 81  # zb-h1, by the simulator
    assert sched.meta["makespan"] == simulate(sched, costs).makespan < arrival
    assert sched.microbatch_order is not None and sorted(sched.microbatch_order) == list(range(8))
    assert sched.microbatch_order[0] not in (0, 7)  # a cheap micro-batch fills the pipeline
    assert max(simulate(sched, costs).peak_activations) <= 4
    assert sched.meta["lower_bound"] <= sched.meta["makespan"]
    info = sched.meta["microbatch_order"]
    assert info["order"] == list(sched.microbatch_order) and info["candidates"]["arrival"] == arrival
    back = Schedule.from_json(sched.to_json())
    assert back.microbatch_order == sched.microbatch_order and simulate(back, costs).makespan == sched.meta["makespan"]


@pytest.mark.parametrize("placement,P,M", [("linear", 3, 6), ("v", 2, 6), ("dual", 2, 6)])
def test_auto_is_never_worse_than_arrival_order(placement, P, M):
    rng = random.Random(P * 10 + M)
    for trial in range(3):
        scale = [round(rng.lognormvariate(0, 0.8), 2) for _ in range(M)]
        costs = Costs(1, 2, 1, a2a_f=0.5 * (trial % 2), a2a_b=0.5 * (trial % 2), mb_scale=scale)
        limit = {"linear": P, "v": 2 * P + 1, "dual": P + 1}[placement]
        sched = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=limit,
                               iterations=20, seed=trial)
        res = simulate(sched, costs)
        assert res.makespan == sched.meta["makespan"] <= _best_arrival(placement, P, M, costs, limit)
        assert max(res.peak_activations) <= limit
        assert sched.meta["lower_bound"] <= res.makespan
        validate(sched)


def test_auto_with_uneven_costs_is_deterministic():
    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1, mb_scale=[1, 2, 1, 3, 1, 1, 2, 1])
    one = build_schedule("auto", 2, 8, costs=costs, placement="v", iterations=10, seed=4)
    two = build_schedule("auto", 2, 8, costs=costs, placement="v", iterations=10, seed=4)
    assert one.ranks == two.ranks and one.microbatch_order == two.microbatch_order


def test_the_order_candidates_and_swaps():
    weight = [3.0, 1.0, 2.0, 5.0, 4.0]
    named = dict(candidates(weight))
    assert named["arrival"] == (0, 1, 2, 3, 4)
    assert named["cheapest first"] == (1, 2, 0, 4, 3)
    assert named["costliest first"] == (3, 4, 0, 2, 1)
    assert named["cheap ends"] == (1, 0, 3, 4, 2)  # cheapest at both ends, costliest in the middle
    assert named["alternating"] == (3, 1, 4, 2, 0)
    # swaps never make the given op order worse, and find the middle for the costly micro-batch of 1F1B
    layout = Layout.named("linear", 2, 3)
    sched = build_schedule("1f1b", 2, 3)
    costs = Costs(1, 1, 1, mb_scale=SKEWED)
    order, makespan = improve_order(layout, costs, [2, 2], [list(x) for x in sched.ranks], (1, 0, 2))
    assert makespan == 21 and order[1] == 1
    assert simulate(order_of(layout, sched.ranks), slot_costs(costs, order)).makespan == 21


def test_lower_bound_holds_for_every_order():
    rng = random.Random(1)
    for placement, P, M in (("linear", 3, 6), ("v", 2, 6), ("dual", 2, 6)):
        layout = Layout.named(placement, P, M)
        for _ in range(4):
            costs = Costs(1, 1.5, 1, a2a_f=0.5, a2a_b=0.5, comm=0.2,
                          mb_scale=[rng.choice([0.5, 1, 3]) for _ in range(M)])
            bound = lower_bound(layout, costs)
            hand = {"linear": "zb-h2", "v": "zbv", "dual": "dualpipe"}[placement]
            for _ in range(5):
                order = tuple(rng.sample(range(M), M))
                assert bound <= simulate(_ordered(hand, P, M, order), costs).makespan + 1e-9


# ---------------------------------------------------------------- token costs ----------------------
def test_token_cost_by_hand():
    cost = TokenCost(per_token=1.0, per_pair=0.01)
    # two sequences of 10 and 20 tokens: 30 tokens, 55 + 210 causal pairs
    assert cost.parts([10, 20]) == (30.0, 2.65)
    assert cost.times([10, 20]) == pytest.approx((32.65, 35.3, 30.0))
    costs = microbatch_costs([[10, 20], [30]], cost, comm=0.5)
    f = (32.65 + 30 + 4.65) / 2
    assert costs.f == pytest.approx(f) and costs.comm == 0.5
    assert costs.mb_scale == pytest.approx(((32.65 + 35.3) / (costs.f + costs.b), (34.65 + 39.3) / (costs.f + costs.b)))
    assert costs.mb_scale_w == (1.0, 1.0)  # both hold 30 tokens
    assert sum(costs.mb_scale) == pytest.approx(2)  # factors of the mean


@pytest.mark.parametrize("call,message", [
    (lambda: TokenCost(-1, 0), "TokenCost.per_token must be a non-negative number, got -1"),
    (lambda: TokenCost(1, 0).parts([3, -2]), "sequence lengths must be non-negative integers, got -2"),
    (lambda: microbatch_costs([], TokenCost(1, 0)), "microbatch_costs needs at least one micro-batch"),
    (lambda: microbatch_costs([[0]], TokenCost(1, 0)), "the micro-batches hold no tokens"),
])
def test_token_cost_errors(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()
