"""Local search: hill climbing on per-rank op orders, scored by the one simulator (``run_schedule``).

A move changes one rank's order; it is kept when (makespan, sum of rank end times) does not grow
and every rank stays within its activation limit. Moves are drawn with the probabilities of
``MOVES`` (or ``FB_MOVES`` in the FB polish); ranks that finish last (they set the makespan) are
picked half of the time. A move that makes an op wait for one after it on the same rank is
rejected without simulating (``waits_on_later``, exact: such an order always deadlocks).

Order transforms used around it: ``split_backward`` (every BW as B then W: never worse),
``sink_ws`` (W's to the end of their rank where that does not hurt), ``close_gaps`` (later W's
into the idle gaps they fit, held-back producers raised: never worse), ``renumber`` (micro-batches
in order per stage and kind: never worse either; annealing keeps its orders so) and
``in_microbatch_order`` (what the exact backend's symmetry breaking needs of its hint).
"""

from __future__ import annotations

import math
import random
import time
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate, islice

from ..costs import Costs
from ..errors import ScheduleError
from ..ir import FB, ComputeItem, Op, Schedule
from ..ops import OpKind, OpTable, makes, parts, producers
from ..simulate import Cutoff, Replay, changed_span, run_schedule
from .layout import Layout

Ranks = list[list[ComputeItem]]
Evaluation = tuple[float, list[float], list[int]]  # makespan, per-rank end times, per-rank peaks


def evaluate(layout: Layout, costs: Costs, ranks: Ranks) -> Evaluation | None:
    """(makespan, per-rank end times, per-rank peak activations) by ``run_schedule``; None on deadlock."""
    sched = Schedule("auto", layout.P, layout.M, layout.placement, layout.microbatch_chain, ranks)
    try:
        res = run_schedule(sched, costs, record=False)
    except ScheduleError:
        return None
    return res.makespan, res.rank_end, res.peak_activations


def replay_order(layout: Layout, costs: Costs, ranks: Ranks, what: str) -> Replay:
    """The ``Replay`` of a start order; ``ScheduleError`` naming ``what`` needs it if it deadlocks."""
    sched = Schedule("auto", layout.P, layout.M, layout.placement, layout.microbatch_chain, ranks)
    try:
        return Replay(sched, costs)
    except ScheduleError as exc:
        raise ScheduleError(f"{what} needs a schedule that runs to completion") from exc


def fits(peaks: list[int], limits: list[int]) -> bool:
    """True when every rank's peak activations are within its limit."""
    return all(peak <= lim for peak, lim in zip(peaks, limits))


def _try(base: Replay, cand: Ranks, r: int, lo: int, cutoff: Cutoff, hi: int | None = None) -> Replay | None:
    """``base`` re-simulated with rank ``r`` changed from ``lo`` on (to ``hi``, if known); None on deadlock.

    The result has ``over`` set when it went over an activation limit or the cut-off score.
    """
    try:
        return base.changed(cand, r, lo, cutoff, hi)
    except ScheduleError:
        return None


