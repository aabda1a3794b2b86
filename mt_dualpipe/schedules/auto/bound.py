"""Makespans no schedule of a placement can beat: how far ``auto``'s result may still be from optimal.

Memory is ignored, so the bound holds under every limit. Per rank it takes the largest of:

* **work + start-up**: the rank's total work plus the forward path of the first micro-batch to
  the rank's first stage (no backward exists yet that an FB unit could hide its all-to-all behind);
* **F/B work + drain**: the work before its last B plus the shortest drain after it (the backward
  path of that micro-batch down to stage 0 and stage 0's W);

Inside an FB unit the exposed all-to-all is hidden, so a rank with two stages counts a micro-batch's
work at the cheaper of "lone" and "paired". That assumes every F can be paired; ``unpaired_bound``
counts the ones that cannot:

* **unpaired F's**: no B can start on a rank before the first micro-batch has run every local stage
  of its chain there and come back (``T_B``), so the F's it runs before then are lone, at least one
  per local stage of a chain (2 on a V's ranks, 1 with dual); each lone F leaves one B without a
  partner. With ``k`` such F's the rank needs at least
  ``max(T_B - k * (costliest lone F), start-up) + (all its work run lone) - (N - k) * (largest saving of a pair)``,
  and the bound is the smallest of these over ``k``.

``pairing_window_bound`` looks at each of a rank's two stages apart. An FB unit pairs an F of one
stage with a B of the other, so it cannot start before that B can: with ``t1`` the first moment
a B of stage ``y`` can start and ``t2 >= t1`` that of stage ``x``,

* **pairing windows**: the ``n1`` F's of x started before ``t1`` and the ``a`` F's of y started
  before ``t2`` are lone (at most as many as fit after each stage's first input arrives); the
  rest can pair, at most ``N_x - n1`` with B's of y and ``N_y - a`` with B's of x, each saving
  the most an FB unit saves (with a plain B or a BW);
* **idle before the first B's**: before ``t1`` only F's run, before ``t2`` nothing of x but its
  F's and of y only what its ``a`` F's allow (their B's and W's); the rank idles for the rest.

The rank needs at least start-up + (all its work run lone) - (savings) + (that idle), minimised
over ``n1`` and ``a``. On the dual placement with a heavy first and last stage, latency 0.3 and
exposed all-to-all 0.5 (P=8, M=20) it lifts the bound from 111.6 to 114 (auto: 116); checked
against every proved optimum and every hand schedule of random profiles in the tests.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..costs import Costs, StageCosts
from ..ops import BW, B, F, W, rule
from .layout import Layout


def _paths(layout: Layout, sc: StageCosts) -> tuple[list[list[float]], list[list[float]]]:
    """Per (chain, stage): the forward path to it, and the backward path from it to the end of stage 0's W."""
    S = layout.S
    head = [[0.0] * S for _ in layout.placement]
    drain = [[0.0] * S for _ in layout.placement]
    for c, chain in enumerate(layout.placement):
        for s in range(1, S):
            hop = sc.comm[s - 1] if chain[s - 1] != chain[s] else 0.0
            head[c][s] = head[c][s - 1] + sc.f[s - 1] + sc.a2a_f[s - 1] + hop  # nothing to overlap with yet
        for s in range(1, S):
            hop = sc.comm[s] if chain[s] != chain[s - 1] else 0.0
            back = sc.b[s - 1] + sc.recompute[s - 1]  # an FB unit may hide its all-to-all, not its work
            drain[c][s] = drain[c][s - 1] + back + hop + (sc.w[0] if s == 1 else 0.0)
    return head, drain


def _unit_cost(sc: StageCosts, s: int, can_overlap: bool) -> float:
    """One micro-batch's F + B + W at stage ``s``: lone, or inside FB units when the rank can pair."""
    lone = sum(_lone(sc, s)) + rule(W).cost(sc, s)
    if not can_overlap:
        return lone
    return min(lone, sc.fb_cost(s, BW, s))


def _lone(sc: StageCosts, s: int) -> tuple[float, float]:
    """A lone F's and a lone B's cost at stage ``s`` (exposed all-to-all included), from ``ops``."""
    return rule(F).cost(sc, s), rule(B).cost(sc, s)


