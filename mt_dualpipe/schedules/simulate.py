"""Discrete-event simulation of a schedule: makespan, bubbles, peak activations, timeline.

Every rank runs its ops in order; an op starts when its rank is free and every op it depends on
has finished (plus the point-to-point latency when that op ran on another rank). The same walk
detects deadlocks, so ``validate`` reuses it. Activations are counted as in SCHEDULES.md: +1 when
a stage's F starts, -1 when its W or BW finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._perf import gc_paused
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


@gc_paused
def run_schedule(schedule: Schedule, costs: Costs | None = None, record: bool = True,
                 starts_out: list[list[float]] | None = None, ends_out: list[list[float]] | None = None) -> SimResult:
    """Simulate ``schedule`` (compute ops only) under ``costs``; raise ScheduleError on deadlock.

    ``record`` keeps the timeline; ``starts_out``/``ends_out`` (one list per rank) receive each
    op's start and end in program order — what lowering needs, without building events.

    Ops are numbered ``u = (chain * S + stage) * M + mb``; ``f_end[u]``/``b_end[u]`` hold the
    finish time of F / of B-or-BW (-1 while not run). A rank that meets an op whose input is not
    ready parks on that input (``waiters``) and is resumed when it is produced, so the walk is
    linear in the number of ops.
    """
    costs = costs or Costs()
    P = schedule.num_ranks
    placement = schedule.placement
    if len({len(c) for c in placement}) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages to be simulated")
    S, M = len(placement[0]), schedule.num_microbatches
    sc = costs.per_stage(S)
    cf, cb, cw, ca2f, ca2b, lat = sc.f, sc.b, sc.w, sc.a2a_f, sc.a2a_b, sc.comm
    fb_cost = sc.fb_cost
    rank_of = [r for chain in placement for r in chain]  # by c * S + s

    n = len(placement) * S * M
    f_end = [-1.0] * n
    b_end = [-1.0] * n
    waiters: dict[int, list[int]] = {}  # u (an F) or n + u (a B) -> parked ranks
    rank_ops = [[i for i in ops if type(i) is not CommBatch] for ops in schedule.ranks]
    pos = [0] * P
    now = [0.0] * P
    first: list[float | None] = [None] * P
    busy = [0.0] * P
    live = [0] * P
    peak = [0] * P
    events: list[TimelineEvent] = []
    blocked_on: dict[int, tuple[Op, str, int]] = {}

    def ready(op: Op, r: int) -> float:
        """Earliest start allowed by ``op``'s inputs, or -1 after parking rank ``r`` on the missing one."""
        kind, c, s, m = op
        cs = c * S + s
        u = cs * M + m
        if kind == "F":
            if not s:
                return 0.0
            v = f_end[u - M]
            if v < 0:
                return park(u - M, r, op, "F", rank_of[cs - 1])
            return v + lat[s - 1] if rank_of[cs - 1] != r else v
        if kind == "W":
            v = b_end[u]
            return v if v >= 0 else park(n + u, r, op, "B", r)
        t = f_end[u]
        if t < 0:
            return park(u, r, op, "F", r)
        if s + 1 < S:
            v = b_end[u + M]
            if v < 0:
                return park(n + u + M, r, op, "B", rank_of[cs + 1])
            if rank_of[cs + 1] != r:
                v += lat[s + 1]
            if v > t:
                t = v
        return t

    def park(key: int, r: int, op: Op, what: str, owner: int) -> float:
        waiters.setdefault(key, []).append(r)
        blocked_on[r] = (op, what, owner)
        return -1.0

    def produced(op: Op, end: float) -> None:
        kind, c, s, m = op
        u = (c * S + s) * M + m
        if kind == "F":
            f_end[u] = end
            w = waiters.pop(u, None)
        elif kind == "W":
            return
        else:
            b_end[u] = end
            w = waiters.pop(n + u, None)
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
        while i < nops:
            item = ops[i]
            if type(item) is FB:
                f, b = item.f, item.b
                t1 = ready(f, r)
                if t1 < 0:
                    break
                t2 = ready(b, r)
                if t2 < 0:
                    break
                start = max(t_now, t1, t2)
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
                produced(f, end)
                produced(b, end)
            else:
                kind, c, s, m = item
                cs = c * S + s
                u = cs * M + m
                # the inputs' finish times, inlined (this loop is the compiler's hot path)
                if kind == "F":
                    if s:
                        t = f_end[u - M]
                        if t < 0:
                            park(u - M, r, item, "F", rank_of[cs - 1])
                            break
                        if rank_of[cs - 1] != r:
                            t += lat[s - 1]
                    else:
                        t = 0.0
                elif kind == "W":
                    t = b_end[u]
                    if t < 0:
                        park(n + u, r, item, "B", r)
                        break
                else:
                    t = f_end[u]
                    if t < 0:
                        park(u, r, item, "F", r)
                        break
                    if s + 1 < S:
                        v = b_end[u + M]
                        if v < 0:
                            park(n + u + M, r, item, "B", rank_of[cs + 1])
                            break
                        if rank_of[cs + 1] != r:
                            v += lat[s + 1]
                        if v > t:
                            t = v
                start = t_now if t_now > t else t
                if kind == "F":
                    dur = cf[s] + ca2f[s]
                    live[r] += 1
                    if live[r] > peak[r]:
                        peak[r] = live[r]
                    end = start + dur
                    f_end[u] = end
                    w = waiters.pop(u, None)
                    if w:
                        stack.extend(w)
                elif kind == "W":
                    dur = cw[s]
                    live[r] -= 1
                    end = start + dur
                else:
                    if kind == "B":
                        dur = cb[s] + ca2b[s]
                    elif kind == "BW":
                        dur = cb[s] + cw[s] + ca2b[s]
                        live[r] -= 1
                    else:
                        raise ScheduleError(f"rank {r} op {i}: unknown op kind {kind!r}; allowed F, B, W, BW, FB")
                    end = start + dur
                    b_end[u] = end
                    w = waiters.pop(n + u, None)
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

    stuck = [r for r in range(P) if pos[r] < len(rank_ops[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(rank_ops, pos, blocked_on, stuck))

    makespan = max(now) if P else 0.0
    span = [(now[r] - first[r]) if first[r] is not None else 0.0 for r in range(P)]
    idle = [makespan - b for b in busy]
    return SimResult(
        name=schedule.name, num_ranks=P, num_microbatches=schedule.num_microbatches, makespan=makespan,
        busy=busy, makespan_bubble=idle, span_bubble=[sp - b for sp, b in zip(span, busy)],
        peak_activations=peak, bubble_rate=(sum(idle) / (P * makespan)) if makespan else 0.0,
        timeline=events, costs=costs,
    )


def _deadlock_message(rank_ops, pos, blocked_on, stuck) -> str:
    """Describe why ranks are stuck: a missing/late op on the same rank, or a cycle of ranks."""
    lines = []
    for r in stuck:
        i = pos[r]
        key_op = blocked_on.get(r)
        if key_op is None:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} is stuck")
            continue
        op, what, owner = key_op
        dep = _dep_name(op, what)
        if owner == r:
            lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep}, which rank {r} runs later or never")
            return "deadlock: " + lines[-1]
        lines.append(f"rank {r} op {i} {rank_ops[r][i]} waits for {dep} on rank {owner}")
    # follow the wait-for edges from the first stuck rank to find a cycle
    nxt = {r: blocked_on[r][2] for r in stuck if r in blocked_on}
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
        schedule = schedule_or_program.compute_schedule()
    try:
        return run_schedule(schedule, costs)
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        from .validate import _check_structure

        _check_structure(schedule)  # names the malformed op
        raise ScheduleError(f"cannot simulate {schedule.name!r}: {exc}") from exc
