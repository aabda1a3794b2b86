"""Which micro-batch each slot runs, when micro-batches differ in cost (``Costs.mb_scale``).

A schedule's ops name micro-batch *slots*; with uneven micro-batches (sequences of different
lengths) it matters which micro-batch of the step takes which slot. The pipeline fills with the
first slots' forwards and drains with the last slots' backwards, and there a costly micro-batch is
paid on every rank in turn with little to overlap it; in the steady state its extra time on one
rank overlaps with other micro-batches on the others. So ``auto`` chooses a permutation
(``Schedule.microbatch_order``) and then searches the op order for the costs it gives each slot
(``slot_costs``):

1. **candidates**: arrival order, cheapest first, costliest first, the cheapest at both ends and
   the costliest in the middle, and costly and cheap in turn; each scored by the best of the
   placement's hand schedules and a few list-scheduling walks under its slot costs
   (``score_order``);
2. **swaps** (``improve_order``): the best candidate's best order is kept and two micro-batches
   exchange slots while that lowers its makespan (first improvement, a bounded number of full
   simulations, in a fixed order: deterministic). The search runs it again on its final order.

The search itself is unchanged: ops of one (kind, chain, stage) still run their slots in order
(``local.renumber``), so a chain's slots enter it in slot order.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..costs import Costs
from ..errors import ScheduleError
from ..ir import ComputeItem, Schedule
from ..simulate import run_schedule
from .layout import Layout
from .listsched import list_schedule
from .policies import Policy

Ranks = list[list[ComputeItem]]
Order = tuple[int, ...]

SWAP_SIMULATIONS = 400
"""At most this many simulated swaps per ``improve_order`` call (about 0.5 s at P=8, M=32 on the linear
placement): every pair once at M <= 28, a prefix of the fixed pair order above."""


def slot_costs(costs: Costs, order: Sequence[int]) -> Costs:
    """``costs`` with its per-micro-batch factors given per slot: slot m gets those of micro-batch ``order[m]``."""
    k, kw = costs.mb_scale, costs.mb_scale_w or costs.mb_scale
    if k is None:
        return costs
    return costs.with_microbatches([k[m] for m in order], [kw[m] for m in order])


def weights(layout: Layout, costs: Costs) -> list[float]:
    """Per micro-batch (arrival order), its compute summed over one chain's stages: what the candidates sort by."""
    sc = costs.per_stage(layout.S)
    k, kw = sc.mb_scale, sc.mb_scale_w or sc.mb_scale
    fb = sum(sc.f[s] + sc.a2a_f[s] + sc.b[s] + sc.a2a_b[s] + sc.recompute[s] for s in range(layout.S))
    w = sum(sc.w)
    return [fb * k[m] + w * kw[m] for m in range(len(k))]


def candidates(weight: Sequence[float]) -> list[tuple[str, Order]]:
    """The candidate permutations (slot -> micro-batch) of ``auto``'s first step, arrival order first."""
    M = len(weight)
    asc = sorted(range(M), key=lambda m: (weight[m], m))
    ends: list[int] = [0] * M  # cheapest at slots 0, M-1, 1, M-2, ...: the costliest in the middle
    for i, m in enumerate(asc):
        ends[i // 2 if i % 2 == 0 else M - 1 - i // 2] = m
    desc = asc[::-1]
    alternate = [desc[i // 2] if i % 2 == 0 else asc[i // 2] for i in range(M)]
    out: list[tuple[str, Order]] = []
    for name, order in (("arrival", list(range(M))), ("cheapest first", asc), ("costliest first", desc),
                        ("cheap ends", ends), ("alternating", alternate)):
        if all(tuple(order) != o for _, o in out):
            out.append((name, tuple(order)))
    return out


def _policies(layout: Layout) -> list[Policy]:
    """The walks each candidate is scored with: the default, late W's, shallow-first, and pairing where ranks
    hold two stages."""
    pols = [Policy(), Policy(w_fill=False), Policy(deep_first=False)]
    if any(len(x) > 1 for x in layout.local):
        pols += [Policy(pair=True), Policy(pair=True, w_eager=True, fifo=True)]
    return pols


def _makespan(layout: Layout, costs: Costs, ranks: Ranks, limits: list[int]) -> float | None:
    """The makespan of ``ranks`` under (slot) ``costs``; None on deadlock or over a limit."""
    sched = Schedule("auto", layout.P, layout.M, layout.placement, layout.microbatch_chain, ranks)
    try:
        res = run_schedule(sched, costs, record=False)
    except ScheduleError:
        return None
    if any(p > lim for p, lim in zip(res.peak_activations, limits)):
        return None
    return res.makespan


def score_order(layout: Layout, costs: Costs, limits: list[int], order: Order,
                hands: Sequence[Schedule]) -> tuple[float, Ranks | None]:
    """(makespan, order of ops) of the best of ``hands`` and the scoring walks under ``order``'s slot costs."""
    slot = slot_costs(costs, order)
    sc = slot.per_stage(layout.S)
    best: tuple[float, Ranks | None] = (float("inf"), None)
    tried = [[list(ops) for ops in h.ranks] for h in hands]
    tried += [got for pol in _policies(layout) if (got := list_schedule(layout, sc, limits, pol)) is not None]
    for ranks in tried:
        got = _makespan(layout, slot, ranks, limits)
        if got is not None and got < best[0] - 1e-9:
            best = (got, ranks)
    return best


def choose_order(layout: Layout, costs: Costs, limits: list[int],
                 hands: Sequence[Schedule]) -> tuple[Order, dict]:
    """The permutation the search runs with (slot -> micro-batch), and what ``meta`` says of its choice."""
    scored = []
    for name, order in candidates(weights(layout, costs)):
        makespan, ranks = score_order(layout, costs, limits, order, hands)
        scored.append((makespan, len(scored), name, order, ranks))
    makespan, _, name, order, ranks = min(scored, key=lambda x: x[:2])
    info = {"candidates": {x[2]: x[0] for x in scored}, "chosen": name}
    if ranks is not None:
        order, improved = improve_order(layout, costs, limits, ranks, order)
        info["swapped"] = improved < makespan - 1e-9
    return order, info


def improve_order(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks, order: Order,
                  budget: int = SWAP_SIMULATIONS) -> tuple[Order, float]:
    """``order`` with pairs of micro-batches exchanged while that lowers the makespan of ``ranks`` (the op
    order stays); the new permutation and its makespan. Never worse; at most ``budget`` simulations."""
    best = _makespan(layout, slot_costs(costs, order), ranks, limits)
    if best is None:
        raise ScheduleError("improve_order needs an order of ops that runs within the limits")
    current = list(order)
    k, kw = costs.mb_scale, costs.mb_scale_w or costs.mb_scale
    M, spent, improved = len(current), 0, True
    while improved and spent < budget:
        improved = False
        for i in range(M - 1):
            for j in range(i + 1, M):
                a, b = current[i], current[j]
                if k[a] == k[b] and kw[a] == kw[b]:
                    continue  # alike: exchanging them changes nothing
                if spent >= budget:
                    return tuple(current), best
                trial = list(current)
                trial[i], trial[j] = trial[j], trial[i]
                spent += 1
                got = _makespan(layout, slot_costs(costs, trial), ranks, limits)
                if got is not None and got < best - 1e-9:
                    current, best, improved = trial, got, True
    return tuple(current), best
