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

import math
import random
from dataclasses import dataclass

from ..costs import StageCosts
from ..ir import FB, ComputeItem, Op
from ..ops import OpKind, OpTable, parts
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
        # per rank, per local stage: (chain, stage, c * S + s, its micro-batches, F's and B's inputs)
        self.stages = [[(c, s, c * S + s, layout.chain_mbs[c], self.f_tpl[c * S + s][0], self.b_tpl[c * S + s][0])
                        for c, s in layout.local[r]] for r in range(P)]
        self.active = [r for r in range(P) if self.todo[r]]  # unfinished ranks, in rank order

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
        next_f, next_b, end, lat = self.next_f, self.next_b, self.end, self.sc.comm
        nk = INF
        mem_blocked = inject_blocked = False
        arrived: dict[tuple, float] = {}  # (c, s) of a ready F, (c, s, 1) of a ready B -> when its inputs arrived
        for c, s, k, mbs, f_waits, b_waits in self.stages[r]:
            i = next_f[k]
            if i < len(mbs):
                m = mbs[i]
                tf = _arrival(f_waits, m + m, r, end, lat) if f_waits else 0.0
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
                tb = _arrival(b_waits, m + m, r, end, lat)
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

    def _partner_due(self, r: int, t: float, ready: Ready) -> float | None:
        """With only F's (only B's) ready: when to wake for a partner whose FB saves more than the wait."""
        S, sc, bkind = self.layout.S, self.sc, self.bkind
        lone_f = ready.fs[0] if ready.fs else None
        c0, s0, _ = lone_f or ready.bs[0]
        lone = self.f_tpl[c0 * S + s0][2] if lone_f else self.b_tpl[c0 * S + s0][2]
        soon = ready.b_soon if lone_f else ready.f_soon
        for t_other, c, s in soon:
            if (c, s) == (c0, s0):
                continue
            if lone_f:
                other, unit = self.b_tpl[c * S + s][2], sc.fb_cost(s0, bkind, s)
            else:
                if not self._f_allowed(r, c, s):
                    continue
                other, unit = self.f_tpl[c * S + s][2], sc.fb_cost(s, bkind, s0)
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
        c0, s0, _ = self.wq[r][self.wq_head[r]]
        return Choice(OpKind.W) if t + self.w_tpl[c0 * self.layout.S + s0][2] <= ready.next_known else None

    def _held_for_b(self, r: int, t: float, ready: Ready, choice: Choice) -> float | None:
        """With ``hold_b``: the time of a B due before ``choice`` (an F or W) would end, or None."""
        if choice.kind not in (OpKind.F, OpKind.W) or not ready.b_soon:
            return None
        S = self.layout.S
        t_b = min(x[0] for x in ready.b_soon)
        if choice.kind is OpKind.F:
            dur = self.f_tpl[choice.f[0] * S + choice.f[1]][2]
        else:
            c0, s0, _ = self.wq[r][self.wq_head[r]]
            dur = self.w_tpl[c0 * S + s0][2]
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
        if self.policy.reserve:
            if s == 0:
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
            end = t + self.w_tpl[c * S + s][2]
            self.live[r] -= 1
            item: ComputeItem = Op(OpKind.W, c, s, m)
        elif kind is OpKind.F:
            c, s, m = choice.f
            end = t + self.f_tpl[c * S + s][2]
            self._start_f(r, c, s, m, end)
            item = Op(OpKind.F, c, s, m)
        elif kind is OpKind.FB:
            (fc, fs, fm), (bc, bs, bm) = choice.f, choice.b
            end = t + self.sc.fb_cost(fs, self.bkind, bs)
            self._start_f(r, fc, fs, fm, end)
            self._start_b(r, bc, bs, bm, end)
            item = FB(Op(OpKind.F, fc, fs, fm), Op(self.bkind, bc, bs, bm))
        else:
            c, s, m = choice.b
            end = t + self.b_tpl[c * S + s][2]
            self._start_b(r, c, s, m, end)
            item = Op(self.bkind, c, s, m)
        self.out[r].append(item)
        self.now[r] = end

    # ----- the walk ----------------------------------------------------------------------------
    def run(self) -> list[list[ComputeItem]] | None:
        """Repeatedly: the unfinished rank free (or waking) first gathers, chooses and applies."""
        waiting, now, wake, active = self.waiting, self.now, self.wake, self.active
        awake = [False] * self.layout.P
        gather, choose, apply = self.gather, self.choose, self.apply
        while active:
            r, t = -1, INF
            for x in active:
                tx = wake[x] if waiting[x] else now[x]
                if tx < t:
                    r, t = x, tx
            if r < 0:
                return None  # every remaining rank waits on something nobody will produce
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
            waiting[:] = awake  # what this op made may be what the waiting ranks wait for
            if self.todo[r] == 0 and self.wq_head[r] == len(self.wq[r]):
                active.remove(r)
        return self.out


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
