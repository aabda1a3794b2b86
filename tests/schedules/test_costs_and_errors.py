"""Schedule parameter errors and the cost model (per-stage costs, latency, all-to-all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_dualpipe.schedules import (
    Costs,
    Op,
    ScheduleError,
    build_schedule,
    simulate,
)
from tests.helpers.schedules import unit

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- parameter errors -------------
@pytest.mark.parametrize("name,P,M,opts,message", [
    ("dualpipe", 5, 20, {}, "dualpipe needs an even number of ranks, got 5"),
    ("dualpipe", 4, 9, {}, "even number of micro-batches"),
    ("dualpipe", 4, 6, {}, "at least 2\\*num_ranks = 8 micro-batches, got 6"),
    ("dualpipev", 4, 7, {}, "at least 2\\*num_ranks = 8 micro-batches, got 7"),
    ("dualpipe", 0, 8, {}, "num_ranks must be at least 1, got 0"),
    ("dualpipe", 4, 2.5, {}, "num_microbatches must be an integer, got 2.5"),
    ("dualpipe", 4, 8, {"virtual_stages": 2}, "unknown option\\(s\\) virtual_stages; it takes no options"),
    ("nope", 4, 8, {}, "unknown schedule 'nope'; available: .*dualpipe"),
])
def test_bad_parameters(name: str, P: object, M: object, opts: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, P, M, **opts)


def test_bad_costs() -> None:
    s = build_schedule("dualpipev", 2, 4)
    with pytest.raises(ScheduleError, match="costs.f has 3 per-stage values but the chain has 4 stages"):
        simulate(s, Costs(f=[1, 1, 1]))
    with pytest.raises(ScheduleError, match="costs.b must be non-negative"):
        simulate(s, Costs(b=-1))
    with pytest.raises(ScheduleError, match="--costs takes 3 to 5 numbers"):
        Costs.parse("1,2")
    with pytest.raises(ScheduleError, match="--costs must be numbers"):
        Costs.parse("1,x,2")


def test_per_stage_costs_heavier_last_stage() -> None:
    s = build_schedule("dualpipev", 2, 4)
    base = simulate(s, unit())
    heavy = simulate(s, Costs(f=[1, 1, 1, 2], b=[1, 1, 1, 2], w=1))
    assert heavy.busy[0] == base.busy[0] + 2 * 4  # stage 3 lives on rank 0; +1 F and +1 B per micro-batch
    assert heavy.busy[1] == base.busy[1]


def test_comm_latency_and_a2a() -> None:
    s = build_schedule("dualpipe", 4, 8)
    base = simulate(s, unit())
    slow = simulate(s, Costs(1, 1, 1, comm=0.5))
    assert slow.makespan > base.makespan and slow.busy == base.busy
    a2a = simulate(s, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5))
    lone_f = sum(1 for ops in s.ranks[:1] for i in ops if type(i) is Op and i.kind == "F")
    lone_b = sum(1 for ops in s.ranks[:1] for i in ops if type(i) is Op and i.kind in ("B", "BW"))
    assert a2a.busy[0] == pytest.approx(base.busy[0] + 0.5 * (lone_f + lone_b))