# ----- moves: each takes (rank's ops, index, rng, window) and returns a new order or None --------
def _shift(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Move one item a few places."""
    j = min(len(ops) - 1, max(0, i + rng.randint(-window, window)))
    if j == i:
        return None
    new = list(ops)
    new.insert(j, new.pop(i))
    return new


def _pair(ops: list[ComputeItem], i: int, rng: random.Random, window: int,
          late: bool = False) -> list[ComputeItem] | None:
    """Pair a lone F with a nearby lone B/BW of another stage (or the reverse) into an FB unit.

    The unit takes the earlier op's place, or with ``late`` the later one's (what a held-back F
    needs when its partner's inputs come from ops in between).
    """
    item = ops[i]
    if type(item) is FB:
        return None
    if item.kind == OpKind.F:
        want: tuple[OpKind, ...] = (OpKind.B, OpKind.BW)
    elif item.kind in (OpKind.B, OpKind.BW):
        want = (OpKind.F,)
    else:
        return None
    js = [j for j in range(max(0, i - window), min(len(ops), i + window + 1))
          if j != i and type(ops[j]) is Op and ops[j].kind in want
          and (ops[j].chain, ops[j].stage) != (item.chain, item.stage)]
    if not js:
        return None
    j = rng.choice(js)
    f, b = (item, ops[j]) if item.kind == OpKind.F else (ops[j], item)
    new = list(ops)
    keep, drop = (max(i, j), min(i, j)) if late else (min(i, j), max(i, j))
    new[keep] = FB(f, b)
    del new[drop]
    return new


def _pair_late(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """``_pair`` with the unit at the later op's place."""
    return _pair(ops, i, rng, window, late=True)


def _unpair(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Split an FB unit into its two halves, in either order."""
    item = ops[i]
    if type(item) is not FB:
        return None
    halves = [item.f, item.b] if rng.random() < 0.5 else [item.b, item.f]
    return ops[:i] + halves + ops[i + 1:]


def _own_b(ops: list[ComputeItem], i: int) -> int | None:
    """The index of the lone B before the W at ``ops[i]`` that is its own (same chain, stage, micro-batch)."""
    w = ops[i]
    return next((k for k in range(i - 1, -1, -1) if type(ops[k]) is Op and ops[k].kind == OpKind.B
                 and ops[k][1:] == w[1:]), None)


def _split_bw(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """A lone BW becomes B then W; a W merges back into its B as one BW."""
    item = ops[i]
    if type(item) is not Op:
        return None
    new = list(ops)
    if item.kind == OpKind.BW:
        new[i] = Op(OpKind.B, item.chain, item.stage, item.mb)
        new.insert(i + 1, Op(OpKind.W, item.chain, item.stage, item.mb))
        return new
    if item.kind != OpKind.W:
        return None
    j = _own_b(ops, i)
    if j is None:
        return None
    new[j] = Op(OpKind.BW, item.chain, item.stage, item.mb)
    del new[i]
    return new


def _swap(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Swap an item with the next one."""
    if i + 1 >= len(ops):
        return None
    new = list(ops)
    new[i], new[i + 1] = new[i + 1], new[i]
    return new


def _sink_w(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Push a W later, up to three windows: the solver's schedules delay W's to the cool-down."""
    if type(ops[i]) is not Op or ops[i].kind != OpKind.W:
        return None
    j = min(len(ops) - 1, i + rng.randint(1, 3 * window))
    if j == i:
        return None
    new = list(ops)
    new.insert(j, new.pop(i))
    return new


def _swap_fb_b(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Exchange the B of an FB unit with a nearby lone B of another micro-batch (the F stays paired)."""
    item = ops[i]
    if type(item) is not FB:
        return None
    js = [j for j in range(max(0, i - window), min(len(ops), i + window + 1))
          if type(ops[j]) is Op and ops[j].kind == item.b.kind and ops[j][1:3] != item.f[1:3]]
    if not js:
        return None
    j = rng.choice(js)
    new = list(ops)
    new[i], new[j] = FB(item.f, ops[j]), item.b
    return new


def _unpair_spread(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Split an FB unit and move one half a few places later (the other keeps the unit's place).

    The exact schedules of heavy-end profiles unpair a unit whose F feeds the critical path: the
    F alone ends sooner and the B runs after the next rank's urgent B. Done as ``unpair`` then
    ``shift`` the first step usually costs more than the second wins back, so hill climbing never
    takes it; as one move it does.
    """
    item = ops[i]
    if type(item) is not FB or i + 1 >= len(ops):
        return None
    first, second = (item.f, item.b) if rng.random() < 0.5 else (item.b, item.f)
    j = min(len(ops), i + 1 + rng.randint(1, window))
    return ops[:i] + [first] + ops[i + 1:j] + [second] + ops[j:]


def _pull_w(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Move a W to right after its B: what merging them into one BW does, with the backward kept split
    (annealing keeps every order free of BW's, see ``renumber``)."""
    item = ops[i]
    if type(item) is not Op or item.kind != OpKind.W:
        return None
    j = _own_b(ops, i)
    if j is None or j + 1 == i:
        return None
    new = list(ops)
    new.insert(j + 1, new.pop(i))
    return new


def _pair_pull(ops: list[ComputeItem], i: int, rng: random.Random, window: int) -> list[ComputeItem] | None:
    """Pair a lone F or B with a partner up to two windows later, the unit at the later place.

    The exact schedules hold a micro-batch's F back (the rank idles) to hide its all-to-all in an
    FB unit with a B that arrives later; ``pair_late`` only looks one window ahead.
    """
    return _pair(ops, i, rng, 2 * window, late=True)


Move = Callable[[list[ComputeItem], int, random.Random, int], "list[ComputeItem] | None"]
MOVES: tuple[tuple[str, float, Move], ...] = (
    ("shift", 0.35, _shift),
    ("pair", 0.20, _pair),
    ("unpair", 0.15, _unpair),
    ("split_bw", 0.15, _split_bw),
    ("swap", 0.15, _swap),
)
"""(name, probability, move) of every local-search move; the probabilities sum to 1."""
FB_MOVES: tuple[tuple[str, float, Move], ...] = (
    ("shift", 0.30, _shift),
    ("pair", 0.10, _pair),
    ("pair_late", 0.10, _pair_late),
    ("unpair", 0.10, _unpair),
    ("swap_fb_b", 0.15, _swap_fb_b),
    ("sink_w", 0.10, _sink_w),
    ("swap", 0.15, _swap),
)
"""The moves of the FB polish (backwards already split into B + W; see ``search``)."""
ANNEAL_MOVES: tuple[tuple[str, float, Move], ...] = (
    ("shift", 0.25, _shift),
    ("pair", 0.10, _pair),
    ("pair_late", 0.05, _pair_late),
    ("pair_pull", 0.05, _pair_pull),
    ("unpair", 0.05, _unpair),
    ("unpair_spread", 0.10, _unpair_spread),
    ("swap_fb_b", 0.10, _swap_fb_b),
    ("sink_w", 0.10, _sink_w),
    ("swap", 0.20, _swap),
)
"""The moves of annealing where FB units pay: the FB polish's, plus the compound ``unpair_spread``
and ``pair_pull`` (one move each for what the exact schedules do in two)."""
ANNEAL_PLAIN_MOVES: tuple[tuple[str, float, Move], ...] = (
    ("shift", 0.35, _shift),
    ("pair", 0.20, _pair),
    ("unpair", 0.15, _unpair),
    ("pull_w", 0.15, _pull_w),
    ("swap", 0.15, _swap),
)
"""The moves of annealing where FB units do not pay: ``MOVES`` with ``pull_w`` for ``split_bw``, so that
every order stays free of BW's."""


def _bounds(moves: tuple[tuple[str, float, Move], ...]) -> list[float]:
    return [round(x, 12) for x in accumulate(p for _, p, _ in moves)]


_BOUNDS = {id(m): _bounds(m) for m in (MOVES, FB_MOVES, ANNEAL_MOVES, ANNEAL_PLAIN_MOVES)}


def neighbour(ranks: Ranks, rng: random.Random, r: int, window: int,
              moves: tuple[tuple[str, float, Move], ...] = MOVES) -> Ranks | None:
    """One random move on rank ``r``'s order (a copy of ``ranks``), or None if the move does not apply."""
    ops = ranks[r]
    if len(ops) < 2:
        return None
    i = rng.randrange(len(ops))
    draw = rng.random()
    bounds = _BOUNDS.get(id(moves)) or _bounds(moves)
    k = bisect_right(bounds, draw)  # the first move whose cumulative probability is above the draw
    new = moves[k if k < len(moves) else -1][2](ops, i, rng, window)
    if new is None:
        return None
    out = list(ranks)
    out[r] = new
    return out


def waits_on_later(table: OpTable, r: int, ops: list[ComputeItem], lo: int, hi: int) -> bool:
    """True if an item of ``ops[lo:hi + 1]`` waits for a signal that an item at or after it on rank ``r`` makes.

    Such an order deadlocks for sure; a move only reorders its span, so checking the span finds
    every same-rank deadlock it creates without running the simulator.
    """
    tpl, S = table.templates(), table.S
    made: dict[int, int] = {}
    span = ops[lo:hi + 1]
    for i, item in enumerate(span):
        for kind, c, s, m in (item if type(item) is FB else (item,)):
            for k in tpl[kind][c * S + s][1]:
                made[k + m + m] = i
    if not made:
        return False
    for i, item in enumerate(span):
        for kind, c, s, m in (item if type(item) is FB else (item,)):
            for key, owner, _ in tpl[kind][c * S + s][0]:
                if owner == r and made.get(key + m + m, -1) >= i:
                    return True
    return False


def split_backward(ranks: list[list[ComputeItem]]) -> list[list[ComputeItem]]:
    """Every BW as B then W (inside an FB too): the same times and memory, and what the model uses."""
    out = []
    for ops in ranks:
        new: list[ComputeItem] = []
        for item in ops:
            b = item.b if type(item) is FB else item
            if b.kind != OpKind.BW:
                new.append(item)
                continue
            plain = Op(OpKind.B, b.chain, b.stage, b.mb)
            new.append(FB(item.f, plain) if type(item) is FB else plain)
            new.append(Op(OpKind.W, b.chain, b.stage, b.mb))
        out.append(new)
    return out


def in_microbatch_order(ranks: list[list[ComputeItem]]) -> bool:
    """True when every (kind, chain, stage) runs its micro-batches in increasing order."""
    last: dict[tuple[str, int, int], int] = {}
    for ops in ranks:
        for item in ops:
            for op in parts(item):
                key = (str(op.kind), op.chain, op.stage)
                if last.get(key, -1) > op.mb:
                    return False
                last[key] = op.mb
    return True


def renumber(ops: list[ComputeItem], lo: int, hi: int, like: list[ComputeItem] | None = None) -> list[ComputeItem]:
    """``ops`` with the micro-batches of ``ops[lo:hi + 1]`` renumbered in order per (kind, chain, stage).

    The micro-batches of a chain are interchangeable: give every (kind, chain, stage)'s k-th op the
    k-th of the micro-batches it runs, on every rank, and no op starts later than it did (when the
    k-th op of a kind started, k of its inputs were done, so the k-th producer was: the old times
    meet every wait of the new order, and the simulator starts each op as early as its waits allow),
    often sooner; the activation counts are the same (they count ops in order, not micro-batches).
    So orders in this form lose nothing, and annealing keeps to them: a move that only exchanges
    interchangeable ops then changes nothing and is not simulated, and the result keeps the
    micro-batch order the exact backend's symmetry breaking needs. Only ``ops[lo:hi + 1]`` is
    renumbered, with its own micro-batches: enough after a move inside that span of an order
    already in this form. It needs backwards split (a BW is a B and a W that would have to keep
    one number). Items equal to ``like``'s at the same index are ``like``'s (``changed_span``
    compares identity).
    """
    pools: dict[tuple[str, int, int], list[int]] = {}
    for item in islice(ops, lo, hi + 1):
        if type(item) is FB:
            f, b = item
            pools.setdefault(f[:3], []).append(f[3])
            pools.setdefault(b[:3], []).append(b[3])
        else:
            pools.setdefault(item[:3], []).append(item[3])
    out = list(ops)
    todo = {}  # the (kind, chain, stage)'s whose micro-batches the span runs out of order
    for key, mbs in pools.items():
        if len(mbs) > 1 and any(a > b for a, b in zip(mbs, islice(mbs, 1, None))):
            todo[key] = sorted(mbs, reverse=True)  # pop() hands them out smallest first
    if not todo:
        return out

    def numbered(op: Op) -> Op:
        pool = todo.get(op[:3])
        if pool is None:
            return op
        mb = pool.pop()
        return op if mb == op[3] else Op(op[0], op[1], op[2], mb)

    for i in range(lo, hi + 1):
        item = ops[i]
        new = FB(numbered(item[0]), numbered(item[1])) if type(item) is FB else numbered(item)
        if new is item or new == item:
            continue
        if like is not None and i < len(like) and new == like[i]:
            new = like[i]
        out[i] = new
    return out


def _better(score: tuple[float, float], cur: tuple[float, float]) -> bool:
    """Lower makespan, or the same makespan and no larger sum of rank end times."""
    return score[0] < cur[0] - 1e-9 or (score[0] <= cur[0] + 1e-9 and score[1] <= cur[1] + 1e-9)


def local_search(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks, rng: random.Random,
                 steps: int, deadline: float | None,
                 moves: tuple[tuple[str, float, Move], ...] = MOVES, window: int = 6) -> tuple[Ranks, float]:
    """Hill-climb on per-rank orders for ``steps`` moves (or until ``deadline``); the best order and makespan."""
    base = replay_order(layout, costs, ranks, "local search")
    cur, ends = (base.makespan, sum(base.rank_end)), base.rank_end
    P = layout.P
    table = OpTable(layout.placement, layout.M)
    late: list[int] = []
    for step in range(steps):
        if deadline is not None and step % 16 == 0 and time.perf_counter() > deadline:
            break
        if step % 64 == 0:  # bias towards the ranks that finish last: they set the makespan
            late = sorted(range(P), key=lambda x: -ends[x])[:max(1, P // 2)]
        r = rng.choice(late) if rng.random() < 0.5 else rng.randrange(P)
        cand = neighbour(ranks, rng, r, window, moves)
        if cand is None:
            continue
        lo, hi = changed_span(ranks[r], cand[r])
        if waits_on_later(table, r, cand[r], lo, hi):
            continue
        res = _try(base, cand, r, lo, Cutoff(limits, cur[0] + 1e-9), hi)
        if res is None or res.over:
            continue
        score = (res.makespan, sum(res.rank_end))
        if _better(score, cur):
            ranks, cur, ends, base = cand, score, res.rank_end, res
    return ranks, cur[0]


ANNEAL_HEAT = 0.006
"""The start temperature as a fraction of the start makespan per rank. Measured on the 45 small
profiles CP-SAT proves and the P=8, M=24 grid (benchmarks/results/auto_schedule.md, "History"):
0.025 accepted so many makespan losses that a chain spent most of its steps climbing back (P=8 dual,
exposed all-to-all 1.0 of F: 98-99 at 5,000 steps); 0.006 is nearly greedy on the makespan and
random on the tie-break (a tenth of the mean rank end), which is where the better orders are found
(95-97)."""


ANNEAL_COOL = 0.01
"""The end temperature of a chain as a fraction of its start temperature."""


ANNEAL_END_WEIGHT = 0.1
"""Weight of the mean rank end time in an annealing step's score (after the makespan)."""


ANNEAL_COLD_PHASE = 0.8
"""The spent fraction of a chain after which its moves reach ``cold_reach`` times as far (``anneal``)."""


ANNEAL_COLD_REACH = 2
"""How much farther the moves of a long chain (large problems: ``search.anneal_plan``) reach once it
is cold. Trying every single move on the P=8, M=24 V orders that annealing left one step above the
best known (all-to-all 1.0 of F: 193 against 192) found the improving ones to be mostly a W moved
about twelve places earlier, twice the window; a move that only raises W's, over the whole chain,
made the results worse (193.6-195.9 mean against 192.4: early on such moves break more than they
mend), and so did a W-raising move in the cold phase only (192.19 with the farther reach, 192.31
without). Reaching twice as far once the chain is cold (from 0.8 of it; 0.6, or three times as far,
were no better) took V 1.0 of F from 192.38 to 192.00 over 16 seeds and dual 0.5 of F from 86.03 to
85.94 at the same work (benchmarks/results/auto_schedule.md). Not on small problems, where twice the
window spans much of a rank's order: over 390 runs of the test profiles it gave 9 worse results and
2 better."""


REPLAY_WORK = 40
"""What one replayed move costs besides the ops it walks, in walked ops (``anneal``'s ``work``): drawing
the move, renumbering, setting up the replay. Measured at P=8, M=24: about 70 us per replay against
1.75 us per walked op, whether the replay walks 30 ops (dual placement) or 90 (V)."""


def _anneal_score(run: Replay, P: int) -> float:
    return run.makespan + ANNEAL_END_WEIGHT * sum(run.rank_end) / P


def anneal(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks, rng: random.Random, steps: int,
           deadline: float | None, moves: tuple[tuple[str, float, Move], ...] = ANNEAL_MOVES,
           window: int = 6, heat: float = ANNEAL_HEAT, work: int | None = None,
           floor: float = -math.inf, cold_reach: int = 1, phase: tuple[float, float] = (0.0, 1.0),
           t_hi: float | None = None) -> tuple[Ranks, float]:
    """Simulated annealing on per-rank orders; the best order seen and its makespan.

    Hill climbing stops where every single move costs something, yet the exact schedules are often
    two or three moves away on different ranks (unpair a unit here, move a B there). Annealing
    accepts a worse order with probability ``exp(-loss / T)``, ``T`` falling geometrically from
    ``heat`` times the start makespan per rank to a hundredth of that (per rank: with more ranks
    more moves land off the critical path, and a walk as hot as on a small problem drifts away).
    The score is the makespan plus a tenth of the mean rank end time: a move that lets a
    non-critical rank finish sooner is a step towards one that shortens the critical rank (as in
    ``local_search``'s tie-break). With ``work`` the chain also ends once its replays have walked that
    many ops (``simulate.Replay.walked``, plus ``REPLAY_WORK`` per replay), and cools by whichever of
    steps and work is further spent.
    The chain ends early once its best order's makespan is ``floor`` (a lower bound: it is optimal).
    Once it is cold (``ANNEAL_COLD_PHASE``) its moves reach ``cold_reach`` times ``window``: the last
    improvements are often one op moved farther than pays early on (``ANNEAL_COLD_REACH``).
    Orders are kept with backwards split and micro-batches renumbered in order (``renumber``), so
    ``moves`` may not merge a B and its W (``ANNEAL_PLAIN_MOVES`` is ``MOVES`` without that).
    ``phase=(lo, hi)`` runs only that part of the cooling (its steps and work spread over it), from
    the start temperature ``t_hi`` of the whole chain: what ``repair.anneal_repaired`` runs between
    its repairs.
    """
    if any(fn is _split_bw for _, _, fn in moves):
        raise ScheduleError("anneal keeps every backward split into B and W, so its moves cannot include "
                            "split_bw; allowed: ANNEAL_MOVES, ANNEAL_PLAIN_MOVES or others without it")
    ranks = [renumber(ops, 0, len(ops) - 1) for ops in split_backward(ranks)]
    base = replay_order(layout, costs, ranks, "annealing")
    P = layout.P
    cur = _anneal_score(base, P)
    best, best_key = ranks, (base.makespan, sum(base.rank_end))
    if base.makespan <= floor + 1e-9:
        return best, base.makespan
    if t_hi is None:
        t_hi = heat * base.makespan / P
    lo, span = phase[0], phase[1] - phase[0]
    spent = 0
    table = OpTable(layout.placement, layout.M)
    for step in range(steps):
        if deadline is not None and step % 16 == 0 and time.perf_counter() > deadline:
            break
        done = max(step / steps, spent / work) if work else step / steps
        if done >= 1.0:
            break
        done = lo + span * done  # where this part is in the whole chain's cooling
        temp = t_hi * ANNEAL_COOL ** done
        r = rng.randrange(P)
        reach = window * cold_reach if done > ANNEAL_COLD_PHASE else window
        cand = neighbour(ranks, rng, r, reach, moves)
        if cand is None:
            continue
        lo, hi = changed_span(ranks[r], cand[r])
        cand[r] = renumber(cand[r], lo, hi, ranks[r])
        lo, hi = changed_span(ranks[r], cand[r], lo, hi)  # renumbering only narrows the span
        if lo > hi or waits_on_later(table, r, cand[r], lo, hi):  # lo > hi: only equals exchanged
            continue
        u = rng.random()  # accept a loss up to temp * ln(1/u): exp(-loss / temp) > u
        res = _try(base, cand, r, lo, Cutoff(limits, cur - temp * math.log(u) if u > 0 else math.inf,
                                                 ANNEAL_END_WEIGHT / P), hi)
        spent += REPLAY_WORK
        if res is None:
            continue
        spent += res.walked
        if not res.over:
            ranks, cur, base = cand, _anneal_score(res, P), res
            key = (res.makespan, sum(res.rank_end))
            if _better(key, best_key):
                best, best_key = cand, key
                if key[0] <= floor + 1e-9:
                    break
    return best, best_key[0]


def sink_ws(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks,
            deadline: float | None = None) -> tuple[Ranks, float]:
    """Push each W to the end of its rank where that does not hurt.

    The exact schedules run W's late in the cool-down so that B's reach the ranks waiting for them
    sooner; one pass over the W's (last first), moving each to the end of its rank and keeping the
    move when (makespan, sum of rank end times) does not grow.
    """
    base = replay_order(layout, costs, ranks, "sink_ws")
    cur = (base.makespan, sum(base.rank_end))
    for r in range(layout.P):
        ws = [item for item in ranks[r] if type(item) is Op and item.kind == OpKind.W]
        for w in reversed(ws):
            if deadline is not None and time.perf_counter() > deadline:
                return ranks, cur[0]
            ops = ranks[r]
            i = ops.index(w)
            if i == len(ops) - 1:
                continue
            new = ops[:i] + ops[i + 1:] + [w]
            cand = list(ranks)
            cand[r] = new
            res = _try(base, cand, r, i, Cutoff(limits, cur[0] + 1e-9))
            if res is None or res.over:
                continue
            score = (res.makespan, sum(res.rank_end))
            if _better(score, cur):
                ranks, cur, base = cand, score, res
    return ranks, cur[0]


def _latest_fitting(ws: list[tuple[int, float, float]], after: int, done_by: float, fits_in: float) -> int | None:
    """The index of the last W of ``ws`` (one stage's, in order: (index, its B's end, its time)) placed after
    ``after`` whose B ends by ``done_by`` and whose time fits in ``fits_in``; None if none."""
    for j, b_done, dur in reversed(ws):
        if j <= after:
            return None
        if b_done <= done_by and dur <= fits_in:
            return j
    return None


def _first_gap_fill(base: Replay, ranks: Ranks, r: int, limits: list[int],
                    cur: tuple[float, float]) -> tuple[Ranks, Replay, tuple[float, float]] | None:
    """The first gap of rank ``r`` that a later W fills without making the order worse: the new order,
    its replay and score; None when no gap takes one."""
    ops, times = ranks[r], base.times(r)
    b_end = {op[1:]: end for item, (_, end) in zip(ops, times) for op in parts(item) if op.kind == OpKind.B}
    stages: dict[tuple[int, int], list[tuple[int, float, float]]] = {}  # per local stage: (index, B's end, time)
    for j, w in enumerate(ops):
        if type(w) is Op and w.kind == OpKind.W:
            stages.setdefault(w[1:3], []).append((j, b_end.get(w[1:], math.inf), times[j][1] - times[j][0]))
    for i in range(1, len(ops)):
        gap_start = times[i - 1][1]
        gap = times[i][0] - gap_start
        if gap <= 1e-9:
            continue
        found = []  # per local stage: its latest W after the gap whose B is done and that fits the gap
        for ws in stages.values():
            j = _latest_fitting(ws, i, gap_start + 1e-9, gap + 1e-9)
            if j is not None:
                found.append(j)
        best = None
        for j in sorted(found, reverse=True):  # the latest first, as a scan from the end meets them
            cand = list(ranks)
            cand[r] = renumber(ops[:i] + [ops[j]] + ops[i:j] + ops[j + 1:], i, j, ops)
            res = _try(base, cand, r, i, Cutoff(limits, cur[0] + 1e-9), j)
            if res is None or res.over:
                continue
            score = (res.makespan, sum(res.rank_end))
            if _better(score, cur) and (best is None or score < best[2]):
                best = (cand, res, score)
        if best is not None:
            return best
    return None


def _fill_gaps_with_ws(base: Replay, ranks: Ranks, limits: list[int],
                       deadline: float | None) -> tuple[Ranks, Replay, int]:
    """``_first_gap_fill`` on every rank until no gap takes a W; the order, its replay, W's moved."""
    cur = (base.makespan, sum(base.rank_end))
    moved, changed = 0, True
    while changed:
        changed = False
        for r in range(len(ranks)):
            while deadline is None or time.perf_counter() <= deadline:
                got = _first_gap_fill(base, ranks, r, limits, cur)
                if got is None:
                    break
                ranks, base, cur = got
                moved, changed = moved + 1, True
    return ranks, base, moved


def _producers_at(ranks: Ranks) -> dict[tuple, tuple[int, int]]:
    """(rank, index) of the item that makes each signal (``ops.makes``)."""
    return {sig: (r, i) for r, ops in enumerate(ranks) for i, item in enumerate(ops)
            for op in parts(item) if (sig := makes(op)) is not None}


def _held_back_chain(layout: Layout, lat: list[float], ranks: Ranks, times: list[list[tuple[float, float]]],
                     made_at: dict, op: Op) -> list[tuple[int, int, float]]:
    """What ``op`` (after a gap) waits for, back along the pipeline: (rank, index, input arrival) of each
    producer that started as soon as its own input arrived, up to the first that its rank held back
    (busy with earlier items), which is last; [] when the chain reaches no held-back producer."""
    def made(need) -> float:  # when the input ``need`` was made
        q, p = made_at[need[:4]]
        return times[q][p][1]

    out: list[tuple[int, int, float]] = []
    ops = [op]
    while ops:  # each producer ended before its consumer started: the walk goes back in time and ends
        far = [n for o in ops for n in producers(o, layout.placement)]
        if not far:
            return []
        q, p = made_at[max(far, key=made)[:4]]  # the input that came last
        item_inputs = [n for o in parts(ranks[q][p]) for n in producers(o, layout.placement)]
        arrival = max((made(n) + (lat[n.stage] if n.rank != q else 0.0) for n in item_inputs), default=0.0)
        out.append((q, p, arrival))
        if times[q][p][0] > arrival + 1e-9:
            return out
        ops = list(parts(ranks[q][p]))
    return []


def _raised_chain(ranks: Ranks, times: list[list[tuple[float, float]]],
                  chain: list[tuple[int, int, float]]) -> Ranks | None:
    """``chain`` (``_held_back_chain``) with each item raised above the W's just before it that started
    once its input could be there (the held-back one first, then each that waits for it); None if none moves."""
    cand = list(ranks)
    ready, moved = chain[-1][2], False
    for q, p, _ in reversed(chain):
        ops = cand[q]
        k = p
        while k > 0 and type(ops[k - 1]) is Op and ops[k - 1].kind == OpKind.W and times[q][k - 1][0] >= ready - 1e-9:
            k -= 1
        if k < p:
            cand[q] = ops[:k] + [ops[p]] + ops[k:p] + ops[p + 1:]
            ready, moved = max(ready, times[q][k][0]) + times[q][p][1] - times[q][p][0], True
        else:
            ready = times[q][p][1]
    return cand if moved else None


def _start_sum(run: Replay, ranks: Ranks) -> float:
    """Sum of the start times of every item but the W's: what raising held-back producers lowers."""
    return sum(a for r, ops in enumerate(ranks) for item, (a, _) in zip(ops, run.times(r))
               if not (type(item) is Op and item.kind == OpKind.W))


def _pull_held_back(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks,
                    base: Replay) -> tuple[Ranks, Replay] | None:
    """The first raised chain (``_raised_chain``) behind a gap, critical ranks first, that keeps
    (makespan, sum of rank end times) and lowers ``_start_sum``, or lowers the former; None if none does."""
    times = [base.times(r) for r in range(layout.P)]
    made_at = _producers_at(ranks)
    lat = list(costs.per_stage(layout.S).comm)
    cur = (base.makespan, sum(base.rank_end))
    starts = _start_sum(base, ranks)
    order = sorted(range(layout.P), key=lambda r: -base.rank_end[r])
    tried: set[tuple] = set()  # chains found behind several gaps are replayed once
    for r in order:
        for i in range(len(ranks[r]) - 1, 0, -1):  # the latest gaps first: the cool-down sets the makespan
            if times[r][i][0] <= times[r][i - 1][1] + 1e-9:
                continue
            for op in parts(ranks[r][i]):
                chain = _held_back_chain(layout, lat, ranks, times, made_at, op)
                key = tuple(chain)
                if not chain or key in tried:
                    continue
                tried.add(key)
                cand = _raised_chain(ranks, times, chain)
                if cand is None:
                    continue
                # every item that starts before the first raised one keeps its time: walk from there, and
                # stop once the order is over a limit or the makespan (it would not be kept)
                t0 = min(times[q][changed_span(ranks[q], cand[q])[0]][0] for q in range(layout.P)
                         if cand[q] is not ranks[q])
                try:
                    run = base.from_time(cand, t0, Cutoff(limits, cur[0]))
                except ScheduleError:
                    continue
                if run.over:
                    continue
                score = (run.makespan, sum(run.rank_end))
                if _better(score, cur) and (score[0] < cur[0] - 1e-9 or score[1] < cur[1] - 1e-9
                                            or _start_sum(run, cand) < starts - 1e-9):
                    return cand, run
    return None


def close_gaps(layout: Layout, costs: Costs, limits: list[int], ranks: Ranks,
               deadline: float | None = None) -> tuple[Ranks, float, int]:
    """Close the idle gaps of an order; the order, its makespan and how many moves it took.

    Two moves, in turn until neither applies:

    - **a later W into a gap it fits** (its B done before the gap): a W waits only for its own B,
      on its own rank, and no op waits for it (it frees an activation), so the ops up to its old
      place keep their times and the ones after may start up to a W sooner: never worse, and
      memory only falls (``_first_gap_fill``);
    - **the held-back producer raised**: an op after a gap waits for an input that came late
      because, somewhere back along the pipeline, a producer's rank ran W's while that producer's
      own input was already there; that producer goes above those W's, and each op of the chain
      that waited for it above the W's that started once its input could be there
      (``_pull_held_back``; kept when the makespan and the sum of rank end times do not grow and
      the ops other than W's start sooner in sum, so the two moves cannot undo each other).

    Annealing proposes such moves only within a window of the gap and one rank at a time; in the
    orders it ends with at P=8, M=24 the W's that fit the critical rank's last gaps are often many
    places later, and a cool-down wait is a chain over several ranks
    (benchmarks/results/auto_schedule.md).
    """
    base = replay_order(layout, costs, ranks, "close_gaps")
    moved = 0
    while deadline is None or time.perf_counter() <= deadline:
        ranks, base, n = _fill_gaps_with_ws(base, ranks, limits, deadline)
        moved += n
        got = _pull_held_back(layout, costs, limits, ranks, base)
        if got is None:
            break
        ranks, base = got
        moved += 1
    return ranks, base.makespan, moved
