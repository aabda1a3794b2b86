"""``simulate.Replay``: re-simulating an order changed on one rank gives exactly what a full simulation gives."""

from __future__ import annotations

import random

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule
from mt_dualpipe.schedules.auto.local import split_backward
from mt_dualpipe.schedules.data_parallel import add_grad_reduction
from mt_dualpipe.schedules.ir import Schedule
from mt_dualpipe.schedules.simulate import Cutoff, Replay, changed_span, run_schedule
from tests.helpers.schedules import random_move

CASES = [
    ("dualpipe", 4, 8, Costs([1, 2, 1, 1.5], 1.5, [0.5, 1, 1, 1], comm=0.3, a2a_f=0.5, a2a_b=1)),
    ("dualpipev", 4, 8, Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.1)),
    ("zbv", 3, 6, Costs(1, 2, 1, fb=2.5)),
    ("1f1b", 4, 8, Costs(1, 2, 0)),
    ("dualpipev-uneven", 4, 8, Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.1, mb_scale=[1, 2.5, 1, 0.5, 3, 1, 1, 2],
                                     mb_scale_w=[1, 1.5, 1, 0.5, 1, 1, 1, 1.5])),
]


def _first_change(old: list, new: list) -> int:
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a is not b), min(len(old), len(new)))


@pytest.mark.parametrize("name,P,M,costs", CASES, ids=[c[0] for c in CASES])
def test_changed_equals_a_full_simulation(name, P, M, costs):
    """Random moves (deadlocking ones included), each replayed from its first changed index and
    compared with ``run_schedule`` on the whole order: makespan, every rank's end and peak."""
    rng = random.Random(0)
    sched = build_schedule(name.split("-uneven")[0], P, M)
    ranks = split_backward(sched.ranks)

    def order(r):
        return Schedule("x", P, M, sched.placement, sched.microbatch_chain, r)

    base = Replay(order(ranks), costs)
    total = sum(len(ops) for ops in ranks)
    assert base.walked == total and base.rejoined == 0  # a fresh replay walks every op
    compared = deadlocks = rejoined = 0
    while compared < 300:
        r, cand = random_move(ranks, rng)
        compared += 1
        try:
            ref = run_schedule(order(cand), costs, record=False)
        except ScheduleError:
            with pytest.raises(ScheduleError, match="deadlock"):
                base.changed(cand, r, _first_change(ranks[r], cand[r]))
            deadlocks += 1
            continue
        got = base.changed(cand, r, _first_change(ranks[r], cand[r]))
        assert got.makespan == ref.makespan
        assert got.rank_end == ref.rank_end
        assert got.peak_activations == ref.peak_activations
        starts, ends = [[] for _ in cand], [[] for _ in cand]
        run_schedule(order(cand), costs, record=False, starts_out=starts, ends_out=ends)
        for q in range(P):  # op for op, the items taken from the old walk included
            assert got.times(q) == list(zip(starts[q], ends[q]))
        # only what the move can change is walked again, and some of it is taken as it was
        assert 0 < got.walked and got.walked + got.rejoined <= sum(len(ops) for ops in cand)
        rejoined += got.rejoined > 0
        lo = _first_change(ranks[r], cand[r])  # what annealing passes: the changed span's end too
        assert base.changed(cand, r, lo, None, changed_span(ranks[r], cand[r], lo)[1]).times(r) == got.times(r)
        _check_cutoff(base, cand, r, ref, rng)
        if rng.random() < 0.5:  # walk on, so later replays start from replayed orders
            ranks, base = cand, got
    assert deadlocks  # the moves do produce deadlocks, and those are reported as such
    assert rejoined > 30  # many replays are back on the old walk before its end


def _check_cutoff(base: Replay, cand: list, r: int, ref, rng: random.Random) -> None:
    """A cut-off replay stops exactly when the full result is over a peak or the score, else equals it."""
    weight = rng.choice([0.0, 0.1 / len(cand)])
    score = ref.makespan + weight * sum(ref.rank_end)
    ceiling = score + rng.choice([-1.0, -0.25, 0.0, 0.5])
    peaks = [p - (rng.random() < 0.1) for p in ref.peak_activations]
    cut = base.changed(cand, r, _first_change(base.schedule.ranks[r], cand[r]), Cutoff(peaks, ceiling, weight))
    ruled_out = score > ceiling + 1e-9 or any(p > c for p, c in zip(ref.peak_activations, peaks))
    assert cut.over == ruled_out
    if not ruled_out:
        assert cut.makespan == ref.makespan
        assert cut.rank_end == ref.rank_end
        assert cut.peak_activations == ref.peak_activations
    else:
        assert cut.walked <= base.changed(cand, r, _first_change(base.schedule.ranks[r], cand[r])).walked
        with pytest.raises(ScheduleError, match="stopped by its Cutoff"):
            cut.changed(cand, r, len(cand[r]))  # a partial walk is no base for another replay


def test_orders_with_reductions_are_refused():
    sched = add_grad_reduction(build_schedule("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="Replay simulates compute ops only; this order has REDUCE_GRAD ops"):
        Replay(sched, Costs(dp_sync=1.0))
