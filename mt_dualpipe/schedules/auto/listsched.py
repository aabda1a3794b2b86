"""List scheduling: one greedy, event-driven walk over the ranks in time order.

The Zero Bubble paper's greedy idea, generalised to any placement. Whenever a rank is free it

1. **gathers** its candidates: per local (chain, stage), the next micro-batch's F and B with the
   time their inputs are ready (what an op waits for comes from ``ops.OpTable``, the one
   definition of the dependency rule), and whether memory lets an F start;
2. **chooses** one by the walk's ``Policy``: a ``Choice`` (an F, a B or BW, a deferred W, or an
   F and a B paired into an FB unit) or a time to wake up at (waiting for a partner or for a B
   due sooner);
3. **applies** it: the rank's clock, the signals its op makes, the activations it holds.

A walk may be given a **prefix**: each rank's first items, run as given (each once its inputs are
there) before the policy chooses the rest. That re-lists the cool-down of an annealed order
(``repair``) without touching what came before.

Memory: an F runs only while the rank is under its activation limit, and with ``reserve`` a
micro-batch enters only when every rank it will visit keeps a slot for it, which makes the walk
deadlock-free under any limit >= the stages a chain has on one rank. Micro-batches of a
(chain, stage) run F and B in order, so ordering never deadlocks either.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

from ..costs import StageCosts
from ..ir import FB, ComputeItem, Op
from ..ops import RULES, OpKind, OpTable, parts
from .layout import Layout
from .policies import Policy

INF = math.inf
Stage = tuple[int, int, int]  # (chain, stage, micro-batch)


@dataclass(slots=True)
class Choice:
    """What a free rank runs next: ``kind`` F, B (the policy's backward kind), W or FB.

    ``f`` and ``b`` are the (chain, stage, micro-batch) of the forward and backward part; a W
    takes the oldest deferred W of the rank and names nothing.
    """

    kind: OpKind
    f: Stage | None = None
    b: Stage | None = None


@dataclass(slots=True)
class Ready:
    """A free rank's candidates at its current time.

    ``fs``/``bs``: F's (memory allowing) and B's whose inputs are ready, best first;
    ``f_soon``/``b_soon``: (ready time, chain, stage) of those due later; ``next_known``: the
    earliest of those times; ``f_mem_blocked``/``inject_blocked``: an F (one entering the
    pipeline) is ready but memory holds it back; ``has_w``: a deferred W is queued.
    """

    fs: list[Stage]
    bs: list[Stage]
    f_soon: list[tuple[float, int, int]]
    b_soon: list[tuple[float, int, int]]
    next_known: float = INF
    f_mem_blocked: bool = False
    inject_blocked: bool = False
    has_w: bool = False


def _arrival(waits: tuple, off: int, r: int, end: list[float], lat: list[float]) -> float:
    """When inputs ``waits`` (``OpTable`` templates, offset ``off`` = 2m) reach rank ``r``; INF if one is missing."""
    t = 0.0
    for key, owner, st in waits:
        v = end[key + off]
        if owner != r:
            v += lat[st]
        if v > t:
            t = v
    return t


class _Walk:
    """The state of one walk; ``run`` returns per-rank op lists, or None if the walk got stuck."""

    def __init__(self, layout: Layout, table: OpTable, sc: StageCosts, limits: list[int], policy: Policy,
                 rng: random.Random | None, noise: float, prefix: list[list[ComputeItem]] | None = None) -> None:
        P, S = layout.P, layout.S
        self.prefix = prefix if prefix is not None else [[] for _ in range(P)]
        self.layout, self.sc, self.limits, self.policy = layout, sc, limits, policy
        self.rng = rng if noise else None
        self.noise = noise
        self.bkind = OpKind.B if policy.split else OpKind.BW
        tpl = table.templates()
        self.f_tpl, self.b_tpl, self.w_tpl = tpl[OpKind.F], tpl[self.bkind], tpl[OpKind.W]
        # per kind, per c * S + s, per micro-batch slot: the op's time (``Costs.mb_scale`` makes slots differ)
        self.scales = sc.slot_scales(None, layout.M)
        self.dur = {kind: _durations(sc, kind, S, layout.C, layout.M, self.scales)
                    for kind in (OpKind.F, self.bkind, OpKind.W)}
        self.f_dur, self.b_dur, self.w_dur = self.dur[OpKind.F], self.dur[self.bkind], self.dur[OpKind.W]
        self.end = [INF] * (2 * layout.C * S * layout.M)  # signal key -> time it is made (INF: not yet)
        self.next_f = [0] * (layout.C * S)
        self.next_b = [0] * (layout.C * S)
        self.live = [0] * P
        self.reserved = [0] * P
        self.now = [0.0] * P
        self.wake = [INF] * P
        self.waiting = [False] * P
        self.wq: list[list[Stage]] = [[] for _ in range(P)]
        self.wq_head = [0] * P
        self.todo = [sum(2 * len(layout.chain_mbs[c]) for c, _ in layout.local[r]) for r in range(P)]
        self.out: list[list[ComputeItem]] = [[] for _ in range(P)]
        # per rank, per local stage: (chain, stage, c * S + s, its micro-batches, F's and B's inputs as
        # (key for slot 0, hop latency: the producing stage's when it runs on another rank))
        lat = sc.comm

        def hops(waits: tuple, r: int) -> tuple[tuple[int, float], ...]:
            return tuple((key, lat[st] if owner != r else 0.0) for key, owner, st in waits)

        self.stages = [[(c, s, c * S + s, layout.chain_mbs[c], hops(self.f_tpl[c * S + s][0], r),
                         hops(self.b_tpl[c * S + s][0], r)) for c, s in layout.local[r]] for r in range(P)]
        self.active = [r for r in range(P) if self.todo[r]]  # unfinished ranks, in rank order
        # which waiting ranks an op may have changed the candidates of (``run`` wakes only those): the rank
        # that consumes its signal, and where it takes or frees memory the ranks that inject micro-batches
        # (an F entering a chain checks the memory of every rank of the chain; any other F only its own)
        injectors = tuple(sorted({chain[0] for chain in layout.placement}))
        nxt = [chain[s + 1] if s + 1 < S else None for chain in layout.placement for s in range(S)]
        prv = [chain[s - 1] if s else None for chain in layout.placement for s in range(S)]
        self.f_wakes = [tuple(sorted({x for x in (n,) if x is not None} | set(injectors))) for n in nxt]
        frees = not policy.split  # a fused BW frees its activation
        self.b_wakes = [tuple(sorted({x for x in (p,) if x is not None} | (set(injectors) if frees else set())))
                        for p in prv]
        self.w_wakes = injectors

    # ----- 1. gather ---------------------------------------------------------------------------
    def _f_allowed(self, r: int, c: int, s: int) -> bool:
        layout, cap, caps = self.layout, self.policy.cap, self.policy.stage_caps
        k = c * layout.S + s
        in_flight = self.next_f[k] - self.next_b[k]
        if (cap and in_flight >= cap * (layout.S - s)) or (caps and in_flight >= caps[k]):
            return False
        if not self.policy.reserve:
            return self.live[r] < self.limits[r]
        if s:
            return True  # its slot was reserved when the micro-batch entered
        cnt, live, reserved, limits = layout.count[c], self.live, self.reserved, self.limits
        return all(live[x] + reserved[x] + cnt[x] <= limits[x] for x in layout.chain_ranks[c])

    def gather(self, r: int, t: float) -> Ready:
        """Per local stage: the next F (in micro-batch order) and the next B whose F has run."""
        fs: list[Stage] = []
        bs: list[Stage] = []
        f_soon: list[tuple[float, int, int]] = []
        b_soon: list[tuple[float, int, int]] = []
        next_f, next_b, end = self.next_f, self.next_b, self.end
        nk = INF
        mem_blocked = inject_blocked = False
        arrived: dict[tuple, float] = {}  # (c, s) of a ready F, (c, s, 1) of a ready B -> when its inputs arrived
        for c, s, k, mbs, f_waits, b_waits in self.stages[r]:
            i = next_f[k]
            if i < len(mbs):
                m = mbs[i]
                off = m + m
                tf = 0.0  # when the F's inputs reach rank r (INF: one is not made yet)
                for key, hop in f_waits:
                    v = end[key + off] + hop
                    if v > tf:
                        tf = v
                if tf > t:
                    nk = tf if tf < nk else nk
                    if tf != INF:
                        f_soon.append((tf, c, s))
                elif self._f_allowed(r, c, s):
                    fs.append((c, s, m))
                    arrived[c, s] = tf
                else:  # ready, but memory holds it back
                    mem_blocked = True
                    inject_blocked = inject_blocked or s == 0
            j = next_b[k]
            if j < i:
                m = mbs[j]
                off = m + m
                tb = 0.0
                for key, hop in b_waits:
                    v = end[key + off] + hop
                    if v > tb:
                        tb = v
                if tb <= t:
                    bs.append((c, s, m))
                    arrived[c, s, 1] = tb
                else:
                    nk = tb if tb < nk else nk
                    if tb != INF:
                        b_soon.append((tb, c, s))
        ready = Ready(fs, bs, f_soon, b_soon, nk, mem_blocked, inject_blocked, self.wq_head[r] < len(self.wq[r]))
        if len(fs) > 1 or len(bs) > 1:
            self._order(ready, arrived)
        return ready

    def _order(self, ready: Ready, arrived: dict[tuple, float]) -> None:
        """Best candidates first (deepest B; deepest or shallowest F; with ``fifo`` the earliest
        arrived first, depth breaking ties), shuffled with probability ``noise``."""
        fs, bs = ready.fs, ready.bs
        fifo = self.policy.fifo
        if len(fs) > 1:
            deep = self.policy.deep_first
            fs.sort(key=lambda o: (arrived[o[0], o[1]] if fifo else 0.0, -o[1] if deep else o[1], o[2]))
        if len(bs) > 1:
            bs.sort(key=lambda o: (arrived[o[0], o[1], 1] if fifo else 0.0, -o[1], o[2]))
        rng = self.rng
        if rng is not None:
            if len(fs) > 1 and rng.random() < self.noise:
                rng.shuffle(fs)
            if len(bs) > 1 and rng.random() < self.noise:
                rng.shuffle(bs)

    # ----- 2. choose ---------------------------------------------------------------------------
    def _pair(self, ready: Ready) -> Choice | None:
        """The first ready F and ready B of different local stages, as one FB unit."""
        for fo in ready.fs:
            for bo in ready.bs:
                if (fo[0], fo[1]) != (bo[0], bo[1]):
                    return Choice(OpKind.FB, fo, bo)
        return None

    def _next_mb(self, c: int, s: int, forward: bool) -> int:
        """The micro-batch slot the next F (or B) of stage (c, s) runs."""
        k = c * self.layout.S + s
        mbs = self.layout.chain_mbs[c]
        i = self.next_f[k] if forward else self.next_b[k]
        return mbs[min(i, len(mbs) - 1)]

    def _unit(self, f: tuple[int, int, int], b: tuple[int, int, int]) -> float:
        """Time of an FB unit of F ``f`` and backward ``b`` ((chain, stage, slot) each)."""
        if self.scales is None:
            return self.sc.fb_cost(f[1], self.bkind, b[1])
        k, kw = self.scales
        return self.sc.fb_cost(f[1], self.bkind, b[1], k[f[2]], k[b[2]], kw[b[2]])

    def _partner_due(self, r: int, t: float, ready: Ready) -> float | None:
        """With only F's (only B's) ready: when to wake for a partner whose FB saves more than the wait."""
        S = self.layout.S
        lone_f = ready.fs[0] if ready.fs else None
        c0, s0, m0 = lone_f or ready.bs[0]
        lone = self.f_dur[c0 * S + s0][m0] if lone_f else self.b_dur[c0 * S + s0][m0]
        soon = ready.b_soon if lone_f else ready.f_soon
        for t_other, c, s in soon:
            if (c, s) == (c0, s0):
                continue
            if lone_f:
                m = self._next_mb(c, s, False)
                other, unit = self.b_dur[c * S + s][m], self._unit(lone_f, (c, s, m))
            else:
                if not self._f_allowed(r, c, s):
                    continue
                m = self._next_mb(c, s, True)
                other, unit = self.f_dur[c * S + s][m], self._unit((c, s, m), ready.bs[0])
            if t_other - t < lone + other - unit:
                return t_other
        return None

    def _default(self, t: float, ready: Ready, r: int) -> Choice | None:
        """Inject, B or F by the policy's order; else a deferred W when filling idle time pays."""
        pol, fs, bs = self.policy, ready.fs, ready.bs
        first_b = pol.b_first
        if self.rng is not None and fs and bs and self.rng.random() < self.noise:
            first_b = not first_b
        if pol.w_eager and ready.has_w:
            return Choice(OpKind.W)
        inject = [o for o in fs if o[1] == 0] if pol.inject_first else []
        if inject:
            return Choice(OpKind.F, inject[0])
        if pol.inject_first and ready.inject_blocked and ready.has_w:
            return Choice(OpKind.W)
        if bs and (first_b or not fs):
            return Choice(self.bkind, None, bs[0])
        if fs:
            return Choice(OpKind.F, fs[0])
        if not ready.has_w:
            return None
        if ready.f_mem_blocked or pol.w_fill or ready.next_known == INF:
            return Choice(OpKind.W)
        c0, s0, m0 = self.wq[r][self.wq_head[r]]
        return Choice(OpKind.W) if t + self.w_dur[c0 * self.layout.S + s0][m0] <= ready.next_known else None

    def _held_for_b(self, r: int, t: float, ready: Ready, choice: Choice) -> float | None:
        """With ``hold_b``: the time of a B due before ``choice`` (an F or W) would end, or None."""
        if choice.kind not in (OpKind.F, OpKind.W) or not ready.b_soon:
            return None
        S = self.layout.S
        t_b = min(x[0] for x in ready.b_soon)
        if choice.kind is OpKind.F:
            c0, s0, m0 = choice.f
            dur = self.f_dur[c0 * S + s0][m0]
        else:
            c0, s0, m0 = self.wq[r][self.wq_head[r]]
            dur = self.w_dur[c0 * S + s0][m0]
        if t_b < t + dur and not (choice.kind is OpKind.W and ready.f_mem_blocked):
            return t_b
        return None

    def choose(self, r: int, t: float, ready: Ready) -> Choice | float:
        """The op to run now, or the time to wake up at."""
        pol = self.policy
        if not (pol.pair or pol.hold_b):
            choice = self._default(t, ready, r)
            return ready.next_known if choice is None else choice
        if pol.pair and ready.fs and ready.bs:
            choice = self._pair(ready)
            if choice is not None:
                return choice
        elif pol.pair and pol.pair_wait and (ready.fs or ready.bs):
            due = self._partner_due(r, t, ready)
            if due is not None:
                return due
        choice = self._default(t, ready, r)
        if choice is not None and pol.hold_b:
            held = self._held_for_b(r, t, ready, choice)
            if held is not None:
                return held
        return ready.next_known if choice is None else choice

    def forced(self, r: int, t: float, item: ComputeItem) -> Choice | float | None:
        """A prefix item as a ``Choice`` once its inputs are there, else the time they will be (INF: not
        yet known); None if it is not the next micro-batch of its stage (or a W whose B has not run).

        A prefix W is moved to the head of the rank's queue of deferred W's, so the named W runs.
        """
        S, end, lat = self.layout.S, self.end, self.sc.comm
        ready, f, b = 0.0, None, None
        for op in parts(item):
            c, s, m = op[1:]
            k = c * S + s
            mbs = self.layout.chain_mbs[c]
            if op.kind == OpKind.W:
                queue, head = self.wq[r], self.wq_head[r]
                if (c, s, m) not in queue[head:]:
                    return None
                queue.insert(head, queue.pop(queue.index((c, s, m), head)))  # the others keep their order
                return Choice(OpKind.W)
            if op.kind == OpKind.F:
                if self.next_f[k] >= len(mbs) or mbs[self.next_f[k]] != m:
                    return None
                waits = self.f_tpl[k][0]
                ready = max(ready, _arrival(waits, m + m, r, end, lat) if waits else 0.0)
                f = (c, s, m)
            else:
                if op.kind != self.bkind or self.next_b[k] >= self.next_f[k] or mbs[self.next_b[k]] != m:
                    return None
                ready = max(ready, _arrival(self.b_tpl[k][0], m + m, r, end, lat))
                b = (c, s, m)
        if ready > t:
            return ready
        if f is not None and b is not None:
            return Choice(OpKind.FB, f, b)
        return Choice(OpKind.F, f) if f is not None else Choice(self.bkind, None, b)

    # ----- 3. apply ----------------------------------------------------------------------------
    def _start_f(self, r: int, c: int, s: int, m: int, end: float) -> None:
        layout, k = self.layout, c * self.layout.S + s
        if s == 0:  # kept whatever the policy (only ``reserve`` reads it): walks may share a prefix
            cnt = layout.count[c]
            for x in layout.chain_ranks[c]:
                self.reserved[x] += cnt[x]
        self.reserved[r] -= 1
        self.live[r] += 1
        self.next_f[k] += 1
        for key in self.f_tpl[k][1]:
            self.end[key + m + m] = end
        self.todo[r] -= 1

    def _start_b(self, r: int, c: int, s: int, m: int, end: float) -> None:
        k = c * self.layout.S + s
        self.next_b[k] += 1
        _, made, _, _, frees = self.b_tpl[k]
        for key in made:
            self.end[key + m + m] = end
        self.live[r] -= frees  # a fused BW frees its activation at once
        if not frees:
            self.wq[r].append((c, s, m))
        self.todo[r] -= 1

    def apply(self, r: int, t: float, choice: Choice) -> None:
        S, kind = self.layout.S, choice.kind
        if kind is OpKind.W:
            c, s, m = self.wq[r][self.wq_head[r]]
            self.wq_head[r] += 1
            end = t + self.w_dur[c * S + s][m]
            self.live[r] -= 1
            item: ComputeItem = Op(OpKind.W, c, s, m)
        elif kind is OpKind.F:
            c, s, m = choice.f
            end = t + self.f_dur[c * S + s][m]
            self._start_f(r, c, s, m, end)
            item = Op(OpKind.F, c, s, m)
        elif kind is OpKind.FB:
            (fc, fs, fm), (bc, bs, bm) = choice.f, choice.b
            end = t + self._unit(choice.f, choice.b)
            self._start_f(r, fc, fs, fm, end)
            self._start_b(r, bc, bs, bm, end)
            item = FB(Op(OpKind.F, fc, fs, fm), Op(self.bkind, bc, bs, bm))
        else:
            c, s, m = choice.b
            end = t + self.b_dur[c * S + s][m]
            self._start_b(r, c, s, m, end)
            item = Op(self.bkind, c, s, m)
        self.out[r].append(item)
        self.now[r] = end

    def woken(self, choice: Choice) -> tuple[int, ...]:
        """The ranks whose candidates ``choice`` may have changed: the consumers of what it made, and the
        ranks that inject micro-batches when it took or freed memory. A rank that waits re-gathers only
        then (or at its wake-up time); any other would decide as before."""
        S, kind = self.layout.S, choice.kind
        if kind is OpKind.W:
            return self.w_wakes
        if kind is OpKind.F:
            return self.f_wakes[choice.f[0] * S + choice.f[1]]
        b = self.b_wakes[choice.b[0] * S + choice.b[1]]
        if kind is OpKind.FB:
            return tuple(set(b) | set(self.f_wakes[choice.f[0] * S + choice.f[1]]))
        return b

    # ----- the walk ----------------------------------------------------------------------------
    def run(self, until_choice: bool = False) -> list[list[ComputeItem]] | None:
        """Repeatedly: the unfinished rank free (or waking) first gathers, chooses and applies.

        ``until_choice``: stop (returning ``out`` so far) before the first choice the policy makes, when
        every step before it only ran prefix items: that much is the same for every policy (``clone``).
        """
        waiting, now, wake, active = self.waiting, self.now, self.wake, self.active
        gather, choose, apply = self.gather, self.choose, self.apply
        while active:
            r, t = -1, INF
            for x in active:
                tx = wake[x] if waiting[x] else now[x]
                if tx < t:
                    r, t = x, tx
            if r < 0:
                return None  # every remaining rank waits on something nobody will produce
            if until_choice and len(self.out[r]) >= len(self.prefix[r]):
                return self.out  # the state is as it was: a clone picks the same rank and time
            if waiting[r]:
                waiting[r] = False
                now[r] = t = max(now[r], t)
            if len(self.out[r]) < len(self.prefix[r]):
                got = self.forced(r, t, self.prefix[r][len(self.out[r])])
                if got is None:
                    return None
            else:
                got = choose(r, t, gather(r, t))
            if type(got) is not Choice:
                waiting[r], wake[r] = True, got
                continue
            apply(r, t, got)
            for x in self.woken(got):  # what this op made or freed may be what those ranks wait for
                waiting[x] = False
            if self.todo[r] == 0 and self.wq_head[r] == len(self.wq[r]):
                active.remove(r)
        return self.out


    def clone(self, policy: Policy) -> _Walk:
        """A copy of this walk's state that goes on under ``policy`` (same backward kind: ``split``)."""
        other = copy.copy(self)
        other.policy = policy
        for name in ("end", "next_f", "next_b", "live", "reserved", "now", "wake", "waiting", "wq_head", "todo",
                     "active"):
            setattr(other, name, list(getattr(self, name)))
        other.wq = [list(q) for q in self.wq]
        other.out = [list(o) for o in self.out]
        return other


