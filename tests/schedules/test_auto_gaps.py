"""``local.close_gaps``: later W's run in the idle gaps they fit, held-back producers are raised; never worse."""

from __future__ import annotations

from mt_dualpipe.schedules import Costs, build_schedule, validate
from mt_dualpipe.schedules.auto import Layout
from mt_dualpipe.schedules.auto import repair as repair_module
from mt_dualpipe.schedules.auto.local import close_gaps, in_microbatch_order
from mt_dualpipe.schedules.simulate import run_schedule
from tests.helpers.schedules import ops_of, order_of, random_walk_orders

TWO = Layout.named("linear", 2, 2)
RANK0 = ops_of(0, "F0 F1 B0 B1 W0 W1")


def test_a_later_w_runs_in_the_gap_before_a_waiting_b():
    # P=2, M=2, every op 1. Rank 0 waits 4..5 for rank 1's B of micro-batch 1; its W of micro-batch 0
    # (its B done at 4) fits that gap, and then everything after it ends one sooner: 8 -> 7.
    costs, ranks = Costs(1, 1, 1), [RANK0, ops_of(1, "F0 B0 F1 B1 W0 W1")]
    assert run_schedule(order_of(TWO, ranks), costs).makespan == 8
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (makespan, moved) == (7, 1)
    assert filled == [ops_of(0, "F0 F1 B0 W0 B1 W1"), ranks[1]]  # rank 1 has no gap after its first op
    assert run_schedule(order_of(TWO, filled), costs).makespan == 7


def test_a_w_that_does_not_fit_the_gap_stays():
    # the same order with W's of 2: the gap is 1 long, so nothing moves
    costs, ranks = Costs(1, 1, 2), [RANK0, ops_of(1, "F0 B0 F1 B1 W0 W1")]
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (filled, moved) == (ranks, 0)
    assert makespan == run_schedule(order_of(TWO, ranks), costs).makespan


def test_a_producer_held_back_by_a_w_is_raised():
    # P=2, M=2, every op 1. Rank 1 runs W0 (4..5) although its B1's input (its own F1) was there at 4,
    # so rank 0 waits 4..6 for B1. First W0 of rank 0 fills 4..5 (9 -> 8), then rank 1's B1 goes above
    # its W0 (B1 4..5) and rank 0's B1 runs at 5 (8 -> 7).
    costs, ranks = Costs(1, 1, 1), [RANK0, ops_of(1, "F0 B0 F1 W0 B1 W1")]
    assert run_schedule(order_of(TWO, ranks), costs).makespan == 9
    filled, makespan, moved = close_gaps(TWO, costs, [2, 2], ranks)
    assert (makespan, moved) == (7, 2)
    assert filled == [ops_of(0, "F0 F1 B0 W0 B1 W1"), ops_of(1, "F0 B0 F1 B1 W0 W1")]
    # here rank 1's F1 waits behind W0 although rank 0's F1 was there at 2: raising it would hold two
    # activations on rank 1, so with a limit of 1 only rank 0's W fills its gap
    tight = close_gaps(TWO, costs, [2, 1], [RANK0, ops_of(1, "F0 B0 W0 F1 B1 W1")])
    assert tight[2] == 1 and tight[0][1] == ops_of(1, "F0 B0 W0 F1 B1 W1")
    assert close_gaps(TWO, costs, [2, 2], [RANK0, ops_of(1, "F0 B0 W0 F1 B1 W1")])[0][1][:3] == ops_of(1, "F0 B0 F1")


def test_filling_is_never_worse_and_keeps_the_limit():
    total = 0
    for layout, costs, limits, ranks in random_walk_orders(7, range(4)):
        before = run_schedule(order_of(layout, ranks), costs, record=False)
        filled, makespan, moved = close_gaps(layout, costs, limits, ranks)
        after = run_schedule(order_of(layout, filled), costs, record=False)
        validate(order_of(layout, filled))
        assert after.makespan == makespan <= before.makespan
        assert sum(after.rank_end) <= sum(before.rank_end)
        assert all(a <= b for a, b in zip(after.peak_activations, before.peak_activations))
        assert in_microbatch_order(filled)
        assert [sorted(map(str, ops)) for ops in filled] == [sorted(map(str, ops)) for ops in ranks]
        assert (moved == 0) == (filled == ranks)
        total += moved
    assert total > 0  # the walks leave gaps that W's fill


def test_the_search_closes_the_gaps_of_its_bestorder_of(monkeypatch):
    calls = []
    real = repair_module.close_gaps

    def spy(layout, costs, limits, ranks, deadline=None):
        out = real(layout, costs, limits, ranks, deadline)
        calls.append((layout, ranks, out))
        return out

    monkeypatch.setattr(repair_module, "close_gaps", spy)
    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.5)
    sched = build_schedule("auto", 3, 6, costs=costs, placement="v", seed=0, time_budget=None, iterations=5)
    # first the best order of the phases (no hand chains with iterations given), then re-listed cool-downs
    assert calls
    layout, before, (filled, makespan, moved) = calls[0]
    old = run_schedule(order_of(layout, before), costs, record=False)
    new = run_schedule(sched, costs, record=False)
    assert moved > 0 and sched.meta["source"].endswith("+gaps")
    assert sched.ranks == filled and new.makespan == makespan
    assert (new.makespan, max(new.peak_activations)) < (old.makespan, max(old.peak_activations))
