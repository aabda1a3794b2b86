"""Discrete-event simulation of a schedule: makespan, bubbles, peak activations, timeline.

Every rank runs its ops in order; an op starts when its rank is free and every op it depends on
has finished (plus the point-to-point latency when that op ran on another rank). What an op
waits for, costs and holds comes from ``ops`` (the one definition of an op's meaning); this module
only walks. The same walk detects deadlocks, so ``validate`` reuses it. Activations are counted
as docs/schedules.md defines them: +1 when a stage's F starts, -1 when its W or BW finishes.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, count, islice
from operator import is_not, itemgetter
from typing import NamedTuple

from . import ops as K
from ._perf import gc_paused
from .costs import COST_FIELDS, Costs, StageCosts
from .errors import ScheduleError
from .ir import FB, CommBatch, Program, Schedule
from .ops import COLLECTIVE, OpTable, signal_name
from .structure import check_structure
from .timeline import Timeline, TimelineEvent


@dataclass
class SimResult:
    name: str
    num_ranks: int
    num_microbatches: int
    makespan: float
    busy: list[float]
    makespan_bubble: list[float]
    span_bubble: list[float]
    peak_activations: list[int]
    bubble_rate: float
    timeline: list[TimelineEvent] = field(repr=False)
    costs: Costs = field(default_factory=Costs, repr=False)
    rank_end: list[float] = field(default_factory=list, repr=False)  # when each rank's last op ends
    dp_exposed: list[float] = field(default_factory=list, repr=False)  # reduction time past each rank's compute

    @property
    def span_bubble_rate(self) -> float:
        spans = sum(b + s for b, s in zip(self.busy, self.span_bubble))
        return sum(self.span_bubble) / spans if spans else 0.0

    def to_timeline(self) -> Timeline:
        return Timeline(self.name, self.num_ranks, self.num_microbatches, list(self.timeline), "simulated",
                        {"costs": self.costs.describe()})

    def summary(self) -> dict:
        return {"name": self.name, "num_ranks": self.num_ranks, "num_microbatches": self.num_microbatches,
                "makespan": self.makespan, "bubble_rate": self.bubble_rate, "busy": self.busy,
                "makespan_bubble": self.makespan_bubble, "span_bubble": self.span_bubble,
                "peak_activations": self.peak_activations}


@gc_paused
def run_schedule(schedule: Schedule, costs: Costs | None = None, record: bool = True,
                 starts_out: list[list[float]] | None = None, ends_out: list[list[float]] | None = None) -> SimResult:
    """Simulate ``schedule`` (compute ops only) under ``costs``; raise ScheduleError on deadlock.

    ``record`` keeps the timeline; ``starts_out``/``ends_out`` (one list per rank) receive each
    op's start and end in program order — what lowering needs, without building events.

    ``ops.OpTable`` resolves every (kind, chain, stage) once into the signal keys it waits for
    (with the hop latency when the producer is on another rank), the key it makes, its cost and
    activation effect: the dependency rule lives there, this walk only waits and counts.
    ``end_of[k]`` holds the time signal ``k`` became available (-1 while not made). A rank that
    meets an op whose input is not ready parks on that input and is resumed when it is made, so
    the walk is linear in the number of ops.
    """
    costs = costs or Costs()
    placement = schedule.placement
    if len({len(c) for c in placement}) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages to be simulated")
    trace = [[] for _ in schedule.ranks] if starts_out is not None or ends_out is not None else None
    walk = _Walk(schedule, costs.per_stage(len(placement[0])), record, trace)
    walk.run()
    for r, items in enumerate(trace or ()):
        if starts_out is not None:
            starts_out[r].extend(e[0] for e in items)
        if ends_out is not None:
            ends_out[r].extend(e[1] for e in items)
    P, busy, compute_end = schedule.num_ranks, walk.column(4), walk.column(1)
    now = [max(t, walk.comm_end[r]) for r, t in enumerate(compute_end)]  # a step ends when its reductions do
    makespan = max(now) if P else 0.0
    span = [(now[r] - walk.first[r]) if walk.first[r] is not None else 0.0 for r in range(P)]
    idle = [makespan - b for b in busy]
    return SimResult(
        name=schedule.name, num_ranks=P, num_microbatches=schedule.num_microbatches, makespan=makespan,
        busy=busy, makespan_bubble=idle, span_bubble=[sp - b for sp, b in zip(span, busy)],
        peak_activations=walk.column(3), bubble_rate=(sum(idle) / (P * makespan)) if makespan else 0.0,
        timeline=walk.events, costs=costs, rank_end=list(now),
        dp_exposed=[max(0.0, e - t) for e, t in zip(walk.comm_end, compute_end)],
    )


class _Walk:
    """The event walk's state: per rank [position, clock, live, peak, busy]; per signal its end time."""

    def __init__(self, schedule: Schedule, sc: StageCosts, record: bool, trace: list[list[tuple]] | None,
                 resume: tuple[_Walk, int, float] | None = None) -> None:
        """A walk of ``schedule``; ``resume=(old, rank, t0)``: of ``old``'s schedule with ``rank``'s order
        changed, every op that started before ``t0`` kept.

        A resumed walk shares ``old``'s op table and its other ranks' op lists, and copies its signal
        times and ``made_at``: a signal whose producer started at or after ``t0`` (``made_at[key] >= t0``)
        counts as not made until this walk makes it again (and sets ``made_at[key]`` to -1), so nothing
        has to be unset.
        """
        P = schedule.num_ranks
        placement = schedule.placement
        self.S, self.M = len(placement[0]), schedule.num_microbatches
        self.sc = sc
        self.fb_cost = sc.fb_cost
        if resume is None:
            # per micro-batch slot, the (F/B, W) factors of the micro-batch it runs; None: all alike
            self.scales = sc.slot_scales(getattr(schedule, "microbatch_order", None), self.M)
            self.templates = _walk_table(placement, self.M, sc, self.scales)
            self.rank_ops = [_compute_items(ops) for ops in schedule.ranks]
            # one signal slot per (kind, chain, stage, mb), then two spare ones: ``trace`` records what an op
            # made as the slot's key or as the table's negative "made" code (-1 nothing, -2 ops.COLLECTIVE)
            self.end_of = [-1.0] * (2 * len(placement) * self.S * self.M + 2)
            self.old_end = self.end_of  # a fresh walk has nothing to compare with: no signal ever "moved"
            # per signal, the start of the op that made it (``Replay`` fills it in; -1: made by this walk)
            self.made_at = [-1.0] * len(self.end_of)
            self.t0 = math.inf
        else:
            old, rank, self.t0 = resume
            self.templates, self.rank_ops, self.end_of = old.templates, list(old.rank_ops), list(old.end_of)
            self.made_at = list(old.made_at)
            self.scales = old.scales
            # compute items only: a Replay's orders hold nothing else; rank None: every rank's order is new
            if rank is None:
                self.rank_ops = list(schedule.ranks)
            else:
                self.rank_ops[rank] = schedule.ranks[rank]
            self.old_end = old.end_of  # what each signal's time was before
        self.moved: list[int] = []  # signals this walk made at another time than ``old_end`` says
        self.rejoin: _Rejoin | None = None  # set by ``Replay.changed``
        self.works: list[float] | None = None  # per rank, the compute time of all its items (``work``)
        self.waiters: dict[int, list[int]] = {}  # signal key -> parked ranks
        self.blocked_on: dict[int, tuple[int, int]] = {}  # rank -> (signal key, producing rank) of its last park
        self.state = [[0, 0.0, 0, 0, 0.0] for _ in range(P)]  # position, clock, live, peak, busy
        self.first: list[float | None] = [None] * P
        self.events: list[TimelineEvent] = []
        self.record = record
        self.trace = trace  # per rank, per item run: (start, end, live, peak, busy) after it, the keys it made
        self.stack = list(range(P))
        self.caps: Sequence[float] = [math.inf] * P  # per-rank activation limits of a cut-off walk (Cutoff.peaks)
        self.over = False  # a cut-off walk stopped early
        self.posts: list[tuple[int, int, int, float]] = []  # collective ops: (rank, chain, stage, post time)
        self.dp_sync = sc.dp_sync
        # what every resume of a rank reads, bound once
        self.ctx = (self.templates, self.end_of, self.waiters, self.stack, self.S,
                    self.events if record else None, self.blocked_on, self.posts, trace, self.made_at, self.t0)

    def work(self, items: Sequence) -> float:
        """The compute time of ``items`` (of a rank's: what its busy time ends at)."""
        templates, S, total, scales = self.templates, self.S, 0.0, self.scales
        for item in items:
            if type(item) is FB:
                f, b = item
                if scales is None:
                    total += self.fb_cost(f[2], b[0], b[2])
                else:
                    total += self.fb_cost(f[2], b[0], b[2], scales[0][f[3]], scales[0][b[3]], scales[1][b[3]])
            else:
                total += templates[item[0]][item[1] * S + item[2]][2][item[3]]
        return total

    def rank_works(self) -> list[float]:
        """Per rank, the compute time of all its items (computed once per walk)."""
        if self.works is None:
            self.works = [self.work(ops) for ops in self.rank_ops]
        return self.works

    def mark_made(self, keep: int | list[int]) -> None:
        """Record in ``made_at`` the start of each op this walk ran (each rank's trace from ``keep[r]``, or from
        ``keep`` on every rank): what the next replay's test of "kept or made again" reads."""
        made_at = self.made_at
        for r, tr in enumerate(self.trace):
            for e in islice(tr, keep if type(keep) is int else keep[r], None):
                made_at[e[5]] = made_at[e[6]] = e[0]  # a negative key is a spare slot

    def column(self, k: int) -> list:
        """One per-rank counter (1 clock, 2 live, 3 peak, 4 busy) as a list over ranks."""
        return [st[k] for st in self.state]

    def run(self, cutoff: Cutoff | None = None, work: list[float] | None = None) -> None:
        try:
            if self.walk(cutoff, work):
                return
        except KeyError as exc:  # an op kind the op table does not know
            for r, ops in enumerate(self.rank_ops):
                for i, item in enumerate(ops):
                    if type(item) is not FB and item.kind not in self.templates:
                        raise ScheduleError(f"rank {r} op {i}: unknown op kind {item.kind!r}; "
                                            "allowed F, B, W, BW, FB, REDUCE_GRAD") from exc
            raise
        stuck = [r for r, st in enumerate(self.state) if st[0] < len(self.rank_ops[r])]
        if stuck:
            pos = self.column(0)
            raise ScheduleError(_deadlock_message(self.rank_ops, pos, self.blocked_on, stuck, self.S, self.M))
        self.comm_end = self.run_collectives()

    def walk(self, cutoff: Cutoff | None, work: list[float] | None) -> bool:  # noqa: C901 - the hot loop is one function
        """Run the ranks on the stack, each until it waits for a signal not yet made (the compiler's hot
        loop); True if ``cutoff`` stopped the walk (then ``over`` is set).

        A rank's counters live in locals while it runs and are written back when it parks or finishes.
        An FB unit waits for both parts' inputs, costs one unit (``StageCosts.fb_cost``) and makes both
        parts' signals at its end; it is handled inline too, with its own copy of the wait loop: a call
        per unit cost 10-15 % of an annealing step, and one code path for both (a tuple of (waits,
        offset) per op) 10-12 %. A rank resumes about twice per op it runs in an annealing replay, so
        resuming it is inline as well, with the cut-off's bookkeeping after it.

        With ``cutoff`` the walk stops as soon as its result is ruled out. ``work[r]`` is the compute
        time of all rank ``r``'s items, so clock + work - busy is a lower bound of when the rank ends;
        it only grows (an op that starts late moves it by the wait), so (max of these + weight * their
        sum) after any resume is a lower bound of the finished walk's makespan + weight * sum of rank
        ends. A peak only grows, so the walk stops at the first op over ``cutoff.peaks``.
        A replay (``rejoin`` set) also stops once it is back where the old walk was, and takes the
        old walk's rest (``_Rejoin``); and once the changed rank is past its changed items, every
        rank's end is at least its old end minus ``_Rejoin.floors``' bound, a tighter bound than the
        clock while a rank has idle gaps ahead.
        """
        templates, end_of, waiters, stack, S, events, blocked_on, posts, trace, made_at, t0 = self.ctx
        state, old_end, moved, scales, fb_cost, first = self.state, self.old_end, self.moved, self.scales, \
            self.fb_cost, self.first
        rank_ops = self.rank_ops
        rejoin = floor = None
        if cutoff is not None:
            weight, ceiling, caps = cutoff.weight, cutoff.score + 1e-9, cutoff.peaks
            self.caps = caps
            if any(st[3] > cap for st, cap in zip(state, caps)):  # over already before the change
                self.over = True
                return True
            ends = [st[1] + w - st[4] for st, w in zip(state, work)]
            total, latest = sum(ends), max(ends)
            rejoin = self.rejoin
            if rejoin is not None:
                changed, span_end, shift, old_trace = rejoin.rank, rejoin.hi, rejoin.shift, rejoin.old.trace
                astray = {changed}  # ranks not where the old walk was
        else:
            caps = self.caps
        while stack:
            r = stack.pop()
            ops, st = rank_ops[r], state[r]
            cap = caps[r]
            i, t_now, live, peak, busy = st
            nops = len(ops)
            over = False
            while i < nops:
                item = ops[i]
                if type(item) is FB:
                    (fk, fc, fs, fm), (bk, bc, bs, bm) = item
                    wf, mf, _, hf, ff = templates[fk][fc * S + fs]
                    wb, mb_, _, hb, fbb = templates[bk][bc * S + bs]
                    t = 0.0
                    for waits, off in ((wf, fm + fm), (wb, bm + bm)):
                        for key, hop, owner in waits:
                            key += off
                            v = end_of[key]
                            if v < 0 or made_at[key] >= t0:  # not made (again) yet
                                waiters.setdefault(key, []).append(r)
                                blocked_on[r] = (key, owner)
                                t = -1.0
                                break
                            v += hop
                            if v > t:
                                t = v
                        if t < 0:
                            break
                    if t < 0:  # parked on a missing input
                        break
                    start = t_now if t_now > t else t
                    if not i:
                        first[r] = start
                    live += hf + hb
                    if live > peak:
                        peak = live
                        if peak > cap:
                            over = True
                            break
                    live -= ff + fbb
                    if scales is None:
                        dur = fb_cost(fs, bk, bs)
                    else:
                        dur = fb_cost(fs, bk, bs, scales[0][fm], scales[0][bm], scales[1][bm])
                    t_now = start + dur
                    made = mf + fm + fm if mf >= 0 else -1
                    made2 = mb_ + bm + bm if mb_ >= 0 else -1
                    for key in (made, made2):
                        if key >= 0:
                            end_of[key] = t_now
                            made_at[key] = -1.0
                            if old_end[key] != t_now:  # a fresh walk's old_end is its end_of: never
                                moved.append(key)
                            w = waiters.pop(key, None)
                            if w:
                                stack.extend(w)
                    if events is not None:
                        events.append(TimelineEvent(r, "FB", fc, fs, fm, start, t_now, (bk, bc, bs, bm)))
                    busy += dur
                    if trace is not None:
                        trace[r].append((start, t_now, live, peak, busy, made, made2))
                    i += 1
                    continue
                kind, c, s, m = item
                waits, made, durs, holds, frees = templates[kind][c * S + s]
                off = m + m
                t = 0.0
                for key, hop, owner in waits:
                    key += off
                    v = end_of[key]
                    if v < 0 or made_at[key] >= t0:  # not made (again) yet
                        waiters.setdefault(key, []).append(r)
                        blocked_on[r] = (key, owner)
                        t = -1.0
                        break
                    v += hop
                    if v > t:
                        t = v
                if t < 0:  # parked on a missing input
                    break
                start = t_now if t_now > t else t
                if not i:
                    first[r] = start
                live += holds
                if live > peak:
                    peak = live
                    if peak > cap:  # over the activation limit: the cut-off walk stops here
                        over = True
                        break
                live -= frees
                if made == COLLECTIVE:  # posted to the comm stream: the rank goes on at once
                    posts.append((r, c, s, start))
                    dur = 0.0
                else:
                    dur = durs[m]
                t_now = start + dur
                if made >= 0:
                    made += off
                    end_of[made] = t_now
                    made_at[made] = -1.0
                    if old_end[made] != t_now:
                        moved.append(made)
                    w = waiters.pop(made, None)
                    if w:
                        stack.extend(w)
                if events is not None and made != COLLECTIVE:
                    events.append(TimelineEvent(r, kind, c, s, m, start, t_now))
                busy += dur
                if trace is not None:
                    trace[r].append((start, t_now, live, peak, busy, made, -1))
                i += 1
            st[:] = i, t_now, live, peak, busy
            if over:
                self.over = True
                return True
            if cutoff is None:
                continue
            if rejoin is not None:
                # is rank r where the old walk was at the same point of its order (``_Rejoin.matches``)?
                if r == changed and i <= span_end:  # still inside its changed items
                    astray.add(r)
                else:
                    j = i - 1 + shift if r == changed else i - 1
                    if j < 0:  # nothing run yet: where every walk starts
                        astray.discard(r)
                    else:
                        e = old_trace[r][j]
                        if e[1] == t_now and e[2] == live and peak >= e[3]:
                            astray.discard(r)
                        else:
                            astray.add(r)
                if not astray and rejoin.settled():
                    rejoin.fill()
                    ends = self.column(1)
                    self.over = (max(ends) + weight * sum(ends) > ceiling
                                 or any(st[3] > cap for st, cap in zip(state, caps)))
                    return self.over
                if floor is None and r == changed and i > span_end:
                    floor = rejoin.floors()
                    if floor:
                        ends = [e if e > f else f for e, f in zip(ends, floor)]
                        total, latest = sum(ends), max(ends)
            end = t_now + work[r] - busy
            if floor and end < floor[r]:
                end = floor[r]
            total += end - ends[r]
            ends[r] = end
            if end > latest:
                latest = end
            if latest + weight * total > ceiling:
                self.over = True
                return True
        return False

    def run_collectives(self) -> list[float]:
        """Complete the posted gradient reductions; return when each rank's comm stream is idle.

        A stage's reduction sums every chain's copy of the stage (DualPipe's mirrored stages), so it
        starts once all copies have posted; each rank runs its reductions in post order.
        """
        all_posted: dict[int, float] = {}
        for _, _, s, t in self.posts:
            all_posted[s] = max(all_posted.get(s, 0.0), t)
        free = [0.0] * len(self.rank_ops)
        for r, c, s, _ in self.posts:
            start = max(free[r], all_posted[s])
            free[r] = start + self.dp_sync[s]
            if self.record:
                self.events.append(TimelineEvent(r, K.REDUCE_GRAD, c, s, 0, start, free[r], None, "comm"))
        return free

