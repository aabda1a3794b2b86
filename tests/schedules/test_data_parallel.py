"""REDUCE_GRAD: the data-parallel gradient reduction placed in the schedule, validated, lowered, priced."""

from __future__ import annotations

import pytest

from mt_dualpipe.schedules import (
    FB,
    Costs,
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    add_grad_reduction,
    build_schedule,
    lower,
    simulate,
    validate,
    validate_program,
)
from mt_dualpipe.schedules.data_parallel import has_grad_reduction, reduction_order
from tests.helpers.schedules import all_buildable

R = OpKind.REDUCE_GRAD


def parts(item):
    return (item.f, item.b) if type(item) is FB else (item,)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_one_reduce_per_local_stage_right_after_its_last_weight_grad(P: int, M: int) -> None:
    for s in all_buildable(P, M):
        d = add_grad_reduction(s)
        validate(d)
        assert d.meta["data_parallel"] is True and not has_grad_reduction(s)
        for r, ops in enumerate(d.ranks):
            reduces = [(i, op) for i, op in enumerate(ops) if type(op) is Op and op.kind == R]
            assert sorted((op.chain, op.stage) for _, op in reduces) == sorted(s.local_stages(r)), s.name
            for i, op in reduces:
                last_w = max(j for j, item in enumerate(ops) for p in parts(item)
                             if p.kind in ("W", "BW") and (p.chain, p.stage) == (op.chain, op.stage))
                between = ops[last_w + 1:i]  # only other reductions may sit between
                assert all(type(x) is Op and x.kind == R for x in between), (s.name, r, op)
        # the compute order is untouched
        assert [[x for x in ops if not (type(x) is Op and x.kind == R)] for ops in d.ranks] == s.ranks
        validate_program(lower(s, data_parallel=True))
        assert Schedule.from_json(d.to_json()).ranks == d.ranks


def test_reduce_errors() -> None:
    s = add_grad_reduction(build_schedule("zb-h1", 2, 4))
    ranks = [list(ops) for ops in s.ranks]
    late = ranks[0].pop()  # REDUCE_GRAD(c0,s0) on rank 0
    bad = Schedule(s.name, 2, 4, s.placement, s.microbatch_chain, ranks)
    with pytest.raises(ScheduleError, match=r"rank 0: stage \(c0,s0\) has no REDUCE_GRAD"):
        validate(bad)
    ranks[0].insert(3, late)
    with pytest.raises(ScheduleError, match="comes before that stage's last weight-gradient op"):
        validate(Schedule(s.name, 2, 4, s.placement, s.microbatch_chain, ranks))
    ranks[0].remove(late)
    ranks[0] += [late, late]
    with pytest.raises(ScheduleError, match="duplicate"):
        validate(Schedule(s.name, 2, 4, s.placement, s.microbatch_chain, ranks))
    ranks[0] = ranks[0][:-2] + [Op(R, 0, 1, 0)]
    with pytest.raises(ScheduleError, match="rank 0 does not run chain 0 stage 1"):
        validate(Schedule(s.name, 2, 4, s.placement, s.microbatch_chain, ranks))
    with pytest.raises(ScheduleError, match="when='later': allowed last_w, step_end"):
        add_grad_reduction(build_schedule("zb-h1", 2, 4), when="later")


def test_simulated_reduction_by_hand_1f1b() -> None:
    # 1f1b P=2 M=2, F=1, BW=2: rank 0 ends its compute at 9, rank 1 at 7; each reduction takes 5
    s = add_grad_reduction(build_schedule("1f1b", 2, 2))
    r = simulate(s, Costs(1, 1, 1, dp_sync=5))
    assert r.rank_end == [14.0, 12.0] and r.makespan == 14.0
    assert r.dp_exposed == [5.0, 5.0]
    ev = sorted((e.rank, e.start, e.end) for e in r.timeline if e.op == R)
    assert ev == [(0, 9.0, 14.0), (1, 7.0, 12.0)]
    assert all(e.lane == "comm" for e in r.timeline if e.op == R)


def test_zero_cost_reduction_changes_nothing() -> None:
    for s in all_buildable(4, 8):
        a, b = simulate(s, Costs(1, 2, 1)), simulate(add_grad_reduction(s), Costs(1, 2, 1))
        assert (a.makespan, a.peak_activations, a.busy) == (b.makespan, b.peak_activations, b.busy), s.name


def test_mirrored_stages_reduce_together_and_overlap_in_v_and_dual() -> None:
    costs = Costs(1, 1, 1, dp_sync=3)
    for name in ("zbv", "dualpipev", "dualpipe"):
        s = build_schedule(name, 4, 16)
        overlapped = simulate(add_grad_reduction(s), costs)
        at_end = simulate(add_grad_reduction(s, when="step_end"), costs)
        base = simulate(s, Costs(1, 1, 1)).makespan
        assert base < overlapped.makespan < at_end.makespan, name
        assert sum(overlapped.dp_exposed) < sum(at_end.dp_exposed), name
    # DualPipe: stage s lives on ranks s and P-1-s; one collective per stage starts once both posted
    s = add_grad_reduction(build_schedule("dualpipe", 4, 8))
    r = simulate(s, costs)
    walk = simulate(s, Costs(1, 1, 1))  # dp_sync 0: events start at the collective's start
    starts = {}
    for e in walk.timeline:
        if e.op == R:
            starts.setdefault(e.stage, set()).add(e.start)
    assert all(len(v) == 1 for v in starts.values())  # both copies of a stage start together
    assert r.makespan > walk.makespan
    # zbv rank 0 holds stages 0 and 3; stage 3's W's finish first, so it is reduced first
    assert reduction_order(add_grad_reduction(build_schedule("zbv", 2, 4)), 0) == [(0, 3), (0, 0)]
