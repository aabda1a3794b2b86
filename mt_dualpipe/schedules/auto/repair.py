"""Repairs of an annealed order: its cool-down list-scheduled again, and a stray lone F and B paired.

Annealing ends with the pairing and the warm-up of the best known orders, or one unit short of
it, and a cool-down a unit or two off. Two deterministic repairs take such orders the rest of
the way (P=8, M=24, docs/schedules.md):

- **cool-down re-listing** (``relist_cooldown``): a W run ahead of a B that was ready on one
  rank delays the B's of every rank after it, and the loss shows up as short gaps on the
  critical rank many ops later; the order of the last lone B's and W's is what a greedy walk does
  well (a B as soon as it is ready, an F paired with a ready B, W's in the idle moments). Each rank
  keeps its items that start before a cut, the walk (``listsched`` with that prefix) chooses the
  rest under each of ``cooldown_policies``, and the best result has its gaps closed
  (``local.close_gaps``);
- **stray pairing** (``pair_strays``): the critical rank runs one F and one B of its two stages
  lone that the best orders run as one FB unit, so it pays their all-to-all twice and ends a unit
  or two after every other rank. The unit is built at either op's place and the cool-down
  re-listed around it; as a single annealing move it gains nothing until the ops behind it are
  re-listed, and its partner is often many places away.
"""

from __future__ import annotations

import random
import time

from ..costs import Costs
from ..errors import ScheduleError
from ..ir import FB, ComputeItem, Op
from ..ops import OpKind, OpTable
from ..simulate import Cutoff, Replay, changed_span
from .layout import Layout
from .listsched import list_schedules_from
from .local import anneal, close_gaps, evaluate, fits, renumber, replay_order
from .policies import Policy, policies

Ranks = list[list[ComputeItem]]

COOLDOWN_CUTS = (0.75, 0.8, 0.85)
"""Where the re-listed cool-down starts, as fractions of the order's makespan; each is tried. On the
V orders of P=8, M=24 that the search had left at 192 (all-to-all 1.0 of F, optimum 190), cut at
0.75 four of seven went to 190, 0.8 and 0.85 mend others; from 0.7 down the walk loses the
steady state (196-215), from 0.9 on nothing is left to change."""

REPAIR_CHECKPOINTS = (0.6, 0.85)
"""Where ``anneal_repaired`` stops a long chain to repair its best order, as fractions of the chain."""

STRAY_RELISTS = 2
"""How many of the paired candidates (best first, none worse than the order) get their cool-down re-listed."""


def cooldown_policies(placement: str, costs: Costs, num_stages: int) -> list[Policy]:
    """The policy grid with split backwards (annealed orders run B then W), without what only matters
    while micro-batches still enter the pipeline (``inject_first``) or a partner is worth waiting for
    (``pair_wait``): on the cool-downs measured those never changed the result."""
    sc = costs.per_stage(num_stages)
    return [p for p in policies(placement, sc) if p.split and not p.inject_first and not p.pair_wait]


def prefix_before(ranks: Ranks, replay: Replay, t: float) -> Ranks:
    """Each rank's items that start before ``t`` in ``replay`` (its times for ``ranks``)."""
    return [[item for item, (start, _) in zip(ops, replay.times(r)) if start < t] for r, ops in enumerate(ranks)]


def relist_cooldown(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks,
                    cuts: tuple[float, ...] = COOLDOWN_CUTS,
                    deadline: float | None = None) -> tuple[Ranks, float] | None:
    """The best of ``ranks`` and the orders with each rank's items up to a cut kept and the rest
    list-scheduled again, its gaps closed; (order, makespan), or None if ``ranks`` does not run within
    ``limits``. Never worse than ``ranks``. Past ``deadline`` (``time.perf_counter``) no more walks start.
    """
    try:
        replay = replay_order(layout, costs, ranks, "relist_cooldown")
    except ScheduleError:
        return None
    if not fits(replay.peak_activations, limits):
        return None
    sc = costs.per_stage(layout.S)
    table = OpTable(layout.placement, layout.M, sc)
    pols = cooldown_policies(layout.name, costs, layout.S)
    best = ((replay.makespan, sum(replay.rank_end)), ranks)
    seen: set[tuple] = set()
    for cut in cuts:
        if deadline is not None and time.perf_counter() > deadline:
            break
        t_cut = cut * replay.makespan
        prefix = prefix_before(ranks, replay, t_cut)
        for got in list_schedules_from(layout, sc, limits, pols, prefix, table):
            key = None if got is None else tuple(map(tuple, got))
            if key is None or key in seen:  # policies often agree on a cool-down: each order is scored once
                continue
            seen.add(key)
            try:  # the prefix keeps its times: only what starts from the cut on is walked
                run = replay.from_time(got, t_cut, Cutoff(limits, best[0][0]))
            except ScheduleError:
                continue
            if run.over:
                continue
            score = (run.makespan, sum(run.rank_end))
            if score < best[0]:
                best = (score, got)
    closed, makespan, _ = close_gaps(layout, costs, limits, best[1], deadline)
    return closed, makespan


