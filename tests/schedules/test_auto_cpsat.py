"""``auto`` with the exact CP-SAT backend: proved optima on small profiles, the heuristic close to them."""

from __future__ import annotations

import builtins
import random
import time

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, lower, simulate, validate
from mt_dualpipe.schedules.auto import HAND_SCHEDULES, Layout, lower_bound

pytest.importorskip("ortools")


def random_profile(seed: int, fb_pairing: bool = False) -> tuple[str, int, int, Costs]:
    """A small random problem: placement, P, M and per-stage costs on a 0.5 grid (exact for the solver)."""
    rng = random.Random(seed)
    placement = ("linear", "v", "dual")[seed % 3] if not fb_pairing else ("v", "dual")[seed % 2]
    P = rng.choice([2, 3]) if not fb_pairing else 2
    M = rng.choice([4, 6])
    S = 2 * P if placement == "v" else P

    def per() -> list[float]:
        return [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(S)]

    # exposed all-to-all makes FB units pay; without it they never beat F then B
    a2a = 0.5 if fb_pairing else (rng.choice([0.0, 0.5]) if placement == "linear" else 0.0)
    return placement, P, M, Costs(per(), per(), per(), comm=rng.choice([0.0, 0.5]), a2a_f=a2a, a2a_b=a2a)


def exposed_a2a_profile(seed: int) -> tuple[str, int, int, Costs]:
    """V or dual placement, P <= 4, M <= 8: exposed all-to-all (0.5 or 1.0 of F), often a heavy last
    stage (x1.5 or x2: head + loss) and latency; B and W per profile, on a 0.25 grid (exact for the solver)."""
    rng = random.Random(seed)
    placement = ("v", "dual")[seed % 2]
    P = rng.choice([2, 3, 4])
    M = rng.choice([4, 6, 8])
    S = 2 * P if placement == "v" else P
    f, b, w = [1.0] * S, [rng.choice([1.0, 1.5, 2.0])] * S, [rng.choice([0.5, 1.0])] * S
    if rng.random() < 0.6:
        k = rng.choice([1.5, 2.0])
        f, b, w = (x[:-1] + [x[-1] * k] for x in (f, b, w))
    a2a = rng.choice([0.5, 1.0])
    return placement, P, M, Costs(f, b, w, comm=rng.choice([0.0, 0.0, 0.5]), a2a_f=a2a, a2a_b=a2a)


EXPOSED_A2A_SEEDS = [2, 5, 6, 7, 13, 18, 22, 9]
"""Profiles of ``exposed_a2a_profile`` whose optimum CP-SAT proves in a few seconds and that the
heuristic of an earlier version missed by 0.8-5.3 % (docs/schedules.md, the auto section); 9 (dual, P = 3,
M = 8: no hand schedule to start from) was missed by 5.7 % until the per-stage warm-up caps."""
def best_hand(placement: str, P: int, M: int, costs: Costs, limit: int) -> float:
    runs = []
    for name in HAND_SCHEDULES[placement]:
        try:
            res = simulate(build_schedule(name, P, M), costs)
        except ScheduleError:
            continue
        if max(res.peak_activations) <= limit:
            runs.append(res.makespan)
    return min(runs, default=float("inf"))  # inf: no hand schedule builds for (P, M)


def check_exact(placement: str, P: int, M: int, costs: Costs):
    exact = build_schedule("auto", P, M, costs=costs, placement=placement, solver="cpsat", time_limit=30)
    meta = exact.meta
    assert meta["solver_status"] == "OPTIMAL" and meta["optimal"] is True and meta["gap"] == 0.0
    res = simulate(exact, costs)  # re-checked by the simulator
    validate(exact)
    assert res.makespan == pytest.approx(meta["makespan"]) == pytest.approx(meta["lower_bound"])
    assert max(res.peak_activations) <= meta["memory_limit"]
    assert res.makespan >= lower_bound(Layout.named(placement, P, M), costs) - 1e-9
    assert res.makespan <= best_hand(placement, P, M, costs, meta["memory_limit"]) + 1e-9
    return exact, res.makespan


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_proves_small_random_profiles_and_heuristic_is_within_2_percent(seed):
    placement, P, M, costs = random_profile(seed)
    _, optimum = check_exact(placement, P, M, costs)
    heuristic = build_schedule("auto", P, M, costs=costs, placement=placement)
    assert optimum - 1e-9 <= heuristic.meta["makespan"] <= 1.02 * optimum


FB_PAIRING_PROFILES = [0, 1, 3, 5]
"""``random_profile(100 + k, fb_pairing=True)`` for these k: CP-SAT proves each in a second or two."""


@pytest.mark.parametrize("seed", FB_PAIRING_PROFILES)
def test_cpsat_proves_fb_pairing_profiles(seed):
    """Exposed all-to-all on V and dual placements: FB units pay, and the optimum uses them."""
    placement, P, M, costs = random_profile(100 + seed, fb_pairing=True)
    exact, optimum = check_exact(placement, P, M, costs)
    assert any(item.kind == "FB" for ops in exact.ranks for item in ops)
    assert optimum == FB_PAIRING_OPTIMA[seed]  # what the heuristic's test below compares with


FB_PAIRING_OPTIMA = {0: 42.5, 1: 17.5, 3: 24.5, 5: 22.0}
"""The proved optima of the ``FB_PAIRING_PROFILES`` (``test_cpsat_proves_fb_pairing_profiles`` proves them)."""


