"""Discrete-event simulation of a schedule: makespan, bubbles, peak activations, timeline.

Every rank runs its ops in order; an op starts when its rank is free and every op it depends on
has finished (plus the point-to-point latency when that op ran on another rank). The same walk
detects deadlocks, so ``validate`` reuses it. Activations are counted as in SCHEDULES.md: +1 when
a stage's F starts, -1 when its W or BW finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import Costs
from .errors import ScheduleError
from .ir import FB, CommBatch, Op, Program, Schedule
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


def _key_base(schedule: Schedule) -> tuple[int, int]:
    return max(len(c) for c in schedule.placement), schedule.num_microbatches


def run_schedule(schedule: Schedule, costs: Costs | None = None, record: bool = True) -> SimResult:
    """Simulate ``schedule`` (compute ops only) under ``costs``; raise ScheduleError on deadlock."""
    costs = costs or Costs()
    P = schedule.num_ranks
    S, M = _key_base(schedule)
    placement = schedule.placement
    lengths = {len(c) for c in placement}
    if len(lengths) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages to be simulated")
    sc = costs.per_stage(S)
    cf, cb, cw, ca2f, ca2b, lat = sc.f, sc.b, sc.w, sc.a2a_f, sc.a2a_b, sc.comm
    fb_cost = sc.fb_cost

    f_end: dict[int, float] = {}
    b_end: dict[int, float] = {}
    waiters: dict[int, list[int]] = {}
    rank_ops = [[i for i in ops if type(i) is not CommBatch] for ops in schedule.ranks]
    pos = [0] * P
    now = [0.0] * P
    first = [None] * P
    busy = [0.0] * P
    live = [0] * P
    peak = [0] * P
    events: list[TimelineEvent] = []
    blocked_on: dict[int, tuple[int, Op, str, int]] = {}

    def ready_time(op: Op, r: int) -> float | None:
        """Earliest start allowed by ``op``'s dependencies, or None (and a waiter) if not met."""
        c, s, m = op.chain, op.stage, op.mb
        base = (c * S + s) * M + m
        t = 0.0
        kind = op.kind
        if kind == "F":
            if s:
                k = base - M
                v = f_end.get(k)
                if v is None:
                    return _wait(k, r, op, "F", placement[c][s - 1])
                if placement[c][s - 1] != r:
                    v += lat[s - 1]
                t = v
        elif kind == "W":
            v = b_end.get(base)
            if v is None:
                return _wait(base + (1 << 60), r, op, "B", placement[c][s])
            t = v
        else:  # B or BW
            v = f_end.get(base)
            if v is None:
                return _wait(base, r, op, "F", placement[c][s])
            t = v
            if s + 1 < len(placement[c]):
                k = base + M
                v = b_end.get(k)
                if v is None:
                    return _wait(k + (1 << 60), r, op, "B", placement[c][s + 1])
                if placement[c][s + 1] != r:
                    v += lat[s + 1]
                if v > t:
                    t = v
        return t

    def _wait(key: int, r: int, op: Op, what: str, owner: int) -> None:
        waiters.setdefault(key, []).append(r)
        blocked_on[r] = (key, op, what, owner)
        return None

    def finish(op: Op, end: float, stack: list[int]) -> None:
        base = (op.chain * S + op.stage) * M + op.mb
        if op.kind == "F":
            f_end[base] = end
            w = waiters.pop(base, None)
        elif op.kind == "W":
            return
        else:
            b_end[base] = end
            w = waiters.pop(base + (1 << 60), None)
        if w:
            stack.extend(w)

    stack = list(range(P))
    while stack:
        r = stack.pop()
        ops = rank_ops[r]
        i = pos[r]
        n = len(ops)
        blocked_on.pop(r, None)
        while i < n:
            item = ops[i]
            if type(item) is FB:
                f, b = item.f, item.b
                t1 = ready_time(f, r)
                if t1 is None:
                    break
                t2 = ready_time(b, r)
                if t2 is None:
                    break
                start = max(now[r], t1, t2)
                dur = fb_cost(f.stage, b.kind, b.stage)
                end = start + dur
                live[r] += 1
                if live[r] > peak[r]:
                    peak[r] = live[r]
                if b.kind == "BW":
                    live[r] -= 1
                if record:
                    events.append(TimelineEvent(r, "FB", f.chain, f.stage, f.mb, start, end,
                                                (b.kind, b.chain, b.stage, b.mb)))
                finish(f, end, stack)
                finish(b, end, stack)
            else:
                t = ready_time(item, r)
                if t is None:
                    break
                start = now[r] if now[r] > t else t
                kind, s = item.kind, item.stage
                if kind == "F":
                    dur = cf[s] + ca2f[s]
                    live[r] += 1
                    if live[r] > peak[r]:
                        peak[r] = live[r]
                elif kind == "B":
                    dur = cb[s] + ca2b[s]
                elif kind == "W":
                    dur = cw[s]
                    live[r] -= 1
                elif kind == "BW":
                    dur = cb[s] + cw[s] + ca2b[s]
                    live[r] -= 1
                else:
                    raise ScheduleError(f"rank {r} op {i}: unknown op kind {kind!r}; allowed F, B, W, BW, FB")
                end = start + dur
                if record:
                    events.append(TimelineEvent(r, kind, item.chain, s, item.mb, start, end))
                finish(item, end, stack)
            if first[r] is None:
                first[r] = start
            busy[r] += dur
            now[r] = end
            i += 1
        pos[r] = i

    stuck = [r for r in range(P) if pos[r] < len(rank_ops[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(schedule, rank_ops, pos, blocked_on, stuck))

    makespan = max(now) if P else 0.0
    span = [(now[r] - first[r]) if first[r] is not None else 0.0 for r in range(P)]
    idle = [makespan - b for b in busy]
    return SimResult(
        name=schedule.name, num_ranks=P, num_microbatches=schedule.num_microbatches, makespan=makespan,
        busy=busy, makespan_bubble=idle, span_bubble=[sp - b for sp, b in zip(span, busy)],
        peak_activations=peak, bubble_rate=(sum(idle) / (P * makespan)) if makespan else 0.0,
        timeline=events, costs=costs,
    )


def _deadlock_message(schedule, rank_ops, pos, blocked_on, stuck) -> str:
    """Describe why ranks are stuck: a missing/late op on the same rank, or a cycle of ranks."""
    lines = []
    for r in stuck:
        i = pos[r]
        key_op = blocked_on.get(r)
        if key_op is None:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} is stuck")
            continue
        _, op, what, owner = key_op
        dep = _dep_name(op, what)
        if owner == r:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep}, which rank {r} runs later or never")
            return "deadlock: " + lines[-1]
        lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep} on rank {owner}")
    # follow the wait-for edges from the first stuck rank to find a cycle
    nxt = {r: blocked_on[r][3] for r in stuck if r in blocked_on}
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


def _dep_name(op: Op, what: str) -> str:
    if what == "F":
        s = op.stage - 1 if op.kind == "F" else op.stage
        return f"F(c{op.chain},s{s},m{op.mb})"
    s = op.stage if op.kind == "W" else op.stage + 1
    return f"B(c{op.chain},s{s},m{op.mb})"


def simulate(schedule_or_program: Schedule | Program, costs: Costs | None = None) -> SimResult:
    """Simulate a schedule or a lowered program (its compute ops) under ``costs``."""
    schedule = schedule_or_program
    if isinstance(schedule_or_program, Program):
        sched = schedule_or_program.schedule
        schedule = Schedule(sched.name, sched.num_ranks, sched.num_microbatches, sched.placement,
                            sched.microbatch_chain,
                            [schedule_or_program.compute_ops(r) for r in range(sched.num_ranks)], sched.meta)
    return run_schedule(schedule, costs)
