"""The single-chain generators (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv) against docs/schedules.md.

Pure Python, no torch: every figure is simulated from the generated orders, never copied from them.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, simulate
from mt_dualpipe.schedules.ir import compute_parts

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv"]
SPLIT = {"zb-h1", "zb-h2", "zbv"}  # schedules that run B and W separately
RANKS = [2, 4, 8, 16]


def sizes(name: str) -> list[tuple[int, int]]:
    """(P, M) pairs with M >= 2P that the schedule accepts."""
    out = []
    for P in RANKS:
        extra = [] if name == "interleaved-1f1b" else [2 * P + 1]
        out += [(P, M) for M in [2 * P, 3 * P, 4 * P] + extra]
    return out


def cases(name: str) -> list:
    return [pytest.param(P, M, id=f"P{P}-M{M}") for P, M in sizes(name)]


def sim(name: str, P: int, M: int, costs: Costs | None = None, **options):
    return simulate(build_schedule(name, P, M, **options), costs or Costs(1, 1, 1))


# ----- the worked values of docs/schedules.md ---------------------------------------------------------

@pytest.mark.parametrize("name, P, M, makespan, peak", [
    ("gpipe", 4, 8, 33, 8),
    ("1f1b", 4, 8, 33, 4),
    ("interleaved-1f1b", 4, 8, 57, 11),
    ("zb-h1", 4, 8, 27, 4),
    ("zb-h1", 8, 16, 55, 8),
    ("zbv", 4, 8, 51, 8),
    ("zbv", 4, 16, 99, 8),
    ("zbv", 4, 32, 195, 8),
])
def test_worked_values(name, P, M, makespan, peak):
    res = sim(name, P, M)
    assert res.makespan == makespan
    assert res.peak_activations[0] == peak


def test_1f1b_worked_bubble():
    assert sim("1f1b", 4, 8).makespan_bubble == [9.0] * 4


def test_zbv_span_bubble_zero_worked():
    assert sim("zbv", 4, 8).span_bubble == [0.0] * 4


# ----- the formula table, over P in {2, 4, 8, 16} and several M >= 2P ---------------------------

@pytest.mark.parametrize("P, M", cases("gpipe"))
def test_gpipe_formulas(P, M):
    res = sim("gpipe", P, M)
    assert res.makespan == 3 * M + 3 * (P - 1)
    assert res.makespan_bubble == [3.0 * (P - 1)] * P
    assert res.peak_activations == [M] * P


@pytest.mark.parametrize("P, M", cases("1f1b"))
def test_1f1b_formulas(P, M):
    res = sim("1f1b", P, M)
    assert res.makespan == 3 * M + 3 * (P - 1)
    assert res.makespan_bubble == [3.0 * (P - 1)] * P
    assert res.peak_activations == [P - r for r in range(P)]


@pytest.mark.parametrize("P, M", cases("interleaved-1f1b"))
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_formulas(P, M, v):
    res = sim("interleaved-1f1b", P, M, virtual_stages=v)
    # per-chunk costs 1: each rank computes v*M*(F+B+W); the bubble is one chunk's (P-1)(F+B+W)
    assert res.busy == [3.0 * v * M] * P
    assert res.makespan_bubble == [3.0 * (P - 1)] * P
    assert res.peak_activations == [2 * (P - 1 - r) + (v - 1) * P + 1 for r in range(P)]


@pytest.mark.parametrize("P, M", cases("zb-h1"))
def test_zb_h1_formulas(P, M):
    res = sim("zb-h1", P, M)
    assert res.makespan == 3 * M + P - 1
    assert res.makespan_bubble == [float(P - 1)] * P  # (P-1)(F+B-W)
    assert res.peak_activations == [P] * P


@pytest.mark.parametrize("P, M", cases("zb-h2"))
def test_zb_h2_formulas(P, M):
    res = sim("zb-h2", P, M)
    assert res.span_bubble == [0.0] * P  # (P-1)(F+B-2W) = 0
    assert res.makespan == 3 * M + P - 1  # rank r starts r F's late: the parallelogram
    assert res.peak_activations == [2 * P - 1] * P


@pytest.mark.parametrize("P, M", cases("zbv"))
def test_zbv_formulas(P, M):
    res = sim("zbv", P, M)
    assert res.span_bubble == [0.0] * P
    assert res.makespan == 6 * M + P - 1  # busy 2 chunks * 3M, bubble (P-1)F
    assert res.makespan_bubble == [float(P - 1)] * P
    assert res.peak_activations == [2 * P] * P


@pytest.mark.parametrize("f, b, w", [(2, 2, 2), (2, 3, 1), (3, 2, 1), (1, 2, 0.5), (4, 1, 1)])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_bubbles_for_other_uniform_costs(f, b, w, P):
    """The (P-1)(...) bubbles hold for any F, B, W with W <= F, B, not only for 1, 1, 1."""
    M, costs = 3 * P, Costs(f, b, w)
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert sim(name, P, M, costs).makespan_bubble == [(P - 1) * (f + b + w)] * P, name
    assert sim("zb-h1", P, M, costs).makespan_bubble == [(P - 1) * (f + b - w)] * P
    h2 = sim("zb-h2", P, M, costs)
    assert h2.span_bubble[0] == max(h2.span_bubble) == (P - 1) * (f + b - 2 * w)


# ----- structure: every op exactly once, on the placement's rank, W after its B in FIFO order ----

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("P, M", [(1, 1), (2, 2), (3, 6), (4, 8), (4, 9)])
def test_every_op_once_on_its_rank(name, P, M):
    if name == "interleaved-1f1b" and M % P:
        M = P * (M // P)
    if name == "zbv":
        M = max(M, 2 * P - 1)
    s = build_schedule(name, P, M)
    kinds = ("F", "B", "W") if name in SPLIT else ("F", "BW")
    seen = Counter()
    for r, ops in enumerate(s.ranks):
        for item in ops:
            for op in compute_parts(item):
                assert s.placement[op.chain][op.stage] == r, f"{op} on rank {r}"
                seen[op] += 1
    stages = [(0, st_) for st_ in range(s.num_stages())]
    expected = {(k, c, st_, m) for k in kinds for c, st_ in stages for m in range(M)}
    assert set(seen) == expected
    assert set(seen.values()) == {1}
    assert s.placement == ((tuple(r % P for r in range(s.num_stages())),) if name != "zbv"
                           else (tuple(range(P)) + tuple(reversed(range(P))),))
    assert s.microbatch_chain == (0,) * M


@pytest.mark.parametrize("name", sorted(SPLIT))
@pytest.mark.parametrize("P, M", [(2, 4), (4, 8), (4, 11), (8, 16)])
def test_w_runs_the_oldest_deferred_b(name, P, M):
    """Every rank's W's come in the order of its B's (what WeightGradStore.run_oldest serves)."""
    s = build_schedule(name, P, M)
    for ops in s.ranks:
        bs = [(op.stage, op.mb) for op in ops if op.kind == "B"]
        ws = [(op.stage, op.mb) for op in ops if op.kind == "W"]
        assert ws == bs


