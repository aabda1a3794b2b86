"""``auto.local.renumber``: micro-batches renumbered in order per (kind, chain, stage) start no op later
and keep every activation count."""

from __future__ import annotations

import random

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule
from mt_dualpipe.schedules.auto import ANNEAL_PLAIN_MOVES, MOVES, Layout, anneal
from mt_dualpipe.schedules.auto.local import (
    ANNEAL_MOVES,
    in_microbatch_order,
    renumber,
    split_backward,
)
from mt_dualpipe.schedules.ir import Op, Schedule
from mt_dualpipe.schedules.ops import OpKind, parts
from mt_dualpipe.schedules.simulate import run_schedule
from tests.helpers.schedules import random_move

CASES = [
    ("dualpipe", 4, 8, Costs([1, 2, 1, 1.5], 1.5, [0.5, 1, 1, 1], comm=0.3, a2a_f=0.5, a2a_b=1)),
    ("dualpipev", 4, 8, Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.1)),
    ("zbv", 3, 6, Costs(1, 2, 1, fb=2.5)),
    ("zb-h1", 4, 8, Costs(1, 2, [1, 1, 1, 3])),
]


def _times(sched: Schedule, costs: Costs) -> tuple[list, list, list[int]]:
    starts: list[list[float]] = [[] for _ in sched.ranks]
    ends: list[list[float]] = [[] for _ in sched.ranks]
    res = run_schedule(sched, costs, record=False, starts_out=starts, ends_out=ends)
    return starts, ends, res.peak_activations


def _shape(item) -> tuple:
    """An item without its micro-batches: (kind, chain, stage) of each part."""
    return tuple(p[:3] for p in parts(item))


def _scrambled(name: str, P: int, M: int, moves: int, rng: random.Random) -> tuple[Schedule, list]:
    """The hand schedule, backwards split, after ``moves`` random annealing moves that do not deadlock:
    orders whose micro-batches are out of order in many places."""
    sched = build_schedule(name, P, M)
    ranks = split_backward(sched.ranks)
    done = 0
    while done < moves:
        _, cand = random_move(ranks, rng)
        try:
            run_schedule(Schedule("x", P, M, sched.placement, sched.microbatch_chain, cand), record=False)
        except ScheduleError:
            continue
        ranks, done = cand, done + 1
    return sched, ranks


@pytest.mark.parametrize("name,P,M,costs", CASES, ids=[c[0] for c in CASES])
def test_renumbering_every_rank_starts_no_op_later_and_keeps_memory(name, P, M, costs):
    rng = random.Random(1)
    sched, ranks = _scrambled(name, P, M, 150, rng)
    assert not in_microbatch_order(ranks)
    renumbered = [renumber(ops, 0, len(ops) - 1) for ops in ranks]
    assert in_microbatch_order(renumbered)
    assert sum(a != b for ops, new in zip(ranks, renumbered) for a, b in zip(ops, new)) > 0
    for ops, new in zip(ranks, renumbered):  # the same kinds at the same places, only micro-batches changed
        assert [_shape(a) for a in ops] == [_shape(b) for b in new]
        assert all(a is b for a, b in zip(ops, new) if a == b)  # unchanged items are the same objects

    def order(r):
        return Schedule("x", P, M, sched.placement, sched.microbatch_chain, r)

    assert _no_later(_times(order(renumbered), costs), _times(order(ranks), costs)) > 0  # out of order cost time


def _no_later(got: tuple, ref: tuple) -> int:
    """Every op starts and ends no later than in ``ref``, the same peaks; how many ops are sooner."""
    (starts, ends, peaks), (ref_starts, ref_ends, ref_peaks) = got, ref
    assert peaks == ref_peaks
    sooner = 0
    for a, b, c, d in zip(starts, ref_starts, ends, ref_ends):
        assert len(a) == len(b) and all(x <= y + 1e-9 for x, y in zip(a + c, b + d))
        sooner += sum(x < y - 1e-9 for x, y in zip(a, b))
    return sooner


@pytest.mark.parametrize("name,P,M,costs", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_renumbering_the_changed_span_puts_an_order_back_in_order(name, P, M, costs):
    """After one move on an order in micro-batch order, renumbering only the changed span gives what
    renumbering the whole rank gives, and no op later than in the move's order."""
    rng = random.Random(2)
    sched = build_schedule(name, P, M)
    ranks = [renumber(ops, 0, len(ops) - 1) for ops in split_backward(sched.ranks)]
    checked = unchanged = 0
    while checked < 200:
        r, cand = random_move(ranks, rng)
        lo = next((i for i, (a, b) in enumerate(zip(ranks[r], cand[r])) if a is not b), None)
        if lo is None:
            continue
        hi = len(cand[r]) - 1 - next(i for i, (a, b) in enumerate(zip(ranks[r][::-1], cand[r][::-1])) if a is not b)
        span = renumber(cand[r], lo, hi, ranks[r])
        assert span == renumber(cand[r], 0, len(cand[r]) - 1)
        unchanged += span == ranks[r]
        fixed = list(cand)
        fixed[r] = span
        try:
            want = _times(Schedule("x", P, M, sched.placement, sched.microbatch_chain, cand), costs)
        except ScheduleError:
            continue
        _no_later(_times(Schedule("x", P, M, sched.placement, sched.microbatch_chain, fixed), costs), want)
        checked += 1
    assert unchanged > 0  # some moves only exchange interchangeable ops: annealing skips those


def test_anneal_returns_orders_in_microbatch_order_and_refuses_merging_moves():
    layout = Layout.named("v", 3, 6)
    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    _, start = _scrambled("dualpipev", 3, 6, 60, random.Random(3))
    assert not in_microbatch_order(start)
    for moves in (ANNEAL_MOVES, ANNEAL_PLAIN_MOVES):
        ranks, _ = anneal(layout, costs, [9] * 3, start, random.Random(0), 300, None, moves)
        assert in_microbatch_order(ranks)
        assert all(type(it) is not Op or it.kind != OpKind.BW for ops in ranks for it in ops)
    with pytest.raises(ScheduleError, match="its moves cannot include split_bw; allowed: ANNEAL_MOVES, "
                                            "ANNEAL_PLAIN_MOVES"):
        anneal(layout, costs, [9] * 3, start, random.Random(0), 10, None, MOVES)


def test_pull_w_moves_a_w_to_right_after_its_b():
    assert [name for name, _, _ in ANNEAL_PLAIN_MOVES] == ["shift", "pair", "unpair", "pull_w", "swap"]
    assert sum(p for _, p, _ in ANNEAL_PLAIN_MOVES) == pytest.approx(1.0)
    pull = dict((name, fn) for name, _, fn in ANNEAL_PLAIN_MOVES)["pull_w"]
    b, w, f = Op(OpKind.B, 0, 1, 0), Op(OpKind.W, 0, 1, 0), Op(OpKind.F, 0, 1, 1)
    ops = [b, f, Op(OpKind.W, 0, 1, 1), w]
    assert pull(ops, 3, random.Random(0), 6) == [b, w, f, Op(OpKind.W, 0, 1, 1)]
    assert pull([b, w, f], 1, random.Random(0), 6) is None  # already there
    assert pull(ops, 1, random.Random(0), 6) is None  # not a W