def _first_b(layout: Layout, sc: StageCosts, head: list[list[float]], c: int, s: int) -> float:
    """The earliest start of any B of (c, s): the first micro-batch's path to the chain's end and back."""
    S, chain = layout.S, layout.placement[c]
    t = head[c][S - 1] + _lone(sc, S - 1)[0]
    for x in range(S - 1, s, -1):
        fastest = _lone(sc, x)[1]
        for y in range(S):  # the B may hide in an FB unit with any F of the same rank
            if chain[y] == chain[x] and y != x:
                fastest = min(fastest, sc.fb_cost(y, B, x))
        t += fastest + (sc.comm[x] if chain[x] != chain[x - 1] else 0.0)
    return t


def _rank_inputs(layout: Layout, costs: Costs) -> tuple[StageCosts, list[list[float]], list[int]]:
    """What the per-rank pairing bounds read: per-stage costs, forward paths, micro-batches per chain."""
    sc = costs.per_stage(layout.S)
    head, _ = _paths(layout, sc)
    return sc, head, [len(mbs) for mbs in layout.chain_mbs]


def unpaired_bound(layout: Layout, costs: Costs) -> float:
    """The largest per-rank bound from the F's that must run before any B (see the module docstring)."""
    sc, head, per_chain = _rank_inputs(layout, costs)
    best = 0.0
    for local in layout.local:
        chains = {c for c, _ in local if per_chain[c]}
        if len(local) < 2 or not chains:
            continue
        u = min(sum(1 for c2, _ in local if c2 == c) for c in chains)
        n = sum(per_chain[c] for c, _ in local)
        lone_work = sum(per_chain[c] * (sum(_lone(sc, s)) + rule(W).cost(sc, s)) for c, s in local)
        save = max([0.0] + [_pair_saving(sc, s1, s2) for c1, s1 in local for c2, s2 in local if (c1, s1) != (c2, s2)])
        widest_f = max(_lone(sc, s)[0] for _, s in local)
        t_b = min(_first_b(layout, sc, head, c, s) for c, s in local)
        start = min(head[c][s] for c, s in local)
        best = max(best, min(max(t_b - k * widest_f, start) + lone_work - (n - k) * save
                             for k in range(u, n + 1)))
    return best


def _fits(until: float, head: float, each: float) -> int:
    """How many ops of duration ``each`` one rank can start in ``[head, until)``."""
    if until <= head:
        return 0
    return math.ceil((until - head) / each - 1e-9) if each > 0 else 10**9


def _window_bound(N: tuple[int, int], head: tuple[float, float], t_b: tuple[float, float],
                  lone: tuple[tuple[float, float, float], tuple[float, float, float]],
                  save: tuple[float, float]) -> float:
    """``pairing_window_bound`` for one rank's two stages; index 1 is the one whose B can come first."""
    (nx, ny), (hx, hy), (t2, t1), ((fx, bx, wx), (fy, by, wy)) = N, head, t_b, lone
    start = min(hx, hy)
    total = nx * (fx + bx + wx) + ny * (fy + by + wy)
    best = math.inf
    for n1 in range(min(nx, _fits(t1, hx, fx)) + 1):  # F's of x started before t1: lone
        for a in range(min(ny, _fits(t2, hy, fy)) + 1):  # F's of y started before t2: lone
            a1 = min(a, _fits(t1, hy, fy))
            idle = max(0.0, t1 - start - n1 * fx - a1 * fy,  # before t1 only F's run
                       t2 - start - nx * fx - a * (fy + by + wy))  # before t2 no B or W of x
            pairs = min(nx - n1, ny) * save[0] + min(ny - a, nx) * save[1]
            best = min(best, start + total - pairs + idle)
    return best


def _pair_saving(sc: StageCosts, f_stage: int, b_stage: int) -> float:
    """What one FB unit of an F of ``f_stage`` and a backward of ``b_stage`` saves over running them lone.

    The larger of the unit with a plain B and the one with a BW: with ``fb`` below the W's cost the
    B version is clamped at 0 and the BW one also absorbs the W.
    """
    f, b, w = _lone(sc, f_stage)[0], _lone(sc, b_stage)[1], rule(W).cost(sc, b_stage)
    return max(0.0, f + b - sc.fb_cost(f_stage, B, b_stage), f + b + w - sc.fb_cost(f_stage, BW, b_stage))