def test_interleaved_megatron_order():
    """P=2, v=2, M=4, rank 0: chunk 0 for a group of P micro-batches, then chunk 1, backwards reversed."""
    s = build_schedule("interleaved-1f1b", 2, 4)
    got = [(op.kind, op.stage, op.mb) for op in s.ranks[0]]
    # warm-up 2(P-1) + (v-1)P = 4 forwards, then F/BW pairs, then the drain
    assert got == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1),
                   ("F", 0, 2), ("BW", 2, 0), ("F", 0, 3), ("BW", 2, 1),
                   ("F", 2, 2), ("BW", 0, 0), ("F", 2, 3), ("BW", 0, 1),
                   ("BW", 2, 2), ("BW", 2, 3), ("BW", 0, 2), ("BW", 0, 3)]
    assert s.meta == {"virtual_stages": 2}


def test_interleaved_all_warmup_when_m_equals_p():
    s = build_schedule("interleaved-1f1b", 4, 4)
    for ops in s.ranks:
        assert [op.kind for op in ops] == ["F"] * 8 + ["BW"] * 8
    assert sim("interleaved-1f1b", 4, 4).peak_activations == [8] * 4


# ----- bad parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize("v", [1, 0, -2, 2.5, "2", True, None])
def test_interleaved_bad_virtual_stages(v):
    with pytest.raises(ScheduleError, match=r"virtual_stages must be an integer >= 2, got"):
        build_schedule("interleaved-1f1b", 4, 8, virtual_stages=v)