def test_heuristic_within_2_percent_of_fb_pairing_optima_in_18_of_20_runs():
    """The heuristic on the FB-pairing profiles over five seeds: a randomised search lands one cost
    step above the optimum on some seeds of a 48-op V profile (profile 0: 2.35 % above it on 2 of 5
    seeds, 2 of 10 over seeds 0-9; docs/schedules.md), so the claim is a rate, and never more than one step."""
    within = 0
    for k in FB_PAIRING_PROFILES:
        placement, P, M, costs = random_profile(100 + k, fb_pairing=True)
        optimum = FB_PAIRING_OPTIMA[k]
        for seed in range(5):
            got = build_schedule("auto", P, M, costs=costs, placement=placement, seed=seed).meta["makespan"]
            assert optimum - 1e-9 <= got <= optimum + 1.0 + 1e-9
            within += got <= 1.02 * optimum + 1e-9
    assert within >= 18


@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if i < 2 else pytest.mark.slow)
                                  for i, s in enumerate(EXPOSED_A2A_SEEDS)])
def test_heuristic_within_2_percent_of_proved_optimum_with_exposed_all_to_all(seed):
    """The issue's test on V and dual placements where FB units hide the all-to-all and the last stage is heavy."""
    placement, P, M, costs = exposed_a2a_profile(seed)
    _, optimum = check_exact(placement, P, M, costs)
    heuristic = build_schedule("auto", P, M, costs=costs, placement=placement)
    validate(heuristic)
    lower(heuristic)
    assert heuristic.meta["makespan"] == simulate(heuristic, costs).makespan
    assert optimum - 1e-9 <= heuristic.meta["makespan"] <= 1.02 * optimum


def test_pairing_window_bound_is_the_proved_optimum():
    """The worked case of ``test_pairing_window_bound`` (tests/schedules/test_auto.py): bound 23, optimum 23."""
    costs = Costs([1, 2], [1, 2], [1, 2], a2a_f=1, a2a_b=1, comm=1)
    exact, optimum = check_exact("dual", 2, 4, costs)
    assert optimum == 23.0 == lower_bound(Layout.named("dual", 2, 4), costs)


def test_time_limit_is_honoured_and_gap_reported():
    costs = Costs(1, 1, 1, a2a_f=1.0, a2a_b=1.0)
    t0 = time.perf_counter()
    sched = build_schedule("auto", 4, 16, costs=costs, placement="v", memory_limit=9, iterations=10,
                           solver="cpsat", time_limit=2)
    took = time.perf_counter() - t0
    meta = sched.meta
    assert meta["solver_seconds"] <= 2.0 + 1.5  # the solver stops at the limit (model building counts towards it)
    assert took < 2.0 + 15.0  # plus the heuristic that runs first
    assert meta["optimal"] is False and 0.0 < meta["gap"] < 1.0
    assert meta["lower_bound"] < meta["makespan"] == simulate(sched, costs).makespan
    assert meta["makespan"] <= best_hand("v", 4, 16, costs, 9)


def test_deterministic_for_a_seed():
    """The solver's result for a seed does not vary (its warm start from a short heuristic run included)."""
    placement, P, M, costs = random_profile(100, fb_pairing=True)
    opts = dict(costs=costs, placement=placement, solver="cpsat", time_limit=30, iterations=15)
    a = build_schedule("auto", P, M, **opts)
    b = build_schedule("auto", P, M, **opts)
    assert a.ranks == b.ranks


def test_without_ortools_cpsat_raises_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_ortools(name, *args, **kwargs):
        if name == "ortools" or name.startswith("ortools."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ortools)
    with pytest.raises(ScheduleError) as err:
        build_schedule("auto", 2, 4, solver="cpsat")
    assert str(err.value) == "solver='cpsat' needs OR-Tools: pip install mt_dualpipe[solver]"
    assert build_schedule("auto", 2, 4, iterations=0).meta["solver"] == "heuristic"  # the default still runs


@pytest.mark.parametrize("kwargs,message", [
    (dict(solver="milp"), "unknown solver 'milp'; allowed: heuristic, cpsat"),
    (dict(solver="cpsat", time_limit=0), "time_limit must be a positive number of seconds or None, got 0"),
])
def test_bad_solver_options(kwargs, message):
    with pytest.raises(ScheduleError) as err:
        build_schedule("auto", 2, 4, **kwargs)
    assert str(err.value) == message


def test_heuristic_meta_reports_bound_and_gap():
    tight = build_schedule("auto", 4, 8, costs=Costs(1, 1, 1), iterations=5).meta
    assert tight["optimal"] is True and tight["gap"] == 0.0 and tight["lower_bound"] == tight["makespan"] == 27.0
    loose = build_schedule("auto", 4, 8, costs=Costs(1, 1, 1, a2a_f=1, a2a_b=1), placement="v", iterations=5).meta
    assert loose["optimal"] is False
    assert loose["gap"] == pytest.approx((loose["makespan"] - loose["lower_bound"]) / loose["makespan"])


def test_recompute_costs_reach_the_model_and_the_bound():
    """``Costs.recompute`` (added to every B) is read from ``ops``: the model, the bound and the simulator agree."""
    plain = Costs([1.0, 1.5, 1.0], 1, 0.5, comm=0.5)
    heavy = Costs([1.0, 1.5, 1.0], 1, 0.5, comm=0.5, recompute=0.5)
    exact = build_schedule("auto", 3, 4, costs=heavy, solver="cpsat", time_limit=30)
    assert exact.meta["optimal"] is True
    assert simulate(exact, heavy).makespan == exact.meta["makespan"] >= lower_bound(Layout.named("linear", 3, 4), heavy)
    assert lower_bound(Layout.named("linear", 3, 4), heavy) > lower_bound(Layout.named("linear", 3, 4), plain)