class Cutoff(NamedTuple):
    """When a replayed order is of no interest, so its walk may stop early (``Replay.changed``).

    A search throws away an order over a rank's activation limit (``peaks``) or scoring above what
    it would accept: makespan + ``weight`` * sum of rank end times > ``score``. Both are known to
    hold as soon as the walk gets there (clocks and peaks only grow), so the rest is not walked.
    """

    peaks: Sequence[float]
    score: float = math.inf
    weight: float = 0.0


class Replay:
    """A simulated compute-only order that re-simulates copies changed on one rank from where the change starts.

    Local search and annealing (``schedules.auto``) simulate thousands of orders that differ from
    the current one on a single rank, from some index on. No op that starts before the old op at
    that index starts can depend on it (its inputs ended before it started, so they started
    earlier still, and the rank's earlier ops are the same), so every op of every rank that
    started before that moment keeps its times, memory and signals: ``changed`` restores that
    state from the kept trace and walks the rest until it is back on the old walk (``_Rejoin``),
    whose rest it then takes as it was. The result is the same as ``run_schedule`` on the changed
    order (tested op for op). Orders with ``REDUCE_GRAD`` are not replayed (their reductions run
    after the walk).
    """

    def __init__(self, schedule: Schedule, costs: Costs, _walk: _Walk | None = None, _kept: int = 0,
                 _taken: int = 0) -> None:
        self.schedule = schedule
        self.costs = costs
        if _walk is None:
            _walk = _Walk(schedule, costs.per_stage(len(schedule.placement[0])), False,
                          [[] for _ in range(schedule.num_ranks)])
            _walk.run()
            _walk.mark_made(0)
        if _walk.posts:
            raise ScheduleError("Replay simulates compute ops only; this order has REDUCE_GRAD ops")
        self._walk = _walk
        self.over = _walk.over  # stopped early by a Cutoff
        self.walked = sum(st[0] for st in _walk.state) - _kept - _taken  # items this replay walked
        self.rejoined = _taken  # items it took from the replay it was made from, past where it rejoined it
        self.rank_end = _walk.column(1)
        self.peak_activations = _walk.column(3)
        self.makespan = max(self.rank_end) if self.rank_end else 0.0

    def changed(self, ranks: list[list], rank: int, index: int, cutoff: Cutoff | None = None,
                end: int | None = None) -> Replay:
        """The replay of ``ranks``: this order with ``rank``'s items from ``index`` on changed (same ops).

        ``end``: the last changed index of ``ranks[rank]`` if the caller knows it (the items after it
        are the old ones, the same objects); else it is found by comparing. Raises ``ScheduleError``
        on deadlock, like ``run_schedule``. With ``cutoff`` the walk stops once the order is ruled
        out: the result then has ``over`` set and only ``walked`` is meaningful.
        """
        if self.over:
            raise ScheduleError("this replay was stopped by its Cutoff (it holds only part of a walk); "
                                "change the replay it was made from")
        old = self._walk
        trace = old.trace
        t0 = trace[rank][index][0] if index < len(trace[rank]) else float("inf")
        keep = [bisect_left(tr, t0, key=_START) for tr in trace]  # trace entries start with the op's start
        keep[rank] = min(keep[rank], index)
        sched = copy.copy(self.schedule)  # the same schedule but for its orders (no re-validation)
        sched.ranks = ranks
        walk = _Walk(sched, old.sc, False, [tr[:k] for tr, k in zip(trace, keep)], (old, rank, t0))
        for r, k in enumerate(keep):
            if k:
                walk.state[r][:] = k, *trace[r][k - 1][1:5]
                walk.first[r] = trace[r][0][0]
        new_items, old_items = walk.rank_ops[rank], old.rank_ops[rank]
        shift = len(old_items) - len(new_items)
        if end is None:
            end = changed_span(old_items, new_items, index)[1]
        walk.rejoin = _Rejoin(old, walk, rank, index, end, shift, keep)
        walk.stack.remove(rank)
        walk.stack.append(rank)  # the changed rank first: the others may be back on the old walk sooner
        works = walk.works = list(old.rank_works())  # only the changed items' costs change (with their pairing)
        works[rank] += walk.work(new_items[index:end + 1]) - old.work(old_items[index:end + shift + 1])
        try:
            walk.run(cutoff or Cutoff([math.inf] * len(ranks)), works)
        finally:
            taken, walk.rejoin, walk.old_end = walk.rejoin.taken, None, walk.end_of  # keep no chain of walks alive
        if not walk.over and not taken:  # walked to the end without rejoining the old walk
            walk.mark_made(keep)
        return Replay(sched, self.costs, walk, sum(keep), taken)

    def from_time(self, ranks: list[list], t0: float, cutoff: Cutoff | None = None) -> Replay:
        """The replay of ``ranks``, whose every rank keeps this order's items that start before ``t0`` (the
        same objects or equal ones) and may differ from there on: those items keep their times, the rest
        is walked. What re-listing a cool-down needs (``auto.repair``); raises ``ScheduleError`` on
        deadlock; with ``cutoff``, as ``changed``.
        """
        if self.over:
            raise ScheduleError("this replay was stopped by its Cutoff (it holds only part of a walk); "
                                "change the replay it was made from")
        old = self._walk
        trace = old.trace
        keep = [bisect_left(tr, t0, key=_START) for tr in trace]
        sched = copy.copy(self.schedule)
        sched.ranks = ranks
        walk = _Walk(sched, old.sc, False, [tr[:k] for tr, k in zip(trace, keep)], (old, None, t0))
        for r, k in enumerate(keep):
            if k:
                walk.state[r][:] = k, *trace[r][k - 1][1:5]
                walk.first[r] = trace[r][0][0]
        olds = old.rank_works()  # a rank whose order is the same list keeps its work
        walk.works = [w if ranks[q] is old.rank_ops[q] else walk.work(ranks[q]) for q, w in enumerate(olds)]
        walk.run(cutoff or Cutoff([math.inf] * len(ranks)), walk.works)
        walk.old_end = walk.end_of
        if not walk.over:
            walk.mark_made(keep)
        return Replay(sched, self.costs, walk, sum(keep), 0)

    def times(self, rank: int) -> list[tuple[float, float]]:
        """(start, end) of each of ``rank``'s items in order: ``run_schedule``'s ``starts_out``/``ends_out``."""
        if self.over:
            raise ScheduleError("this replay was stopped by its Cutoff (it holds only part of a walk)")
        return [(e[0], e[1]) for e in self._walk.trace[rank]]


