"""How a free rank picks among its ready ops during list scheduling, and the grid ``auto`` tries."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from ..costs import StageCosts


@dataclass(frozen=True)
class Policy:
    """The decisions of one list-scheduling walk (see ``listsched``)."""

    b_first: bool = True      # a ready B goes before a ready F
    split: bool = True        # B and W as separate ops (W deferred), else fused BW
    pair: bool = False        # run a ready F and a ready B of different local stages as one FB unit
    reserve: bool = True      # admit a micro-batch only when all its ranks keep a slot for it
    deep_first: bool = True   # among ready F's, the stage deeper in its chain first
    w_fill: bool = True       # fill any idle moment with a W, else only when it ends before the next known ready op
    pair_wait: bool = False   # with pair: hold a lone F (B) for a B (F) due soon when the FB saves more than the wait
    inject_first: bool = False  # a micro-batch entering the pipeline beats a ready B (and a W frees its slot first)
    hold_b: bool = False      # leave the rank idle rather than start an F or W that a B due sooner would wait for
    cap: int = 0              # > 0: at most cap * (stages left in the chain) micro-batches between F and B per stage
    w_eager: bool = False     # run a deferred W before anything else: FB(F+B) then its W, as the exact schedules do
    fifo: bool = False        # among ready F's (B's), the one whose inputs arrived first: the two chains interleave
    stage_caps: tuple[int, ...] = ()  # per (chain * S + stage): at most this many micro-batches between F and B


def _sensible(p: Policy, saves: bool) -> bool:
    if not p.split and not p.w_fill:
        return False  # without W ops there is nothing to fill with
    if p.pair_wait and not (p.pair and saves):
        return False  # waiting for a partner only pays when the FB unit is cheaper than its halves
    return not (p.inject_first and not p.b_first)  # with F first, injecting first changes nothing


def policies(placement: str, costs: StageCosts) -> list[Policy]:
    """The deterministic policy grid tried first (pairing only where a rank has two stages)."""
    pair_opts = (False, True) if placement in ("v", "dual") else (False,)
    saves = any(costs.a2a_f) or any(costs.a2a_b) or costs.fb is not None
    both = (True, False)
    grid = []
    for b_first, split, pair, reserve, deep_first, w_fill, pair_wait, inject_first in product(
            both, both, pair_opts, both, both, both, (False, True), (False, True)):
        p = Policy(b_first, split, pair, reserve, deep_first, w_fill, pair_wait, inject_first)
        if _sensible(p, saves):
            grid.append(p)
    return grid


def fb_policies(placement: str, costs: StageCosts) -> list[Policy]:
    """Pairing policies with eager W's, in arrival order or not: the FB polish's walks (``search``).

    Arrival order (``fifo``) interleaves the two chains of a rank as the exact schedules do, where
    depth alone starts one chain's micro-batches back to back and leaves the other's B's unpaired.
    """
    return [replace(p, w_eager=True, fifo=fifo) for p in policies(placement, costs) if p.pair and p.split and p.w_fill
            for fifo in (False, True)]
