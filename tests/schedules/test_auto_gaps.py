"""``local.close_gaps``: later W's run in the idle gaps they fit, held-back producers are raised; never worse."""

from __future__ import annotations

import random

from mt_dualpipe.schedules import Costs, Schedule, build_schedule, validate
from mt_dualpipe.schedules.auto import Layout, Policy, list_schedule
from mt_dualpipe.schedules.auto import search as search_module
from mt_dualpipe.schedules.auto.local import close_gaps, in_microbatch_order, renumber, split_backward
from mt_dualpipe.schedules.ir import Op
from mt_dualpipe.schedules.ops import OpKind
from mt_dualpipe.schedules.simulate import run_schedule

F, B, W = OpKind.F, OpKind.B, OpKind.W


def _order(layout: Layout, ranks) -> Schedule:
    return Schedule("auto", layout.P, layout.M, layout.placement, layout.microbatch_chain, ranks)


def _ops(stage: int, text: str) -> list[Op]:
    """``"F0 B0 W0"`` -> the ops of ``stage`` (chain 0) in that order."""
    return [Op(OpKind(t[0]), 0, stage, int(t[1:])) for t in text.split()]


TWO = Layout.named("linear", 2, 2)
RANK0 = _ops(0, "F0 F1 B0 B1 W0 W1")


def test_a_later_w_runs_in_the_gap_before_a_waiting_b():
    # P=2, M=2, every op 1. Rank 0 waits 4..5 for rank 1's B of micro-batch 1; its W of micro-batch 0
    # (its B done at 4) fits that gap, and then everything after it ends one sooner: 8 -> 7.
    costs, ranks = Costs(1, 1, 1), [RANK0, _ops(1, "F0 B0 F1 B1 W0 W1")]
    assert run_schedule(_order(TWO, ranks), costs).makespan == 8
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (makespan, moved) == (7, 1)
    assert filled == [_ops(0, "F0 F1 B0 W0 B1 W1"), ranks[1]]  # rank 1 has no gap after its first op
    assert run_schedule(_order(TWO, filled), costs).makespan == 7


def test_a_w_that_does_not_fit_the_gap_stays():
    # the same order with W's of 2: the gap is 1 long, so nothing moves
    costs, ranks = Costs(1, 1, 2), [RANK0, _ops(1, "F0 B0 F1 B1 W0 W1")]
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (filled, moved) == (ranks, 0)
    assert makespan == run_schedule(_order(TWO, ranks), costs).makespan


def test_a_producer_held_back_by_a_w_is_raised():
    # P=2, M=2, every op 1. Rank 1 runs W0 (4..5) although its B1's input (its own F1) was there at 4,
    # so rank 0 waits 4..6 for B1. First W0 of rank 0 fills 4..5 (9 -> 8), then rank 1's B1 goes above
    # its W0 (B1 4..5) and rank 0's B1 runs at 5 (8 -> 7).
    costs, ranks = Costs(1, 1, 1), [RANK0, _ops(1, "F0 B0 F1 W0 B1 W1")]
    assert run_schedule(_order(TWO, ranks), costs).makespan == 9
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (makespan, moved) == (7, 2)
    assert filled == [_ops(0, "F0 F1 B0 W0 B1 W1"), _ops(1, "F0 B0 F1 B1 W0 W1")]
    # here rank 1's F1 waits behind W0 although rank 0's F1 was there at 2: raising it would hold two
    # activations on rank 1, so with a limit of 1 only rank 0's W fills its gap
    tight = close_gaps(TWO, costs, [2, 1], [RANK0, _ops(1, "F0 B0 W0 F1 B1 W1")])
    assert tight[2] == 1 and tight[0][1] == _ops(1, "F0 B0 W0 F1 B1 W1")
    assert close_gaps(TWO, costs, [2, 2], [RANK0, _ops(1, "F0 B0 W0 F1 B1 W1")])[0][1][:3] == _ops(1, "F0 B0 F1")


def _random_orders():
    rng = random.Random(7)
    cases = []
    for placement, P, M, costs in (
            ("linear", 4, 8, Costs(1, 2, 1, comm=0.5)),
            ("v", 3, 6, Costs(1, 1, 1, a2a_f=1, a2a_b=1)),
            ("v", 4, 8, Costs([1, 1, 1, 1, 1, 1, 1, 2], 1, [1, 0.5, 1, 1, 1, 1, 1, 1])),
            ("dual", 4, 8, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5, comm=0.25))):
        layout = Layout.named(placement, P, M)
        sc = costs.per_stage(layout.S)
        for k in range(4):
            pol = Policy(pair=placement != "linear" and k % 2 == 0, b_first=k != 3)
            ranks = list_schedule(layout, sc, [3 * P] * P, pol, rng, 0.5)
            ranks = [renumber(ops, 0, len(ops) - 1) for ops in split_backward(ranks)]
            if k >= 2:  # every W at the end of its rank: the gaps of the cool-down stay open
                ranks = [[x for x in ops if x.kind != W] + [x for x in ops if x.kind == W] for ops in ranks]
            limits = run_schedule(_order(layout, ranks), costs, record=False).peak_activations
            cases.append((layout, costs, limits, ranks))
    return cases


def test_filling_is_never_worse_and_keeps_the_limit():
    total = 0
    for layout, costs, limits, ranks in _random_orders():
        before = run_schedule(_order(layout, ranks), costs, record=False)
        filled, makespan, moved = close_gaps(layout, costs, limits, ranks)
        after = run_schedule(_order(layout, filled), costs, record=False)
        validate(_order(layout, filled))
        assert after.makespan == makespan <= before.makespan
        assert sum(after.rank_end) <= sum(before.rank_end)
        assert all(a <= b for a, b in zip(after.peak_activations, before.peak_activations))
        assert in_microbatch_order(filled)
        assert [sorted(map(str, ops)) for ops in filled] == [sorted(map(str, ops)) for ops in ranks]
        assert (moved == 0) == (filled == ranks)
        total += moved
    assert total > 0  # the walks leave gaps that W's fill


def test_the_search_closes_the_gaps_of_its_best_order(monkeypatch):
    calls = []
    real = search_module.close_gaps

    def spy(layout, costs, limits, ranks, deadline=None):
        out = real(layout, costs, limits, ranks, deadline)
        calls.append((layout, ranks, out))
        return out

    monkeypatch.setattr(search_module, "close_gaps", spy)
    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.5)
    sched = build_schedule("auto", 3, 6, costs=costs, placement="v", seed=0, time_budget=None, iterations=5)
    assert len(calls) == 1  # the best order of the phases (no hand chains with iterations given)
    layout, before, (filled, makespan, moved) = calls[0]
    old = run_schedule(_order(layout, before), costs, record=False)
    new = run_schedule(sched, costs, record=False)
    assert moved > 0 and sched.meta["source"].endswith("+gaps")
    assert sched.ranks == filled and new.makespan == makespan
    assert (new.makespan, max(new.peak_activations)) < (old.makespan, max(old.peak_activations))