class _Rejoin:
    """Where a replay is back on the old walk, so that it may take the old walk's rest instead of walking it.

    The rest of a walk is a function of its state alone: each rank's position, clock and memory
    counters, and the time of every signal made so far. Once every rank is where the old walk was
    at the same position (the changed rank past its changed items; a peak may be higher), and every
    signal made at another time than before has been waited for by all its consumers on other
    ranks, the rest is the old walk's rest: ``fill`` copies it. (A consumer on the producer's own
    rank runs after it, so the rank's clock already bounds it.) Exact, so results are unchanged;
    what changes is how much is walked: after an accepted annealing move about a quarter of what
    the walk from the change would.

    ``floors`` bounds every rank's end from below once the changed rank is past its changed items:
    only the changed rank's order differs, so an op can start earlier than before by at most the
    most any changed op (or the clock after them) ended earlier; every rank ends no earlier than its
    old end minus that.
    """

    def __init__(self, old: _Walk, walk: _Walk, rank: int, lo: int, hi: int, shift: int, keep: list[int]) -> None:
        self.old, self.walk, self.rank, self.lo, self.hi, self.keep = old, walk, rank, lo, hi, keep
        self.shift = shift  # old index - new index after the change
        self.consumers = _cross_consumers(walk)
        self.taken = 0  # items copied from the old walk
        self.view = (walk.state, old.trace, rank, hi, self.shift)  # what ``matches`` reads, bound once

    def matches(self, q: int) -> bool:
        """True if rank ``q`` is where the old walk was at the same point of its order."""
        state, old_trace, rank, hi, shift = self.view
        st = state[q]
        p = st[0]
        if q == rank:
            if p <= hi:
                return False
            j = p - 1 + shift
        else:
            j = p - 1
        if j < 0:  # nothing run yet: where every walk starts
            return True
        e = old_trace[q][j]
        return e[1] == st[1] and e[2] == st[2] and st[3] >= e[3]

    def settled(self) -> bool:
        """True if every signal made at a new time has been waited for by all its consumers on other ranks."""
        walk = self.walk
        consumers, made_at, t0 = self.consumers, walk.made_at, walk.t0
        if consumers is None:
            return False
        left = []
        for k in walk.moved:
            for c in consumers[k]:
                if made_at[c] >= t0:  # that consumer has not run (again) yet
                    left.append(k)
                    break
        walk.moved[:] = left  # in place: the walk's loop holds the list
        return not left

    def fill(self) -> None:
        """Take the old walk's rest: every rank's remaining items with their old times and signals.

        The signals those items make still hold their old times (this walk made none of them), and
        ``made_at`` their old starts; the items this walk ran get theirs (``_Walk.mark_made``).
        """
        walk, old_trace = self.walk, self.old.trace
        walk.mark_made(self.keep)
        for q, st in enumerate(walk.state):
            p = st[0]
            j = p + (self.shift if q == self.rank else 0)
            tail = old_trace[q][j:]
            if not tail:
                continue
            if q == self.rank:  # busy differs by the changed items' cost, the peak may be higher
                extra, top = st[4] - (old_trace[q][j - 1][4] if j else 0.0), st[3]
                tail = [(a, b, n, k if k > top else top, u + extra, m1, m2) for a, b, n, k, u, m1, m2 in tail]
            walk.trace[q].extend(tail)
            self.taken += len(tail)
            last = tail[-1]
            st[:] = p + len(tail), *last[1:5]
            if walk.first[q] is None:
                walk.first[q] = old_trace[q][0][0]

    def floors(self) -> list[float] | None:
        """Per rank, a lower bound of its end (see the class); None if an op changed its kind (BW split)."""
        rank, lo, hi, shift = self.rank, self.lo, self.hi, self.shift
        told, tnew = self.old.trace[rank], self.walk.trace[rank]
        was: dict = {}
        for item, e in zip(self.old.rank_ops[rank][lo:hi + shift + 1], told[lo:hi + shift + 1]):
            for op in (item if type(item) is FB else (item,)):
                was[op] = e[1]
        earlier = told[hi + shift][1] - tnew[hi][1] if hi >= 0 and hi + shift >= 0 else 0.0  # the clock after them
        for item, e in zip(self.walk.rank_ops[rank][lo:hi + 1], tnew[lo:hi + 1]):
            for op in (item if type(item) is FB else (item,)):
                d = was.get(op)
                if d is None:
                    return None
                if d - e[1] > earlier:
                    earlier = d - e[1]
        earlier = max(earlier, 0.0)
        return [st[1] - earlier for st in self.old.state]


