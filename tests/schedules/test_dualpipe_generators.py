"""DualPipe and DualPipeV generators: golden reference orders, figures, formulas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mt_dualpipe.schedules import (
    Costs,
    Schedule,
    build_schedule,
    simulate,
    validate,
)
from mt_dualpipe.schedules.ir import schedule_to_dict
from tests.helpers.schedules import unit

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- DualPipe / DualPipeV --------
@pytest.mark.parametrize("name,P,M", [("dualpipe", 8, 20), ("dualpipev", 4, 10)])
def test_matches_reference_order(name: str, P: int, M: int) -> None:
    golden = GOLDEN / f"{name}_P{P}_M{M}.json"
    if not golden.exists():
        pytest.skip(f"golden file {golden} not present")
    expected = json.loads(golden.read_text())
    assert schedule_to_dict(build_schedule(name, P, M)) == expected
    # and the golden file itself parses, validates and simulates to the documented figures
    s = Schedule.from_json(golden.read_text())
    validate(s)
    r = simulate(s, unit())
    assert r.makespan == 66 and r.busy == [60] * P and max(r.peak_activations) == 9


def test_dualpipe_p8_m20_figures() -> None:
    r = simulate(build_schedule("dualpipe", 8, 20), unit())
    assert r.makespan == 66
    assert r.busy == [60] * 8
    assert r.makespan_bubble == [6] * 8
    assert r.bubble_rate == pytest.approx(6 / 66)
    assert r.peak_activations == [9] * 8
    assert r.span_bubble == [6, 5, 4, 3, 3, 4, 5, 6]


@pytest.mark.parametrize("P", [2, 4, 8, 16])
@pytest.mark.parametrize("extra", [0, 2, 6])
def test_dualpipe_formula(P: int, extra: int) -> None:
    M = 2 * P + extra
    r = simulate(build_schedule("dualpipe", P, M), unit())
    FBc, BW, W = 3, 2, 1
    bubble = (P // 2 - 1) * (FBc + BW - 3 * W)
    assert r.busy == [3 * M] * P
    assert r.makespan == 3 * M + bubble
    assert r.peak_activations == [P + 1] * P


@pytest.mark.parametrize("P", [2, 4, 8, 16])
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_dualpipev_formula(P: int, extra: int) -> None:
    M = 2 * P + extra
    r = simulate(build_schedule("dualpipev", P, M), unit())
    S = 2 * P
    assert r.busy == [6 * M] * P
    assert r.makespan == 6 * M + (S // 2 - 1) * (3 + 2 - 3)
    assert max(r.peak_activations) == S + 1


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (2, 3, 1), (1, 1, 0.5)])
def test_dualpipe_bubble_nonuniform(f: float, b: float, w: float) -> None:
    P, M = 8, 20
    r = simulate(build_schedule("dualpipe", P, M), Costs(f, b, w))
    fb, bw = f + b + w, b + w
    # the paper's closed form is exact for uniform costs and an upper bound otherwise
    assert r.makespan - r.busy[0] <= (P // 2 - 1) * (fb + bw - 3 * w) + 1e-9
    assert r.makespan - r.busy[0] >= (P // 2 - 1) * (fb + bw - 3 * w) - max(b, f)


def test_dualpipev_p4_m8() -> None:
    r = simulate(build_schedule("dualpipev", 4, 8), unit())
    assert (r.makespan, max(r.peak_activations)) == (54, 9)


def test_dualpipe_placement_and_chains() -> None:
    s = build_schedule("dualpipe", 4, 8)
    assert s.placement == ((0, 1, 2, 3), (3, 2, 1, 0))
    assert s.microbatch_chain == (0, 0, 0, 0, 1, 1, 1, 1)
    assert s.local_stages(1) == [(0, 1), (1, 2)]
    assert s.local_stages(3) == [(0, 3), (1, 0)]
