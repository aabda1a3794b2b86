"""An ``auto`` schedule runs on the runtime like any other: gradients equal a single-process reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mt_dualpipe.runtime.modules")

from mt_dualpipe.schedules import Costs, build_schedule, simulate  # noqa: E402
from mt_dualpipe.schedules.ir import FB, compute_parts  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402
from tests.helpers.models import check_against_reference, make_data, make_layers, pipeline_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("placement,solver", [("v", "heuristic"), ("dual", "heuristic"), ("dual", "cpsat")])
def test_auto_schedule_trains_like_the_reference(placement, solver):
    if solver == "cpsat":
        pytest.importorskip("ortools")
    P, M = 2, 8 if solver == "heuristic" else 6
    S = 2 * P if placement == "v" else P
    # exposed all-to-all makes FB units pay; a heavier last stage makes the order non-standard
    costs = Costs([1.0] * (S - 1) + [2.0], 1.0, 0.5, a2a_f=1.5, a2a_b=1.5, comm=0.1)
    sched = build_schedule("auto", P, M, costs=costs, placement=placement, time_budget=None, iterations=20,
                           solver=solver, time_limit=30)
    kinds = {p.kind for ops in sched.ranks for item in ops for p in compute_parts(item)}
    if placement != "linear":
        assert any(type(item) is FB for ops in sched.ranks for item in ops), "expected overlapped FB units"
    assert "F" in kinds
    layers = make_layers(S)
    x, labels = make_data(M)
    results = run_ranks(pipeline_worker, P, sched, layers, x, labels, timeout=120)
    check_against_reference(sched, results, layers, x, labels)
    sim = simulate(sched, costs)
    assert [res["peak"] for res in results] == sim.peak_activations