def changed_span(old: Sequence, new: Sequence, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """The first and last index of ``new`` where it differs from ``old`` (same prefix and suffix kept).

    What ``Replay.changed`` needs of a changed rank, and what annealing passes it (``auto.local``).

    ``lo``/``hi``: ``new`` is known to keep ``old``'s items outside ``new[lo:hi + 1]`` (the scans start there).
    """
    n_old, n_new = len(old), len(new)
    # the scans compare identities in C (annealing calls this three times a step)
    lo = next(compress(count(lo), map(is_not, islice(old, lo, None), islice(new, lo, None))), min(n_old, n_new))
    hi_new = n_new - 1 if hi is None else hi
    hi_old = hi_new + n_old - n_new
    steps = min(hi_old, hi_new) - lo + 1
    if steps > 0:
        same = next(compress(count(), map(is_not, islice(reversed(old), n_old - 1 - hi_old, None),
                                          islice(reversed(new), n_new - 1 - hi_new, n_new - 1 - hi_new + steps))),
                    steps)
        hi_new -= same
    return lo, hi_new


_CONSUMERS: OrderedDict[int, tuple[dict, list[tuple[int, ...]] | None]] = OrderedDict()


def _cross_consumers(walk: _Walk) -> list[tuple[int, ...]] | None:
    """Per signal key, the keys made by the ops of other ranks that wait for it (one list per op table).

    ``_Rejoin`` needs to know when a signal made at a new time has been read by everyone it
    matters to; every op that waits for another rank's signal makes one itself (F and B do), so
    "it ran" is "its signal is made".
    """
    templates = walk.templates
    got = _CONSUMERS.get(id(templates))
    if got is not None and got[0] is templates:
        _CONSUMERS.move_to_end(id(templates))
        return got[1]
    cons: list[list[int]] = [[] for _ in walk.end_of]
    for r, ops in enumerate(walk.rank_ops):
        for item in ops:
            for kind, c, s, m in (item if type(item) is FB else (item,)):
                waits, made = templates[kind][c * walk.S + s][:2]
                for key, _, owner in waits:
                    if owner != r:
                        if made < 0:  # no way to tell when it ran: no replay of this table rejoins
                            _CONSUMERS[id(templates)] = (templates, None)
                            return None
                        cons[key + m + m].append(made + m + m)
    out = [tuple(x) for x in cons]
    _CONSUMERS[id(templates)] = (templates, out)
    if len(_CONSUMERS) > _TABLES_MAX:
        _CONSUMERS.popitem(last=False)
    return out


_START = itemgetter(0)  # a trace entry's start
_TABLES: OrderedDict[tuple, dict] = OrderedDict()
_TABLES_MAX = 64


def _compute_items(ops: list) -> list:
    """A rank's items without its communication batches (the walk times compute only)."""
    return [i for i in ops if type(i) is not CommBatch]


def _walk_table(placement: tuple, M: int, sc: StageCosts,
                scales: tuple[list[float], list[float]] | None = None) -> dict[str, list[tuple]]:
    """``OpTable.walk_table`` for (placement, M, costs, slot factors), reused across calls (a bounded LRU).

    The ``auto`` search simulates thousands of candidate orders on one placement and cost
    profile; the table is the same for all of them.
    """
    key = (placement, M, *(None if v is None else tuple(v) for v in (getattr(sc, f) for f in COST_FIELDS)),
           None if scales is None else (tuple(scales[0]), tuple(scales[1])))
    table = _TABLES.get(key)
    if table is None:
        table = OpTable(placement, M, sc).walk_table(sc.comm, scales)
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def _deadlock_message(rank_ops, pos, blocked_on, stuck, S: int, M: int) -> str:
    """Describe why ranks are stuck: a missing/late op on the same rank, or a cycle of ranks."""
    lines = []
    for r in stuck:
        i = pos[r]
        blocked = blocked_on.get(r)
        if blocked is None:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} is stuck")
            continue
        key, owner = blocked
        dep = signal_name(key, S, M)
        if owner == r:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep}, which rank {r} runs later or never")
            return "deadlock: " + lines[-1]
        lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep} on rank {owner}")
    # follow the wait-for edges from the first stuck rank to find a cycle
    nxt = {r: blocked_on[r][1] for r in stuck if r in blocked_on}
    seen: list[int] = []
    r = stuck[0]
    while r in nxt and r not in seen:
        seen.append(r)
        r = nxt[r]
    if r in seen:
        cycle = seen[seen.index(r):] + [r]
        head = "deadlock: ranks wait in a cycle " + " -> ".join(str(x) for x in cycle)
    elif r not in nxt:
        head = f"deadlock: rank {r} finished without producing what others wait for"
    else:
        head = "deadlock"
    return head + "\n  " + "\n  ".join(lines)


def simulate(schedule_or_program: Schedule | Program, costs: Costs | None = None) -> SimResult:
    """Simulate a schedule or a lowered program (its compute ops) under ``costs``."""
    schedule = schedule_or_program
    if isinstance(schedule_or_program, Program):
        schedule = schedule_or_program.compute_schedule()
    try:
        return run_schedule(schedule, costs)
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        check_structure(schedule)  # names the malformed op
        raise ScheduleError(f"cannot simulate {schedule.name!r}: {exc}") from exc
