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
"""

from __future__ import annotations

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


def unpaired_bound(layout: Layout, costs: Costs) -> float:
    """The largest per-rank bound from the F's that must run before any B (see the module docstring)."""
    sc = costs.per_stage(layout.S)
    head, _ = _paths(layout, sc)
    per_chain = [len(mbs) for mbs in layout.chain_mbs]
    best = 0.0
    for local in layout.local:
        chains = {c for c, _ in local if per_chain[c]}
        if len(local) < 2 or not chains:
            continue
        u = min(sum(1 for c2, _ in local if c2 == c) for c in chains)
        n = sum(per_chain[c] for c, _ in local)
        lone_work = sum(per_chain[c] * (sum(_lone(sc, s)) + rule(W).cost(sc, s)) for c, s in local)
        save = max([0.0] + [sum(_lone(sc, s1)[:1]) + _lone(sc, s2)[1] - sc.fb_cost(s1, B, s2)
                            for c1, s1 in local for c2, s2 in local if (c1, s1) != (c2, s2)])
        widest_f = max(_lone(sc, s)[0] for _, s in local)
        t_b = min(_first_b(layout, sc, head, c, s) for c, s in local)
        start = min(head[c][s] for c, s in local)
        best = max(best, min(max(t_b - k * widest_f, start) + lone_work - (n - k) * save
                             for k in range(u, n + 1)))
    return best


def lower_bound(layout: Layout, costs: Costs) -> float:
    """The largest per-rank bound (see the module docstring), the unpaired-F bound included."""
    return max(work_bound(layout, costs), unpaired_bound(layout, costs))


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