def test_interleaved_needs_multiple_of_p():
    msg = r"interleaved-1f1b needs num_microbatches divisible by num_ranks \(4\), got 6"
    with pytest.raises(ScheduleError, match=msg):
        build_schedule("interleaved-1f1b", 4, 6)


@pytest.mark.parametrize("P, M", [(4, 6), (2, 2), (8, 14)])
def test_zbv_needs_enough_microbatches(P, M):
    with pytest.raises(ScheduleError, match=rf"zbv needs at least 2\*num_ranks-1 = {2 * P - 1} micro-batches, got {M}"):
        build_schedule("zbv", P, M)
    build_schedule("zbv", P, 2 * P - 1)  # the boundary is accepted


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv"])
def test_options_are_rejected_where_not_taken(name):
    with pytest.raises(ScheduleError, match=rf"schedule '{name}' got unknown option\(s\) virtual_stages"):
        build_schedule(name, 4, 8, virtual_stages=2)


@pytest.mark.parametrize("name", NAMES)
def test_bad_counts(name):
    with pytest.raises(ScheduleError, match="num_ranks must be at least 1, got 0"):
        build_schedule(name, 0, 8)
    with pytest.raises(ScheduleError, match="num_microbatches must be an integer, got 2.0"):
        build_schedule(name, 2, 2.0)


# ----- torch.distributed.pipelining CSV ---------------------------------------------------------

def test_csv_1f1b_and_zb_h1():
    assert build_schedule("1f1b", 2, 2).to_pipelining_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert build_schedule("zb-h1", 2, 2).to_pipelining_csv() == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"


def test_csv_zbv_shape():
    P, M = 2, 4
    rows = build_schedule("zbv", P, M).to_pipelining_csv().splitlines()
    assert len(rows) == P
    for r, row in enumerate(rows):
        actions = row.split(",")
        assert len(actions) == 2 * 3 * M
        assert {a[0] for a in actions} == {str(r), str(2 * P - 1 - r)}
        assert Counter(a[1] for a in actions) == {"F": 2 * M, "I": 2 * M, "W": 2 * M}


# ----- no deadlock under any costs --------------------------------------------------------------

def _build_small(name: str, P: int, m_factor: int):
    if name == "interleaved-1f1b":
        return build_schedule(name, P, P * m_factor, virtual_stages=2 + m_factor % 2)
    if name == "zbv":
        return build_schedule(name, P, 2 * P - 1 + m_factor)
    return build_schedule(name, P, m_factor * 2 + P % 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), P=st.integers(1, 5), m_factor=st.integers(1, 4), data=st.data())
def test_no_deadlock_with_random_per_stage_costs(name, P, m_factor, data):
    s = _build_small(name, P, m_factor)
    S = s.num_stages()
    per_stage = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=S, max_size=S)
    costs = Costs(f=data.draw(per_stage), b=data.draw(per_stage), w=data.draw(per_stage),
                  comm=data.draw(per_stage), a2a_f=data.draw(per_stage), a2a_b=data.draw(per_stage))
    res = simulate(s, costs)  # raises ScheduleError on deadlock
    assert len(res.timeline) == s.num_ops()
    assert res.makespan == max(e.end for e in res.timeline)
