"""The ``auto`` schedule: a cost-aware search over op orders, with the simulator as objective.

The hand schedules assume every stage costs the same and a hop is free. Real pipelines have a
heavy last stage (head, loss, MTP), an embedding-heavy first stage, point-to-point latency and
exposed all-to-all. ``auto`` builds orders for the measured ``Costs`` instead, in three steps:

1. **Candidates**: the hand schedules of the same placement (1f1b, zb-h1, zb-h2, gpipe for
   "linear"; zbv, dualpipev for "v"; dualpipe for "dual") that fit the memory limit. They are
   kept as they are, so ``auto`` is never worse than the best of them.
2. **List scheduling** (the Zero Bubble paper's greedy idea, generalised to any placement): an
   event-driven walk over the ranks in time order; whenever a rank is free it picks a ready op
   by a policy: B or F first; split B/W or fused BW; pair an F with a B of another local stage
   into an overlapped FB (and wait for a partner when the FB saves more than the wait); deepest
   or shallowest stage first; a micro-batch entering the pipeline before a ready B; fill idle
   time with deferred W's or keep it for a B due sooner; cap the forwards in flight per stage
   like 1F1B. Memory: an F runs only while the rank is under its activation limit, and with
   "reservation" a micro-batch enters only when every rank it will visit keeps a slot for it,
   which makes the walk deadlock-free under any limit >= the stages a chain has on one rank.
   A grid of policies is tried, then the best six with the hold and cap variants.
3. **Local search**: randomised list scheduling (the best policies with random tie-breaking,
   seeded), then hill climbing on the best order (move, swap, pair/unpair F and B into FB,
   BW <-> B + W), scored by a lean evaluator with the simulator's rules, until the iteration
   count or the time budget runs out.

Every candidate is scored by ``run_schedule`` (makespan, then peak activations); the winner is an
ordinary ``Schedule`` named "auto" whose ``meta`` records the placement, the seed, the memory
limit, the baselines' makespans, the lower bound and where the winner came from.

``memory_limit=None`` means the peak activations of the *lowest-memory* hand schedule of that
placement (P for linear: 1f1b / zb-h1; 2P for v: zbv; P+1 for dual: dualpipe), i.e. auto must
not use more memory than the leanest hand schedule. Peaks are counted as the simulator counts
them (+1 when a stage's F starts, -1 when its W or BW ends), per rank.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product

from .costs import Costs, StageCosts
from .errors import ScheduleError
from .ir import FB, ComputeItem, Op, Schedule
from .registry import build_schedule, register
from .simulate import run_schedule

PLACEMENTS = ("linear", "v", "dual")
HAND_SCHEDULES = {"linear": ("1f1b", "zb-h1", "zb-h2", "gpipe"), "v": ("zbv", "dualpipev"), "dual": ("dualpipe",)}
INF = math.inf


# ----- placement ---------------------------------------------------------------------------------
def make_layout(placement: str, num_ranks: int, num_microbatches: int) -> tuple[tuple[tuple[int, ...], ...],
                                                                                  tuple[int, ...]]:
    """(placement[chain][stage] -> rank, microbatch_chain) for a placement name."""
    P, M = num_ranks, num_microbatches
    if placement == "linear":
        return (tuple(range(P)),), (0,) * M
    if placement == "v":
        return (tuple(range(P)) + tuple(reversed(range(P))),), (0,) * M
    if placement == "dual":
        if M < 2:
            raise ScheduleError(f"placement 'dual' needs at least 2 micro-batches (one per direction), got {M}")
        half = (M + 1) // 2
        return (tuple(range(P)), tuple(reversed(range(P)))), (0,) * half + (1,) * (M - half)
    raise ScheduleError(f"unknown placement {placement!r}; allowed: {', '.join(PLACEMENTS)}")


def _limits(memory_limit: int | Sequence[int], P: int) -> list[int]:
    if isinstance(memory_limit, bool):
        raise ScheduleError(f"memory_limit must be a positive integer or a list of {P}, got {memory_limit!r}")
    if isinstance(memory_limit, int):
        limits = [memory_limit] * P
    else:
        try:
            limits = [int(x) for x in memory_limit]
        except (TypeError, ValueError) as exc:
            raise ScheduleError(f"memory_limit must be a positive integer or a list of {P}, "
                                f"got {memory_limit!r}") from exc
        if len(limits) != P:
            raise ScheduleError(f"memory_limit has {len(limits)} values, expected one per rank ({P})")
    if any(x < 1 for x in limits):
        raise ScheduleError(f"memory_limit must be at least 1 activation per rank, got {memory_limit!r}")
    return limits


# ----- lower bound -------------------------------------------------------------------------------
def lower_bound(placement: Sequence[Sequence[int]], microbatch_chain: Sequence[int], costs: Costs) -> float:
    """A makespan no schedule of this placement can beat (memory ignored).

    Per rank: its total work (lone-op costs, all-to-all included unless ``fb`` overlap could hide
    it, so the F and B parts count without all-to-all when the rank has two stages) plus the
    unavoidable start-up (the forward path of the first micro-batch to the rank's first stage,
    all-to-all included: no backward exists yet to hide it);
    and separately its F/B work plus the shortest drain after its last B (the backward path of
    that micro-batch down to stage 0 and stage 0's W). The bound is the largest of these.
    """
    S = len(placement[0])
    sc = costs.per_stage(S)
    P = 1 + max(r for chain in placement for r in chain)
    per_chain = [sum(1 for c in microbatch_chain if c == k) for k in range(len(placement))]
    # forward path to stage s, backward path from stage s down to the end of W at stage 0
    head = [[0.0] * S for _ in placement]
    drain = [[0.0] * S for _ in placement]
    for c, chain in enumerate(placement):
        for s in range(1, S):
            hop = sc.comm[s - 1] if chain[s - 1] != chain[s] else 0.0
            head[c][s] = head[c][s - 1] + sc.f[s - 1] + sc.a2a_f[s - 1] + hop  # nothing to overlap with yet
        for s in range(1, S):
            hop = sc.comm[s] if chain[s] != chain[s - 1] else 0.0
            drain[c][s] = drain[c][s - 1] + sc.b[s - 1] + hop + (sc.w[0] if s == 1 else 0.0)
    best = 0.0
    for r in range(P):
        local = [(c, s) for c, chain in enumerate(placement) for s, x in enumerate(chain) if x == r]
        if not local:
            continue
        can_overlap = len(local) > 1 and (sc.fb is not None or any(sc.a2a_f) or any(sc.a2a_b))
        work = fb_work = 0.0
        for c, s in local:
            n = per_chain[c]
            lone = sc.f[s] + sc.a2a_f[s] + sc.b[s] + sc.a2a_b[s] + sc.w[s]
            unit = lone
            if can_overlap:  # inside an FB unit the all-to-all is hidden, and fb may hide more
                unit = min(lone, sc.fb[s] if sc.fb is not None else sc.f[s] + sc.b[s] + sc.w[s])
            work += n * unit
            fb_work += n * max(0.0, unit - sc.w[s])
        start = min(head[c][s] for c, s in local)
        tail = min(drain[c][s] for c, s in local)
        best = max(best, start + work, start + fb_work + tail)
    return best


# ----- list scheduling ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """How a free rank picks among its ready ops (see the module docstring)."""

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


class _Layout:
    """Per-rank view of a placement, computed once per search."""

    def __init__(self, placement: tuple[tuple[int, ...], ...], microbatch_chain: tuple[int, ...], P: int):
        self.placement = placement
        self.P = P
        self.C = len(placement)
        self.S = len(placement[0])
        self.M = len(microbatch_chain)
        self.chain_mbs = [[m for m, c in enumerate(microbatch_chain) if c == k] for k in range(self.C)]
        self.local = [[(c, s) for c, chain in enumerate(placement) for s, x in enumerate(chain) if x == r]
                      for r in range(P)]
        # stages of chain c on rank r (activation slots one micro-batch of c needs there)
        self.count = [[sum(1 for x in chain if x == r) for r in range(P)] for chain in placement]
        self.chain_ranks = [sorted(set(chain)) for chain in placement]
        self.min_limit = max(max(row) for row in self.count)


def list_schedule(layout: _Layout, sc: StageCosts, limits: list[int], policy: Policy,
                  rng: random.Random | None = None, noise: float = 0.0) -> list[list[ComputeItem]] | None:
    """One greedy event-driven walk; returns per-rank op lists, or None if the walk got stuck."""
    P, C, S, M = layout.P, layout.C, layout.S, layout.M
    placement, chain_mbs, local = layout.placement, layout.chain_mbs, layout.local
    cf, cb, cw, a2f, a2b, lat = sc.f, sc.b, sc.w, sc.a2a_f, sc.a2a_b, sc.comm
    n_keys = C * S * M
    f_end = [INF] * n_keys
    b_end = [INF] * n_keys
    next_f = [0] * (C * S)
    next_b = [0] * (C * S)
    live = [0] * P
    reserved = [0] * P
    now = [0.0] * P
    wake = [INF] * P
    waiting = [False] * P
    wq: list[list[tuple[int, int, int]]] = [[] for _ in range(P)]
    wq_head = [0] * P
    todo = [sum(2 * len(chain_mbs[c]) for c, _ in local[r]) for r in range(P)]
    out: list[list[ComputeItem]] = [[] for _ in range(P)]
    split, reserve, cap = policy.split, policy.reserve, policy.cap
    bkind = "B" if split else "BW"

    def f_cand(r: int, c: int, s: int) -> tuple[int, float] | None:
        k = c * S + s
        i = next_f[k]
        mbs = chain_mbs[c]
        if i >= len(mbs):
            return None
        m = mbs[i]
        if s == 0:
            return m, 0.0
        e = f_end[(k - 1) * M + m]
        if e != INF and placement[c][s - 1] != r:
            e += lat[s - 1]
        return m, e

    def b_cand(r: int, c: int, s: int) -> tuple[int, float] | None:
        k = c * S + s
        i = next_b[k]
        if i >= next_f[k]:
            return None
        m = chain_mbs[c][i]
        t = f_end[k * M + m]
        if s + 1 < S:
            e = b_end[(k + 1) * M + m]
            if e != INF and placement[c][s + 1] != r:
                e += lat[s + 1]
            if e > t:
                t = e
        return m, t

    def f_allowed(r: int, c: int, s: int) -> bool:
        if cap and next_f[c * S + s] - next_b[c * S + s] >= cap * (S - s):
            return False
        if not reserve:
            return live[r] < limits[r]
        if s:
            return True  # its slot was reserved when the micro-batch entered
        cnt = layout.count[c]
        return all(live[x] + reserved[x] + cnt[x] <= limits[x] for x in layout.chain_ranks[c])

    def start_f(r: int, c: int, s: int, m: int) -> None:
        if reserve:
            if s == 0:
                cnt = layout.count[c]
                for x in layout.chain_ranks[c]:
                    reserved[x] += cnt[x]
            reserved[r] -= 1
        live[r] += 1
        next_f[c * S + s] += 1

    done_ranks = 0
    while done_ranks < P:
        r, best_t = -1, INF
        for x in range(P):
            if todo[x] == 0 and wq_head[x] == len(wq[x]):
                continue
            t = wake[x] if waiting[x] else now[x]
            if t < best_t:
                best_t, r = t, x
        if r < 0:
            return None  # every remaining rank waits on something nobody will produce
        if waiting[r]:
            waiting[r] = False
            if wake[r] > now[r]:
                now[r] = wake[r]
        t = now[r]
        fs: list[tuple[int, int, int]] = []
        bs: list[tuple[int, int, int]] = []
        next_known = INF
        f_mem_blocked = inject_blocked = False
        f_soon: list[tuple[float, int, int]] = []
        b_soon: list[tuple[float, int, int]] = []
        for c, s in local[r]:
            x = f_cand(r, c, s)
            if x is not None:
                if x[1] <= t:
                    if f_allowed(r, c, s):
                        fs.append((c, s, x[0]))
                    else:
                        f_mem_blocked = True
                        inject_blocked = inject_blocked or s == 0
                else:
                    if x[1] < next_known:
                        next_known = x[1]
                    if x[1] != INF:
                        f_soon.append((x[1], c, s))
            y = b_cand(r, c, s)
            if y is not None:
                if y[1] <= t:
                    bs.append((c, s, y[0]))
                else:
                    if y[1] < next_known:
                        next_known = y[1]
                    if y[1] != INF:
                        b_soon.append((y[1], c, s))
        has_w = wq_head[r] < len(wq[r])
        if len(fs) > 1:
            fs.sort(key=lambda o: (-o[1] if policy.deep_first else o[1], o[2]))
        if len(bs) > 1:
            bs.sort(key=lambda o: (-o[1], o[2]))
        if noise and rng is not None:
            if len(fs) > 1 and rng.random() < noise:
                rng.shuffle(fs)
            if len(bs) > 1 and rng.random() < noise:
                rng.shuffle(bs)

        choice = None  # ("F", op) / ("B", op) / ("FB", f, b) / ("W",)
        if policy.pair and fs and bs:
            for fo in fs:
                for bo in bs:
                    if (fo[0], fo[1]) != (bo[0], bo[1]):
                        choice = ("FB", fo, bo)
                        break
                if choice:
                    break
        if choice is None and policy.pair and policy.pair_wait and (fs or bs) and not (fs and bs):
            if fs:
                fc0, fs0, _ = fs[0]
                lone = cf[fs0] + a2f[fs0]
                soon = [(tb, c, s) for tb, c, s in b_soon if (c, s) != (fc0, fs0)]
            else:
                fc0, fs0, _ = bs[0]
                lone = cb[fs0] + a2b[fs0] + (0.0 if split else cw[fs0])
                soon = [(tf, c, s) for tf, c, s in f_soon if (c, s) != (fc0, fs0)]
            for t_other, c, s in soon:
                if fs:
                    other = cb[s] + a2b[s] + (0.0 if split else cw[s])
                    unit = sc.fb_cost(fs0, bkind, s)
                else:
                    if not f_allowed(r, c, s):
                        continue
                    other = cf[s] + a2f[s]
                    unit = sc.fb_cost(s, bkind, fs0)
                if t_other - t < lone + other - unit:
                    waiting[r] = True
                    wake[r] = t_other
                    break
            if waiting[r]:
                continue
        if choice is None:
            first_b = policy.b_first
            if noise and rng is not None and fs and bs and rng.random() < noise:
                first_b = not first_b
            inject = [o for o in fs if o[1] == 0] if policy.inject_first else []
            if inject:
                choice = ("F", inject[0])
            elif policy.inject_first and inject_blocked and has_w:
                choice = ("W",)
            elif bs and (first_b or not fs):
                choice = ("B", bs[0])
            elif fs:
                choice = ("F", fs[0])
            elif has_w:
                if f_mem_blocked or policy.w_fill or next_known == INF:
                    choice = ("W",)
                else:
                    c0, s0, _ = wq[r][wq_head[r]]
                    if t + cw[s0] <= next_known:
                        choice = ("W",)
        if policy.hold_b and choice is not None and choice[0] in ("F", "W") and b_soon:
            t_b = min(x[0] for x in b_soon)
            if choice[0] == "F":
                dur = cf[choice[1][1]] + a2f[choice[1][1]]
            else:
                dur = cw[wq[r][wq_head[r]][1]]
            if t_b < t + dur and not (choice[0] == "W" and f_mem_blocked):
                choice = None
                next_known = t_b
        if choice is None:
            waiting[r] = True
            wake[r] = next_known
            continue

        kind = choice[0]
        if kind == "W":
            c, s, m = wq[r][wq_head[r]]
            wq_head[r] += 1
            end = t + cw[s]
            live[r] -= 1
            out[r].append(Op("W", c, s, m))
        elif kind == "F":
            c, s, m = choice[1]
            start_f(r, c, s, m)
            end = t + cf[s] + a2f[s]
            f_end[(c * S + s) * M + m] = end
            todo[r] -= 1
            out[r].append(Op("F", c, s, m))
        elif kind == "B":
            c, s, m = choice[1]
            next_b[c * S + s] += 1
            end = t + cb[s] + a2b[s] + (0.0 if split else cw[s])
            b_end[(c * S + s) * M + m] = end
            todo[r] -= 1
            if split:
                wq[r].append((c, s, m))
            else:
                live[r] -= 1
            out[r].append(Op(bkind, c, s, m))
        else:  # FB
            (fc, fs_, fm), (bc, bs_, bm) = choice[1], choice[2]
            start_f(r, fc, fs_, fm)
            next_b[bc * S + bs_] += 1
            end = t + sc.fb_cost(fs_, bkind, bs_)
            f_end[(fc * S + fs_) * M + fm] = end
            b_end[(bc * S + bs_) * M + bm] = end
            todo[r] -= 2
            if split:
                wq[r].append((bc, bs_, bm))
            else:
                live[r] -= 1
            out[r].append(FB(Op("F", fc, fs_, fm), Op(bkind, bc, bs_, bm)))
        now[r] = end
        for x in range(P):
            if waiting[x]:
                waiting[x] = False
        if todo[r] == 0 and wq_head[r] == len(wq[r]):
            done_ranks += 1
    return out


def policies(placement: str, costs: StageCosts) -> list[Policy]:
    """The deterministic policy grid tried first (pairing only where a rank has two stages)."""
    pair_opts = (False, True) if placement in ("v", "dual") else (False,)
    saves = any(costs.a2a_f) or any(costs.a2a_b) or costs.fb is not None
    grid = []
    for b_first, split, pair, reserve, deep_first, w_fill, pair_wait, inject_first in product(
            (True, False), (True, False), pair_opts, (True, False), (True, False), (True, False), (False, True),
            (False, True)):
        if not split and not w_fill:
            continue  # without W ops there is nothing to fill with
        if pair_wait and not (pair and saves):
            continue  # waiting for a partner only pays when the FB unit is cheaper than its halves
        if inject_first and not b_first:
            continue  # F already goes first
        grid.append(Policy(b_first, split, pair, reserve, deep_first, w_fill, pair_wait, inject_first))
    return grid


# ----- lean evaluator ----------------------------------------------------------------------------
def evaluate(layout: _Layout, sc: StageCosts, ranks: list[list[ComputeItem]]
             ) -> tuple[float, list[float], list[int]] | None:
    """(makespan, per-rank end times, per-rank peak activations), or None on deadlock.

    The same rules as ``simulate.run_schedule`` without recording a timeline: what local search
    calls thousands of times. Tests check it against ``run_schedule``.
    """
    P, S, M = layout.P, layout.S, layout.M
    placement = layout.placement
    lat = sc.comm
    f_end: dict[int, float] = {}
    b_end: dict[int, float] = {}
    pos = [0] * P
    now = [0.0] * P
    live = [0] * P
    peak = [0] * P
    lone = {"F": [a + b for a, b in zip(sc.f, sc.a2a_f)], "B": [a + b for a, b in zip(sc.b, sc.a2a_b)],
            "W": sc.w, "BW": [a + b + c for a, b, c in zip(sc.b, sc.w, sc.a2a_b)]}

    def ready(op: Op, r: int) -> float | None:
        c, s, m = op.chain, op.stage, op.mb
        key = (c * S + s) * M + m
        kind = op.kind
        if kind == "F":
            if not s:
                return 0.0
            v = f_end.get(key - M)
            if v is None:
                return None
            return v + lat[s - 1] if placement[c][s - 1] != r else v
        if kind == "W":
            return b_end.get(key)
        t = f_end.get(key)
        if t is None:
            return None
        if s + 1 < S:
            v = b_end.get(key + M)
            if v is None:
                return None
            if placement[c][s + 1] != r:
                v += lat[s + 1]
            if v > t:
                t = v
        return t

    progress = True
    remaining = sum(len(x) for x in ranks)
    while progress and remaining:
        progress = False
        for r in range(P):
            ops = ranks[r]
            i = pos[r]
            while i < len(ops):
                item = ops[i]
                if type(item) is FB:
                    f, b = item.f, item.b
                    t1 = ready(f, r)
                    t2 = ready(b, r) if t1 is not None else None
                    if t2 is None:
                        break
                    start = max(now[r], t1, t2)
                    end = start + sc.fb_cost(f.stage, b.kind, b.stage)
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                    if b.kind == "BW":
                        live[r] -= 1
                    f_end[(f.chain * S + f.stage) * M + f.mb] = end
                    b_end[(b.chain * S + b.stage) * M + b.mb] = end
                else:
                    t = ready(item, r)
                    if t is None:
                        break
                    start = now[r] if now[r] > t else t
                    kind = item.kind
                    end = start + lone[kind][item.stage]
                    key = (item.chain * S + item.stage) * M + item.mb
                    if kind == "F":
                        live[r] += 1
                        if live[r] > peak[r]:
                            peak[r] = live[r]
                        f_end[key] = end
                    elif kind == "W":
                        live[r] -= 1
                    else:
                        b_end[key] = end
                        if kind == "BW":
                            live[r] -= 1
                now[r] = end
                i += 1
            if i != pos[r]:
                remaining -= i - pos[r]
                pos[r] = i
                progress = True
    if remaining:
        return None
    return max(now) if P else 0.0, now, peak


def _neighbour(ranks: list[list[ComputeItem]], rng: random.Random, r: int, window: int
               ) -> list[list[ComputeItem]] | None:
    """One random local change to rank ``r``'s order (a copy), or None if the move does not apply."""
    ops = ranks[r]
    n = len(ops)
    if n < 2:
        return None
    i = rng.randrange(n)
    item = ops[i]
    move = rng.random()
    new = list(ops)
    if move < 0.35:  # move one item a few places
        j = min(n - 1, max(0, i + rng.randint(-window, window)))
        if j == i:
            return None
        new.insert(j, new.pop(i))
    elif move < 0.55:  # pair a lone F with a nearby lone B/BW of another stage (or the reverse)
        if type(item) is FB:
            return None
        want = ("B", "BW") if item.kind == "F" else ("F",) if item.kind in ("B", "BW") else ()
        if not want:
            return None
        js = [j for j in range(max(0, i - window), min(n, i + window + 1))
              if j != i and type(ops[j]) is Op and ops[j].kind in want
              and (ops[j].chain, ops[j].stage) != (item.chain, item.stage)]
        if not js:
            return None
        j = rng.choice(js)
        f, b = (item, ops[j]) if item.kind == "F" else (ops[j], item)
        lo, hi = min(i, j), max(i, j)
        new[lo] = FB(f, b)
        del new[hi]
    elif move < 0.7:  # split an FB unit
        if type(item) is not FB:
            return None
        halves = [item.f, item.b] if rng.random() < 0.5 else [item.b, item.f]
        new[i:i + 1] = halves
    elif move < 0.85:  # BW <-> B + W
        if type(item) is Op and item.kind == "BW":
            new[i] = Op("B", item.chain, item.stage, item.mb)
            new.insert(i + 1, Op("W", item.chain, item.stage, item.mb))
        elif type(item) is Op and item.kind == "W":
            j = next((k for k in range(i - 1, -1, -1) if type(ops[k]) is Op and ops[k].kind == "B"
                      and ops[k][1:] == item[1:]), None)
            if j is None:
                return None
            new[j] = Op("BW", item.chain, item.stage, item.mb)
            del new[i]
        else:
            return None
    else:  # swap with the next item
        if i + 1 >= n:
            return None
        new[i], new[i + 1] = new[i + 1], new[i]
    out = list(ranks)
    out[r] = new
    return out


def local_search(layout: _Layout, sc: StageCosts, limits: list[int], ranks: list[list[ComputeItem]],
                 rng: random.Random, steps: int, deadline: float | None) -> tuple[list[list[ComputeItem]], float]:
    """Hill-climb on per-rank orders: keep a move when (makespan, sum of rank end times) does not grow."""
    got = evaluate(layout, sc, ranks)
    assert got is not None
    cur = (got[0], sum(got[1]))
    P = layout.P
    window = 6
    for step in range(steps):
        if deadline is not None and step % 16 == 0 and time.perf_counter() > deadline:
            break
        # bias towards the ranks that finish last: they set the makespan
        ends = evaluate(layout, sc, ranks)[1] if step % 64 == 0 else None
        if ends is not None:
            late = sorted(range(P), key=lambda x: -ends[x])[:max(1, P // 2)]
        r = rng.choice(late) if rng.random() < 0.5 else rng.randrange(P)
        cand = _neighbour(ranks, rng, r, window)
        if cand is None:
            continue
        res = evaluate(layout, sc, cand)
        if res is None or any(p > lim for p, lim in zip(res[2], limits)):
            continue
        score = (res[0], sum(res[1]))
        if score[0] < cur[0] - 1e-9 or (score[0] <= cur[0] + 1e-9 and score[1] <= cur[1] + 1e-9):
            ranks, cur = cand, score
    return ranks, cur[0]


# ----- search ------------------------------------------------------------------------------------
@dataclass
class _Candidate:
    ranks: list[list[ComputeItem]]
    makespan: float
    peak: int
    source: str


def _score(layout_sched: Schedule, costs: Costs, limits: list[int]) -> tuple[float, int] | None:
    try:
        res = run_schedule(layout_sched, costs, record=False)
    except ScheduleError:
        return None
    if any(p > lim for p, lim in zip(res.peak_activations, limits)):
        return None
    return res.makespan, max(res.peak_activations)


def _hand_candidates(placement: str, P: int, M: int, layout_placement, costs: Costs
                     ) -> list[tuple[str, Schedule, float, list[int]]]:
    """The hand schedules of this placement that build for (P, M), with makespan and peaks."""
    found = []
    for name in HAND_SCHEDULES[placement]:
        try:
            sched = build_schedule(name, P, M)
            res = run_schedule(sched, costs, record=False)
        except Exception:  # noqa: BLE001 - a family that is missing or rejects (P, M) is just not a candidate
            continue
        if sched.placement != layout_placement:
            continue
        found.append((name, sched, res.makespan, list(res.peak_activations)))
    return found


def _default_limit(placement: str, P: int, hands: list[tuple[str, Schedule, float, list[int]]]) -> int:
    if hands:
        return min(max(peaks) for _, _, _, peaks in hands)
    return {"linear": P, "v": 2 * P, "dual": P + 1}[placement]


@register("auto", "cost-aware search (list scheduling + local search) under a per-rank activation limit",
          "any P >= 1, M >= 1 (dual: M >= 2); costs, memory_limit, placement linear|v|dual",
          placement="option")
def build_auto(num_ranks: int, num_microbatches: int, costs: Costs | None = None,
               memory_limit: int | Sequence[int] | None = None, placement: str = "linear", seed: int = 0,
               time_budget: float | None = None, iterations: int | None = None) -> Schedule:
    """Search an op order for ``costs`` that fits ``memory_limit`` activations per rank.

    ``iterations`` bounds the search: that many randomised list-scheduling walks, then ten times
    as many local-search moves, at least 1000 (default: one walk per 8 ops of the problem, 10 to
    200; 0 keeps only the hand schedules and the policy grid).
    The search is bounded by ``iterations``, not by the clock, so the result is deterministic for a
    given seed (about 1-3 s of CPU at P=8, M=24). ``time_budget`` (seconds, default None: no cap)
    additionally stops any phase once a first valid schedule exists — faster, but then the result
    depends on the machine's speed (``meta["stopped_by_time_budget"]`` says whether it did).
    """
    P, M = num_ranks, num_microbatches
    if costs is None:
        costs = Costs()
    if not isinstance(costs, Costs):
        raise ScheduleError(f"costs must be a mt_dualpipe.schedules.Costs, got {type(costs).__name__}")
    if placement not in PLACEMENTS:
        raise ScheduleError(f"unknown placement {placement!r}; allowed: {', '.join(PLACEMENTS)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ScheduleError(f"seed must be an integer, got {seed!r}")
    if time_budget is not None and not (isinstance(time_budget, (int, float)) and time_budget > 0):
        raise ScheduleError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int)
                                   or iterations < 0):
        raise ScheduleError(f"iterations must be a non-negative integer or None, got {iterations!r}")
    started = time.perf_counter()
    place, mb_chain = make_layout(placement, P, M)
    layout = _Layout(place, mb_chain, P)
    sc = costs.per_stage(layout.S)
    hands = _hand_candidates(placement, P, M, place, costs)
    limit_value = _default_limit(placement, P, hands) if memory_limit is None else memory_limit
    limits = _limits(limit_value, P)
    if min(limits) < layout.min_limit:
        raise ScheduleError(f"memory_limit {limit_value!r} is too small for placement {placement!r}: a micro-batch "
                            f"needs {layout.min_limit} activation slot(s) on one rank; allowed: >= {layout.min_limit}")

    def make(ranks: list[list[ComputeItem]]) -> Schedule:
        return Schedule("auto", P, M, place, mb_chain, ranks)

    best: _Candidate | None = None
    baselines: dict[str, dict] = {}
    deadline = None if time_budget is None else started + time_budget
    out_of_time = False

    def consider(ranks: list[list[ComputeItem]] | None, source: str) -> float | None:
        """Score ``ranks``; keep them if better (lower makespan, then lower peak). Their makespan, or None."""
        nonlocal best
        if ranks is None:
            return None
        got = _score(make(ranks), costs, limits)
        if got is None:
            return None
        if best is None or got[0] < best.makespan - 1e-9 or (got[0] <= best.makespan + 1e-9 and got[1] < best.peak):
            best = _Candidate(ranks, got[0], got[1], source)
        return got[0]

    def expired() -> bool:
        nonlocal out_of_time
        if best is not None and deadline is not None and time.perf_counter() > deadline:
            out_of_time = True
        return out_of_time

    for name, sched, makespan, peaks in hands:
        fits = all(p <= lim for p, lim in zip(peaks, limits))
        baselines[name] = {"makespan": makespan, "peak_activations": max(peaks), "fits": fits}
        if fits:
            consider([list(ops) for ops in sched.ranks], name)

    # list scheduling: the policy grid, then the best six with the critical-path hold and 1F1B-like caps
    scored: list[tuple[float, Policy]] = []
    for pol in policies(placement, sc):
        if expired():
            break
        got = consider(list_schedule(layout, sc, limits, pol), "list")
        if got is not None:
            scored.append((got, pol))
    scored.sort(key=lambda x: x[0])
    for pol in [replace(p, hold_b=hold, cap=k) for _, p in scored[:6] for hold in (False, True)
                for k in (0, 1, 2) if hold or k]:
        if expired():
            break
        got = consider(list_schedule(layout, sc, limits, pol), "list")
        if got is not None:
            scored.append((got, pol))
    if best is None:
        raise ScheduleError(f"auto found no schedule for P={P}, M={M}, placement={placement!r} within "
                            f"memory_limit={limit_value!r}")
    scored.sort(key=lambda x: x[0])
    top = [pol for _, pol in scored[:6]]
    if iterations is None:
        size = layout.C * layout.S * M * P
        iterations = max(10, min(200, size // 8))  # small problems converge in a few walks
    # randomised walks: the best policies with random tie-breaking
    rng = random.Random(seed)
    walks = 0
    for _ in range(iterations if top else 0):
        if expired():
            break
        pol = top[rng.randrange(len(top))]
        noise = rng.choice((0.05, 0.1, 0.2, 0.35))
        walk_rng = random.Random(rng.getrandbits(32))
        walks += 1
        consider(list_schedule(layout, sc, limits, pol, walk_rng, noise), "search")
    # local search on the order of the best so far
    if not expired():
        steps = max(1000, 10 * iterations) if iterations else 0
        ranks, makespan = local_search(layout, sc, limits, [list(x) for x in best.ranks], rng, steps, deadline)
        if makespan < best.makespan - 1e-9:
            consider(ranks, best.source + "+local")
        expired()

    sched = make(best.ranks)
    sched.meta = {
        "placement": placement, "seed": seed, "memory_limit": limit_value, "costs": costs.describe(),
        "makespan": best.makespan, "peak_activations": best.peak, "source": best.source,
        "baselines": baselines, "lower_bound": lower_bound(place, mb_chain, costs),
        "walks": walks, "search_seconds": round(time.perf_counter() - started, 3),
        "stopped_by_time_budget": out_of_time,
    }
    return sched
