"""Shared pieces of the schedule-compiler tests: unit costs, every hand schedule that builds, random
annealing moves, orders written as text and random walk orders for the order repairs."""

from __future__ import annotations

import random
from collections.abc import Sequence

from mt_dualpipe.schedules import Costs, Schedule, ScheduleError, build_schedule, list_schedules
from mt_dualpipe.schedules.auto import Layout, Policy, list_schedule
from mt_dualpipe.schedules.auto.local import ANNEAL_MOVES, neighbour, renumber, split_backward
from mt_dualpipe.schedules.ir import Op
from mt_dualpipe.schedules.ops import OpKind
from mt_dualpipe.schedules.simulate import run_schedule


def unit() -> Costs:
    """F = B = W = 1: the costs the worked values of docs/schedules.md use."""
    return Costs(1, 1, 1)


def all_buildable(P: int, M: int) -> list[Schedule]:
    """Every registered hand schedule (not ``auto``) that accepts (P, M)."""
    out = []
    for info in list_schedules():
        if info.name == "auto":
            continue
        try:
            out.append(build_schedule(info.name, P, M))
        except ScheduleError:
            pass
    return out


def random_move(ranks: list[list], rng: random.Random) -> tuple[int, list[list]]:
    """One random annealing move that applies (window 6): the rank it changed and the new orders."""
    while True:
        r = rng.randrange(len(ranks))
        cand = neighbour(ranks, rng, r, 6, ANNEAL_MOVES)
        if cand is not None:
            return r, cand


def order_of(layout: Layout, ranks: list[list]) -> Schedule:
    """Per-rank orders as the ``Schedule`` that ``auto`` would return for them."""
    return Schedule("auto", layout.P, layout.M, layout.placement, layout.microbatch_chain, ranks)


def ops_of(stage: int, text: str) -> list[Op]:
    """``"F0 B0 W0"`` -> the ops of ``stage`` (chain 0) in that order."""
    return [Op(OpKind(t[0]), 0, stage, int(t[1:])) for t in text.split()]


def random_walk_orders(seed: int, variants: Sequence[int]) -> list[tuple[Layout, Costs, list[int], list[list]]]:
    """(layout, costs, per-rank peaks as limits, order) of randomised list-scheduling walks on linear, V and dual
    placements with latency, all-to-all and uneven stages, backwards split and renumbered.

    Variant k: FB pairing (not on linear) when k is even, B first unless k is 3, and from k = 2 every W
    moved to the end of its rank (the cool-down's B's wait behind nothing, its gaps stay open).
    """
    rng = random.Random(seed)
    cases = []
    for placement, P, M, costs in (
            ("linear", 4, 8, Costs(1, 2, 1, comm=0.5)),
            ("v", 3, 6, Costs(1, 1, 1, a2a_f=1, a2a_b=1)),
            ("v", 4, 8, Costs([1, 1, 1, 1, 1, 1, 1, 2], 1, [1, 0.5, 1, 1, 1, 1, 1, 1])),
            ("dual", 4, 8, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5, comm=0.25))):
        layout = Layout.named(placement, P, M)
        sc = costs.per_stage(layout.S)
        for k in variants:
            pol = Policy(pair=placement != "linear" and k % 2 == 0, b_first=k != 3)
            ranks = list_schedule(layout, sc, [3 * P] * P, pol, rng, 0.5)
            ranks = [renumber(ops, 0, len(ops) - 1) for ops in split_backward(ranks)]
            if k >= 2:
                ranks = [[x for x in ops if x.kind != OpKind.W] + [x for x in ops if x.kind == OpKind.W]
                         for ops in ranks]
            limits = run_schedule(order_of(layout, ranks), costs, record=False).peak_activations
            cases.append((layout, costs, limits, ranks))
    return cases