def pairing_window_bound(layout: Layout, costs: Costs) -> float:
    """The largest per-rank bound from when each of a rank's two stages can first pair (module docstring)."""
    sc, head, per_chain = _rank_inputs(layout, costs)
    best = 0.0
    for local in layout.local:
        if len(local) != 2 or not all(per_chain[c] for c, _ in local):
            continue
        (cx, x), (cy, y) = local
        t_b = (_first_b(layout, sc, head, cx, x), _first_b(layout, sc, head, cy, y))
        if t_b[0] < t_b[1]:
            (cx, x), (cy, y), t_b = (cy, y), (cx, x), (t_b[1], t_b[0])
        lone = tuple((*_lone(sc, s), rule(W).cost(sc, s)) for s in (x, y))
        save = (_pair_saving(sc, x, y), _pair_saving(sc, y, x))
        best = max(best, _window_bound((per_chain[cx], per_chain[cy]), (head[cx][x], head[cy][y]), t_b,
                                       lone, save))
    return best


def lower_bound(layout: Layout, costs: Costs) -> float:
    """The largest per-rank bound (see the module docstring), the unpaired-F and pairing-window bounds included.

    Uneven micro-batches (``Costs.mb_scale``): the bounds of the problem where every micro-batch costs
    as little as the cheapest one (every op of this problem takes at least as long, so no schedule of
    it ends sooner), and the work bound with each rank's work summed over the micro-batches as they
    are (``uneven_work_bound``). Both hold whichever slot each micro-batch runs in.
    """
    if costs.mb_scale is not None:
        return max(lower_bound(layout, cheapest(costs)), uneven_work_bound(layout, costs))
    return max(work_bound(layout, costs), unpaired_bound(layout, costs), pairing_window_bound(layout, costs))


def cheapest(costs: Costs) -> Costs:
    """``costs`` with every micro-batch as cheap as the cheapest: every compute time scaled by the smallest
    factor, latency and gradient reduction as they are (they are not scaled), no per-micro-batch factors."""
    low = min(min(costs.mb_scale or (1.0,)), min(costs.mb_scale_w or costs.mb_scale or (1.0,)))
    return replace(costs.with_microbatches(None).scaled(low), comm=costs.comm, dp_sync=costs.dp_sync)


def uneven_work_bound(layout: Layout, costs: Costs) -> float:
    """``work_bound`` with each micro-batch's own factors: per rank, the work of every micro-batch at the
    rank's stages of the chain where it costs least (which chain a micro-batch takes depends on its slot),
    after the start-up of the cheapest one and, for the F/B work, before the drain of the cheapest one."""
    sc = costs.per_stage(layout.S)
    head, drain = _paths(layout, cheapest(costs).per_stage(layout.S))
    pairs_save = sc.fb is not None or any(sc.a2a_f) or any(sc.a2a_b)
    k, kw = sc.mb_scale, sc.mb_scale_w or sc.mb_scale
    best = 0.0
    for local in layout.local:
        if not local:
            continue
        can_overlap = len(local) > 1 and pairs_save
        work = fb_work = 0.0
        for m in range(len(k)):
            per_chain: dict[int, list[float]] = {}
            for c, s in local:
                lone = sum(rule(x).scaled_cost(sc, s, k[m], kw[m]) for x in (F, B, W))
                unit = min(lone, sc.fb_cost(s, BW, s, k[m], k[m], kw[m])) if can_overlap else lone
                got = per_chain.setdefault(c, [0.0, 0.0])
                got[0] += unit
                got[1] += max(0.0, unit - sc.w[s] * kw[m])
            work += min(x[0] for x in per_chain.values())
            fb_work += min(x[1] for x in per_chain.values())
        start = min(head[c][s] for c, s in local)
        tail = min(drain[c][s] for c, s in local)
        best = max(best, start + work, start + fb_work + tail)
    return best


def work_bound(layout: Layout, costs: Costs) -> float:
    """Work + start-up and F/B work + drain, per rank, with every F assumed paired where pairs save."""
    sc = costs.per_stage(layout.S)
    head, drain = _paths(layout, sc)
    per_chain = [len(mbs) for mbs in layout.chain_mbs]
    pairs_save = sc.fb is not None or any(sc.a2a_f) or any(sc.a2a_b)
    best = 0.0
    for local in layout.local:
        if not local:
            continue
        can_overlap = len(local) > 1 and pairs_save
        work = fb_work = 0.0
        for c, s in local:
            unit = _unit_cost(sc, s, can_overlap)
            work += per_chain[c] * unit
            fb_work += per_chain[c] * max(0.0, unit - sc.w[s])
        start = min(head[c][s] for c, s in local)
        tail = min(drain[c][s] for c, s in local)
        best = max(best, start + work, start + fb_work + tail)
    return best
