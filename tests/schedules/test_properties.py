"""Property tests: random (schedule, P, M, costs) validate, lower, re-validate and simulate."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mt_dualpipe.schedules import (
    FB,
    Costs,
    ScheduleError,
    build_schedule,
    list_schedules,
    lower,
    simulate,
    validate,
    validate_program,
)

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- properties -----------------
@st.composite
def schedule_case(draw):
    names = [i.name for i in list_schedules() if i.name != "auto"]
    name = draw(st.sampled_from(names))
    P = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    M = draw(st.integers(1, 24))
    return name, P, M


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedule_case(), f=st.floats(0.1, 3), b=st.floats(0.1, 3), w=st.floats(0.0, 3), comm=st.floats(0, 1))
def test_property_valid_schedules_run(case, f, b, w, comm) -> None:
    name, P, M = case
    try:
        s = build_schedule(name, P, M)
    except ScheduleError as exc:  # a refusal must say why, never be an AssertionError
        assert str(exc)
        return
    validate(s)
    p = lower(s)
    validate_program(p)
    r = simulate(s, Costs(f, b, w, comm=comm))
    assert len(r.timeline) == s.num_ops()
    n_parts = sum(2 if type(i) is FB else 1 for ops in s.ranks for i in ops)
    assert n_parts == sum(len(s.placement[c]) for c in s.microbatch_chain) * 2 + sum(
        1 for ops in s.ranks for i in ops for q in ((i.f, i.b) if type(i) is FB else (i,)) if q.kind == "W")
    assert r.makespan >= max(r.busy) - 1e-9
    assert all(x >= -1e-9 for x in r.span_bubble)
