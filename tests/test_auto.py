"""The ``auto`` schedule: never worse than the hand schedules, memory limit kept, valid, deterministic."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mt_dualpipe.schedules import (
    Costs,
    Schedule,
    ScheduleError,
    build_schedule,
    list_schedules,
    lower,
    simulate,
    validate,
    validate_program,
)
from mt_dualpipe.schedules.auto import (
    HAND_SCHEDULES,
    Policy,
    _Layout,
    evaluate,
    list_schedule,
    lower_bound,
    make_layout,
)
from mt_dualpipe.schedules.simulate import run_schedule

FAST = dict(time_budget=None, iterations=15)


def best_hand(placement: str, P: int, M: int, costs: Costs, limit: int) -> float | None:
    best = None
    for name in HAND_SCHEDULES[placement]:
        try:
            res = simulate(build_schedule(name, P, M), costs)
        except ScheduleError:
            continue
        if max(res.peak_activations) <= limit and (best is None or res.makespan < best):
            best = res.makespan
    return best


def test_registered():
    assert "auto" in {i.name for i in list_schedules()}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement=st.sampled_from(["linear", "v", "dual"]), P=st.sampled_from([2, 4]), extra=st.integers(0, 4),
       data=st.data())
def test_never_worse_than_best_hand_schedule(placement, P, extra, data):
    M = 2 * P + 2 * extra
    S = 2 * P if placement == "v" else P
    per = st.lists(st.floats(0.2, 3.0), min_size=S, max_size=S)
    costs = Costs(f=data.draw(per), b=data.draw(per), w=data.draw(per),
                  comm=data.draw(st.sampled_from([0.0, 0.1, 0.5])),
                  a2a_f=data.draw(st.sampled_from([0.0, 0.5])), a2a_b=data.draw(st.sampled_from([0.0, 0.5])))
    sched = build_schedule("auto", P, M, costs=costs, placement=placement, **FAST)
    res = simulate(sched, costs)  # raises on deadlock
    limit = sched.meta["memory_limit"]
    assert max(res.peak_activations) <= limit
    hand = best_hand(placement, P, M, costs, limit)
    assert hand is not None
    assert res.makespan <= hand + 1e-9
    assert res.makespan >= sched.meta["lower_bound"] - 1e-9
    assert res.makespan == pytest.approx(sched.meta["makespan"])


@pytest.mark.parametrize("placement,limit", [("linear", 1), ("linear", 2), ("linear", 3), ("linear", 6),
                                             ("v", 2), ("v", 5), ("dual", 1), ("dual", 3)])
def test_memory_limit_respected(placement, limit):
    P, M = 4, 8
    costs = Costs([1, 1, 1, 2] if placement != "v" else 1, 1, 1, comm=0.2)
    sched = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=limit, **FAST)
    res = simulate(sched, costs)
    assert max(res.peak_activations) <= limit
    validate(sched)


def test_per_rank_memory_limit():
    limits = [4, 3, 2, 2]
    sched = build_schedule("auto", 4, 8, costs=Costs(1, 1, 1), memory_limit=limits, **FAST)
    peaks = simulate(sched, Costs(1, 1, 1)).peak_activations
    assert all(p <= lim for p, lim in zip(peaks, limits))


def test_default_memory_limit_is_leanest_hand_schedule():
    assert build_schedule("auto", 4, 8, placement="linear", **FAST).meta["memory_limit"] == 4  # 1f1b / zb-h1
    assert build_schedule("auto", 4, 8, placement="v", **FAST).meta["memory_limit"] == 8  # zbv
    assert build_schedule("auto", 4, 8, placement="dual", **FAST).meta["memory_limit"] == 5  # dualpipe, P+1


@pytest.mark.parametrize("placement", ["linear", "v", "dual"])
def test_result_is_an_ordinary_schedule(placement):
    costs = Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5)
    sched = build_schedule("auto", 4, 8, costs=costs, placement=placement, **FAST)
    assert isinstance(sched, Schedule) and sched.name == "auto"
    validate(sched)
    validate_program(lower(sched))
    again = Schedule.from_json(sched.to_json())
    assert again.ranks == sched.ranks and again.placement == sched.placement
    assert simulate(again, costs).makespan == simulate(sched, costs).makespan
    meta = sched.meta
    assert meta["placement"] == placement and meta["seed"] == 0
    assert set(meta["baselines"]) <= set(HAND_SCHEDULES[placement]) and meta["baselines"]


def test_deterministic_for_a_seed():
    costs = Costs([1, 1.2, 0.8, 2], 1, [0.5, 1, 1, 1], comm=0.15)
    a = build_schedule("auto", 4, 10, costs=costs, seed=3, time_budget=None, iterations=40)
    b = build_schedule("auto", 4, 10, costs=costs, seed=3, time_budget=None, iterations=40)
    assert a.ranks == b.ranks


@pytest.mark.parametrize("placement,costs,hand", [
    # a heavy last stage (head + loss + MTP) in a V: rank 0 holds the first and the last stage
    ("v", Costs([1.0] * 7 + [2.0], [1.0] * 7 + [2.0], [1.0] * 7 + [2.0]), "zbv"),
    # an embedding-heavy first stage
    ("v", Costs([1.5] + [1.0] * 7, 1, 1), "zbv"),
    # DualPipe's two chains with uniform costs: the search closes DualPipe's bubble
    ("dual", Costs(1, 1, 1), "dualpipe"),
    # point-to-point latency
    ("dual", Costs(1, 1, 1, comm=0.3), "dualpipe"),
])
def test_beats_hand_schedules_on_non_uniform_costs(placement, costs, hand):
    P, M = 4, 8
    sched = build_schedule("auto", P, M, costs=costs, placement=placement, time_budget=None, iterations=30)
    got = simulate(sched, costs)
    ref = simulate(build_schedule(hand, P, M), costs)
    assert max(got.peak_activations) <= max(ref.peak_activations)
    assert got.makespan < ref.makespan - 1e-9


def test_uniform_linear_reaches_the_lower_bound():
    sched = build_schedule("auto", 4, 8, costs=Costs(1, 1, 1), **FAST)
    assert simulate(sched).makespan == 27.0 == sched.meta["lower_bound"]  # zb-h1's 3M + P - 1


def test_lower_bound_values():
    place, chains = make_layout("linear", 4, 8)
    assert lower_bound(place, chains, Costs(1, 1, 1)) == 27.0  # last rank: 3 forwards to wait + 24 of work
    assert lower_bound(place, chains, Costs(1, 1, 1, comm=0.5)) == 28.5
    assert lower_bound(place, chains, Costs(1, 1, 1, a2a_f=1, a2a_b=1)) == 46.0  # 3 x (F + a2a) + 8 x 5
    assert simulate(build_schedule("zb-h2", 4, 8), Costs(1, 1, 1, a2a_f=1, a2a_b=1)).makespan == 46.0  # tight
    place, chains = make_layout("dual", 8, 24)
    assert lower_bound(place, chains, Costs(1, 1, 1)) == 75.0  # 72 of work + a 3-forward start-up


def test_evaluator_matches_simulator():
    rng = random.Random(1)
    for placement in ("linear", "v", "dual"):
        P, M = 4, 8
        place, chains = make_layout(placement, P, M)
        layout = _Layout(place, chains, P)
        S = layout.S
        for trial in range(6):
            costs = Costs([rng.uniform(0.2, 2) for _ in range(S)], [rng.uniform(0.2, 2) for _ in range(S)],
                          [rng.uniform(0.2, 2) for _ in range(S)], comm=rng.choice([0.0, 0.3]),
                          a2a_f=rng.choice([0.0, 0.7]), a2a_b=0.2)
            sc = costs.per_stage(S)
            pol = Policy(b_first=bool(trial % 2), split=trial % 3 != 0, pair=placement != "linear",
                         reserve=True, deep_first=trial < 3)
            ranks = list_schedule(layout, sc, [2 * S] * P, pol, random.Random(trial), 0.2)
            assert ranks is not None
            makespan, ends, peaks = evaluate(layout, sc, ranks)
            ref = run_schedule(Schedule("x", P, M, place, chains, ranks), costs, record=False)
            assert makespan == pytest.approx(ref.makespan)
            assert peaks == ref.peak_activations


def test_evaluator_detects_deadlock():
    place, chains = make_layout("linear", 2, 1)
    layout = _Layout(place, chains, 2)
    from mt_dualpipe.schedules.ir import Op
    ranks = [[Op("BW", 0, 0, 0), Op("F", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]]
    assert evaluate(layout, Costs().per_stage(2), ranks) is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(placement="zigzag"), "unknown placement 'zigzag'; allowed: linear, v, dual"),
    (dict(memory_limit=0), "memory_limit must be at least 1"),
    (dict(memory_limit=[4, 4]), "memory_limit has 2 values, expected one per rank (4)"),
    (dict(placement="v", memory_limit=1), "needs 2 activation slot(s) on one rank; allowed: >= 2"),
    (dict(costs=(1, 1, 1)), "costs must be a mt_dualpipe.schedules.Costs"),
    (dict(time_budget=-1), "time_budget must be a positive number"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(costs=Costs([1, 2], 1, 1)), "costs.f has 2 per-stage values but the chain has 4 stages"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ScheduleError) as err:
        build_schedule("auto", 4, 8, **kwargs)
    assert message in str(err.value)


def test_time_budget_bounds_the_search():
    import time

    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    t0 = time.perf_counter()
    sched = build_schedule("auto", 16, 64, costs=costs, placement="dual", time_budget=0.3)
    took = time.perf_counter() - t0
    assert sched.meta["stopped_by_time_budget"] is True
    assert took < 3.0  # the budget plus at most one walk and the hand schedules' simulation
    assert simulate(sched, costs).makespan <= simulate(build_schedule("dualpipe", 16, 64), costs).makespan