def _durations(sc: StageCosts, kind: OpKind, S: int, C: int, M: int,
               scales: tuple[list[float], list[float]] | None) -> list[list[float]]:
    """Per ``c * S + s``, per micro-batch slot: the time of ``kind`` there (``ops.RULES``, scaled per slot)."""
    rule_ = RULES[kind]
    out = []
    for _ in range(C):
        for s in range(S):
            if scales is None:
                out.append([rule_.cost(sc, s)] * M)
            else:
                out.append([rule_.scaled_cost(sc, s, k, kw) for k, kw in zip(*scales)])
    return out


def list_schedules_from(layout: Layout, sc: StageCosts, limits: list[int], pols: list[Policy],
                        prefix: list[list[ComputeItem]],
                        table: OpTable | None = None) -> list[list[list[ComputeItem]] | None]:
    """``list_schedule`` with ``prefix`` under each of ``pols`` (all with the same ``split``), in order.

    Until the first rank runs out of its prefix the walk is the same whatever the policy (it only
    runs given items), so that part is walked once and each policy goes on from a copy of it: with
    a prefix of three quarters of the step (``repair``'s re-listing) most of every walk.
    """
    if not pols:
        return []
    if len({p.split for p in pols}) > 1:
        raise ValueError("list_schedules_from: the policies must agree on split (the backward kind)")
    if table is None:
        table = OpTable(layout.placement, layout.M, sc)
    shared = _Walk(layout, table, sc, limits, pols[0], None, 0.0, prefix)
    if shared.run(until_choice=True) is None:
        return [None] * len(pols)
    return [shared.clone(pol).run() for pol in pols]


def list_schedule(layout: Layout, sc: StageCosts, limits: list[int], policy: Policy,
                  rng: random.Random | None = None, noise: float = 0.0,
                  table: OpTable | None = None,
                  prefix: list[list[ComputeItem]] | None = None) -> list[list[ComputeItem]] | None:
    """One greedy walk under ``policy``; per-rank op lists, or None if the walk got stuck.

    ``prefix``: each rank's first items, run as given before the policy chooses (None if one is not
    the next micro-batch of its stage, as the walk runs each stage's micro-batches in order).

    ``rng`` and ``noise`` randomise ties (the order of ready F's / B's, B-first vs F-first);
    ``table`` (the placement's ``OpTable`` with ``sc``) may be passed to share it between walks.
    """
    if table is None:
        table = OpTable(layout.placement, layout.M, sc)
    return _Walk(layout, table, sc, limits, policy, rng, noise, prefix).run()
