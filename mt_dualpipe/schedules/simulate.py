"""Discrete-event simulation of a schedule: makespan, bubbles, peak activations, timeline.

Every rank runs its ops in order; an op starts when its rank is free and every op it depends on
has finished (plus the point-to-point latency when that op ran on another rank). What an op
waits for, costs and holds comes from ``ops`` (the one definition of an op's meaning); this module
only walks. The same walk detects deadlocks, so ``validate`` reuses it. Activations are counted
as docs/schedules.md defines them: +1 when a stage's F starts, -1 when its W or BW finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._perf import gc_paused
from .costs import Costs
from .errors import ScheduleError
from .ir import FB, CommBatch, Program, Schedule
from .ops import OpTable
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

    Each op is first resolved by ``ops.OpTable`` into (signal keys it waits for, their ranks and
    stages, signal keys it makes, cost, activation effect): the dependency rule lives there, this
    loop only waits and counts. ``end[k]`` holds the time signal ``k`` became available (-1 while
    not made). A rank that meets an op whose input is not ready parks on that input
    (``waiters``) and is resumed when it is made, so the walk is linear in the number of ops.
    """
    costs = costs or Costs()
    P = schedule.num_ranks
    placement = schedule.placement
    if len({len(c) for c in placement}) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages to be simulated")
    S, M = len(placement[0]), schedule.num_microbatches
    sc = costs.per_stage(S)
    lat = sc.comm
    table = OpTable(placement, M, sc)
    templates = table.templates()
    rank_ops = [[i for i in ops if type(i) is not CommBatch] for ops in schedule.ranks]
    for r, ops in enumerate(rank_ops):
        for i, item in enumerate(ops):
            if type(item) is not FB and item.kind not in templates:
                raise ScheduleError(f"rank {r} op {i}: unknown op kind {item.kind!r}; allowed F, B, W, BW, FB")

    end_of = [-1.0] * (2 * len(placement) * S * M)
    waiters: dict[int, list[int]] = {}  # signal key -> parked ranks
    pos = [0] * P
    now = [0.0] * P
    first: list[float | None] = [None] * P
    busy = [0.0] * P
    live = [0] * P
    peak = [0] * P
    events: list[TimelineEvent] = []
    blocked_on: dict[int, tuple[int, int]] = {}  # rank -> (signal key, producing rank)

    fb_cost = sc.fb_cost

    def ready(waits: tuple, off: int, r: int) -> float:
        """Earliest start the inputs allow, or -1 after parking rank ``r`` on the first missing one."""
        t = 0.0
        for key, owner, st in waits:
            v = end_of[key + off]
            if v < 0:
                waiters.setdefault(key + off, []).append(r)
                blocked_on[r] = (key + off, owner)
                return -1.0
            if owner != r:
                v += lat[st]
            if v > t:
                t = v
        return t

    def make(key: int, end: float) -> None:
        end_of[key] = end
        w = waiters.pop(key, None)
        if w:
            stack.extend(w)

    stack = list(range(P))
    while stack:
        r = stack.pop()
        ops = rank_ops[r]
        i = pos[r]
        nops = len(ops)
        blocked_on.pop(r, None)
        t_now = now[r]
        n_live = live[r]
        n_peak = peak[r]
        while i < nops:
            item = ops[i]
            if type(item) is FB:
                # an FB unit: both parts' inputs, one cost, both parts' signals at its end
                (fk, fc, fs, fm), (bk, bc, bs, bm) = item
                wf, mf, _, hf, ff = templates[fk][fc * S + fs]
                wb, mb_, _, hb, fbb = templates[bk][bc * S + bs]
                t1 = ready(wf, fm + fm, r)
                if t1 < 0:
                    break
                t = ready(wb, bm + bm, r)
                if t < 0:
                    break
                if t1 > t:
                    t = t1
                start = t_now if t_now > t else t
                dur = fb_cost(fs, bk, bs)
                end = start + dur
                n_live += hf + hb
                if n_live > n_peak:
                    n_peak = n_live
                n_live -= ff + fbb
                for key in mf:
                    make(key + fm + fm, end)
                for key in mb_:
                    make(key + bm + bm, end)
                if record:
                    events.append(TimelineEvent(r, "FB", fc, fs, fm, start, end, (bk, bc, bs, bm)))
            else:
                kind, c, s, m = item
                waits, made, dur, holds, frees = templates[kind][c * S + s]
                off = m + m
                t = 0.0
                for key, owner, st in waits:  # the inputs' finish times, inlined (the compiler's hot path)
                    v = end_of[key + off]
                    if v < 0:
                        waiters.setdefault(key + off, []).append(r)
                        blocked_on[r] = (key + off, owner)
                        t = -1.0
                        break
                    if owner != r:
                        v += lat[st]
                    if v > t:
                        t = v
                if t < 0:  # parked on a missing input
                    break
                start = t_now if t_now > t else t
                end = start + dur
                if holds:
                    n_live += holds
                    if n_live > n_peak:
                        n_peak = n_live
                n_live -= frees
                for key in made:
                    end_of[key + off] = end
                    w = waiters.pop(key + off, None)
                    if w:
                        stack.extend(w)
                if record:
                    events.append(TimelineEvent(r, kind, c, s, m, start, end))
            if first[r] is None:
                first[r] = start
            if starts_out is not None:
                starts_out[r].append(start)
                ends_out[r].append(end)
            busy[r] += dur
            t_now = end
            i += 1
        pos[r] = i
        now[r] = t_now
        live[r] = n_live
        peak[r] = n_peak

    stuck = [r for r in range(P) if pos[r] < len(rank_ops[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(rank_ops, pos, blocked_on, stuck, S, M))

    makespan = max(now) if P else 0.0
    span = [(now[r] - first[r]) if first[r] is not None else 0.0 for r in range(P)]
    idle = [makespan - b for b in busy]
    return SimResult(
        name=schedule.name, num_ranks=P, num_microbatches=schedule.num_microbatches, makespan=makespan,
        busy=busy, makespan_bubble=idle, span_bubble=[sp - b for sp, b in zip(span, busy)],
        peak_activations=peak, bubble_rate=(sum(idle) / (P * makespan)) if makespan else 0.0,
        timeline=events, costs=costs, rank_end=list(now),
    )


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
        dep = _signal_name(key, S, M)
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


def _signal_name(key: int, S: int, M: int) -> str:
    """The op that makes signal ``key`` (``F(...)`` for an activation, ``B(...)`` for a gradient)."""
    u, bit = divmod(key, 2)
    cs, m = divmod(u, M)
    c, s = divmod(cs, S)
    return f"{'B' if bit else 'F'}(c{c},s{s},m{m})"


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
        from .validate import check_structure

        check_structure(schedule)  # names the malformed op
        raise ScheduleError(f"cannot simulate {schedule.name!r}: {exc}") from exc