def repairs(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks, floor: float, pairing: bool,
            deadline: float | None = None) -> list[tuple[Ranks, str]]:
    """The repaired versions of ``ranks`` worth considering, in order, each with what its source gains:
    its gaps closed (``local.close_gaps``, if that moved anything: "+gaps"), its cool-down re-listed
    ("+cooldown") and, with ``pairing`` (FB units pay), a stray lone F and B of a critical rank paired
    ("+pairs", from the better of the two before). Stops once an order reaches ``floor`` (the lower
    bound: nothing can beat it) or ``deadline`` passes. Pure: the search, or the child process that
    annealed ``ranks`` (``chains``), runs it and the search considers the results in this order.
    """
    out: list[tuple[Ranks, str]] = []
    closed, makespan, moved = close_gaps(layout, costs, limits, ranks, deadline)
    suffix = "+gaps" if moved else ""
    if moved:
        out.append((closed, suffix))

    def done(best: float) -> bool:
        return best <= floor + 1e-9 or (deadline is not None and time.perf_counter() > deadline)

    if done(makespan):
        return out
    best = (closed, makespan, suffix)
    got = relist_cooldown(layout, costs, limits, closed, deadline=deadline)
    if got is not None:
        out.append((got[0], suffix + "+cooldown"))
        if got[1] < makespan - 1e-9:
            best = (got[0], got[1], suffix + "+cooldown")
    if done(best[1]) or not pairing:
        return out
    got = pair_strays(layout, costs, limits, best[0], deadline)
    if got is not None:
        out.append((got[0], best[2] + "+pairs"))
    return out


def stray_pairings(ops: list[ComputeItem]) -> list[list[ComputeItem]]:
    """Rank orders with one lone F and a lone B of another local stage made one FB unit: for each lone F,
    the nearest such B before it and after it, the unit at either op's place (renumbered)."""
    lone = [(i, x) for i, x in enumerate(ops) if type(x) is Op and x.kind in (OpKind.F, OpKind.B)]
    out = []
    for k, (i, f) in enumerate(lone):
        if f.kind != OpKind.F:
            continue
        before = next(((j, x) for j, x in reversed(lone[:k]) if x.kind == OpKind.B and x[1:3] != f[1:3]), None)
        after = next(((j, x) for j, x in lone[k + 1:] if x.kind == OpKind.B and x[1:3] != f[1:3]), None)
        for j, b in (p for p in (before, after) if p is not None):
            for at, gone in ((i, j), (j, i)):
                new = [FB(f, b) if n == at else x for n, x in enumerate(ops) if n != gone]
                out.append(renumber(new, 0, len(new) - 1))
    return out


def pair_strays(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks,
                deadline: float | None = None) -> tuple[Ranks, float] | None:
    """The best order with a stray lone F and B of a critical rank (one that ends last) paired
    (``stray_pairings``) and its cool-down re-listed; (order, makespan), or None when no pairing keeps
    the makespan and the limit. Only the ``STRAY_RELISTS`` best pairings are re-listed; never worse
    than ``ranks``. Past ``deadline`` no more pairings are scored or re-listed.
    """
    try:
        base = replay_order(layout, costs, ranks, "pair_strays")
    except ScheduleError:
        return None
    makespan = base.makespan
    scored = []
    for r in (r for r in range(layout.P) if base.rank_end[r] >= makespan - 1e-9):
        for ops in stray_pairings(ranks[r]):
            if deadline is not None and time.perf_counter() > deadline:
                break
            cand = list(ranks)
            cand[r] = ops
            lo, hi = changed_span(ranks[r], ops)
            try:  # over the limit or the makespan: ruled out where it happens
                run = base.changed(cand, r, lo, Cutoff(limits, makespan), hi)
            except ScheduleError:
                continue
            if not run.over:
                scored.append(((run.makespan, sum(run.rank_end)), len(scored), cand))
    scored.sort(key=lambda x: x[:2])
    best = None
    for _, _, cand in scored[:STRAY_RELISTS]:
        got = relist_cooldown(layout, costs, limits, cand, deadline=deadline)
        if got is not None and (best is None or got[1] < best[1]):
            best = got
    return best


def anneal_repaired(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks, rng: random.Random, steps: int,
                    deadline: float | None, moves: tuple, heat: float, work: int | None, floor: float,
                    cold_reach: int, pairing: bool,
                    checkpoints: tuple[float, ...] = REPAIR_CHECKPOINTS) -> tuple[Ranks, float]:
    """``local.anneal`` of one long chain, stopped at ``checkpoints`` (fractions of its steps and work) to
    repair its best order (``repairs``) and go on from the repaired one where that is better; the best
    order and its makespan.

    Re-listing a cool-down or pairing a stray lone F and B moves many ops at once, which the chain's
    one-op moves reach only by luck; from the repaired order the colder rest of the chain finds what
    the repair opened up (V, P=8, M=24, all-to-all 1.0 of F: a chain ending at 198 repairs to 194,
    and 0.4 M more work from there plus a repair reach the optimum 190 on two of three seeds, where
    the same work from 198 does not). The temperature falls on one schedule across the parts.
    """
    P = layout.P
    start = replay_order(layout, costs, ranks, "anneal_repaired")
    t_hi = heat * start.makespan / P
    best, makespan = ranks, start.makespan
    bounds = (0.0, *checkpoints, 1.0)
    for lo, hi in zip(bounds, bounds[1:]):
        if deadline is not None and time.perf_counter() > deadline:
            break
        share = hi - lo
        best, makespan = anneal(layout, costs, limits, best, rng, max(1, int(steps * share)), deadline, moves,
                                heat=heat, work=None if work is None else max(1, int(work * share)), floor=floor,
                                cold_reach=cold_reach, phase=(lo, hi), t_hi=t_hi)
        if hi >= 1.0 or makespan <= floor + 1e-9:
            break
        key = _score(layout, costs, best)
        for cand, _ in repairs(layout, costs, limits, best, floor, pairing, deadline):
            got = _score(layout, costs, cand)
            if got is not None and got < key:
                best, key = cand, got
        makespan = key[0]
    return best, makespan


def _score(layout: Layout, costs: Costs, ranks: Ranks) -> tuple[float, float] | None:
    """(makespan, sum of rank ends) of ``ranks``; None if it deadlocks."""
    ev = evaluate(layout, costs, ranks)
    return None if ev is None else (ev[0], sum(ev[1]))
