"""What a measured run's bubble is made of: per-stage costs, hop latency and runtime overhead.

A simulation driven by one average F/B/W for every stage predicts the wrong bubble whenever the
stages differ (a last stage that also carries the head, the MTP modules and the loss is several
times slower than a middle one). So the costs are read off the run's own timeline per stage and
per op kind, the point-to-point latency of one hop is read off the cross-rank dependencies the
run waited for, and the schedule is re-simulated with both. What then still separates the
measured bubble from the simulated one has two parts, which a replay of the run (every op with its
own measured duration) separates: ops of one stage and kind that took different times (the
simulation uses their mean), and ops that started later than their rank and inputs allowed (the
runtime between instructions: posting sends and receives, Python). A step whose gradient reductions
outlast its last op (DualPipe's mirrored stages all-reduce their gradients after their last backward; a
data-parallel bucket) ends later than its compute: that tail is a part of its own, measured from the
timeline's reduction events, not an overhead between ops. ``compare_bubble`` computes all of it and
``BubbleBreakdown.explain`` says it in one sentence.

Dependencies come from ``schedules.ops`` (``item_producers``, ``makes``); nothing here re-derives them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from ..schedules.costs import Costs
from ..schedules.ir import FB, Op, Schedule
from ..schedules.ops import OpKind, item_producers, makes, parts
from ..schedules.simulate import simulate
from ..schedules.timeline import Timeline, TimelineEvent
from .metrics import Summary, events_by_rank, idle_share


def event_item(e: TimelineEvent) -> Op | FB:
    """The schedule item a compute event ran (an FB unit for an event with a backward half)."""
    op = Op(OpKind(e.op) if e.pair is None else OpKind.F, e.chain, e.stage, e.mb)
    if e.pair is None:
        return op
    kind, chain, stage, mb = e.pair
    return FB(op, Op(OpKind(kind), chain, stage, mb))


def _fill(values: list[float | None], default: float = 0.0) -> list[float]:
    """Missing per-stage values take the mean of the present ones (``default`` when none is)."""
    present = [v for v in values if v is not None]
    mean = sum(present) / len(present) if present else default
    return [mean if v is None else v for v in values]


def stage_costs(timeline: Timeline, num_stages: int) -> Costs:
    """Mean measured duration of each op kind on each stage, as per-stage ``Costs``.

    Stages are indexed by their position in the chain (DualPipe's mirrored chains share them, as
    they share the module). A stage without W events has ``w = 0`` and its BW time in ``b``; ``fb``
    (indexed by the F half's stage) is the mean FB unit with a full backward, an FB with a plain B
    counted with its B stage's W added. A stage with no event of a kind takes the mean of the others.
    """
    lone: dict[tuple[OpKind, int], list[float]] = defaultdict(list)
    units: dict[int, list[tuple[float, OpKind, int]]] = defaultdict(list)
    for e in timeline.compute_events():
        if not 0 <= e.stage < num_stages:
            raise ValueError(f"timeline event {e} names stage {e.stage}, but the chain has {num_stages} stages")
        if e.pair is None:
            lone[OpKind(e.op), e.stage].append(e.duration)
        else:
            units[e.stage].append((e.duration, OpKind(e.pair[0]), e.pair[2]))

    def mean(kind: OpKind, s: int) -> float | None:
        vals = lone.get((kind, s))
        return sum(vals) / len(vals) if vals else None

    f = _fill([mean(OpKind.F, s) for s in range(num_stages)])
    # a stage that never ran a lone B keeps its whole backward in b (w = 0): nothing needs the split there
    w = _fill([mean(OpKind.W, s) if (OpKind.B, s) in lone else 0.0 for s in range(num_stages)])
    b_raw: list[float | None] = []
    for s in range(num_stages):
        b, bw = mean(OpKind.B, s), mean(OpKind.BW, s)
        b_raw.append(b if b is not None else (max(0.0, bw - w[s]) if bw is not None else None))
    b = _fill(b_raw)
    fb: list[float] | None = None
    if units:
        back = sum(b[s] + w[s] for s in range(num_stages)) / num_stages
        fb = []
        for s in range(num_stages):
            got = [d + (w[bs] if kind == OpKind.B else 0.0) for d, kind, bs in units.get(s, ())]
            fb.append(sum(got) / len(got) if got else f[s] + back)
    return Costs(f, b, w, fb=fb)


def _made_at(timeline: Timeline) -> dict[tuple, float]:
    """When each signal (an F's activation, a B's input-gradient) was made: its event's end."""
    made: dict[tuple, float] = {}
    for e in timeline.compute_events():
        for op in parts(event_item(e)):
            key = makes(op)
            if key is not None:
                made[key] = e.end
    return made


def _waits(timeline: Timeline, placement: Sequence[Sequence[int]]):
    """Per compute event: (rank, event, the time its rank became free, latest local input, latest remote input)."""
    made = _made_at(timeline)
    for rank, row in enumerate(events_by_rank(timeline)):
        free = 0.0
        for e in row:
            local = remote = None
            for need in item_producers(event_item(e), placement):
                t = made.get((need.signal, need.chain, need.stage, need.mb))
                if t is None:
                    continue
                if need.rank == rank:
                    local = t if local is None else max(local, t)
                else:
                    remote = t if remote is None else max(remote, t)
            yield rank, e, free, local, remote
            free = e.end


def hop_latency(timeline: Timeline, placement: Sequence[Sequence[int]]) -> float:
    """Median time from a remote input being made to the op that waited for it starting (seconds).

    Only ops whose rank sat idle for that input count: the input arrived after the rank was free
    and after every local input. 0.0 when no op ever waited on another rank.
    """
    samples = []
    for _, e, free, local, remote in _waits(timeline, placement):
        if remote is not None and remote >= free and (local is None or remote >= local) and e.start >= remote:
            samples.append(e.start - remote)
    return median(samples) if samples else 0.0


def replay_bubble(timeline: Timeline, placement: Sequence[Sequence[int]], latency: float) -> float:
    """Bubble rate of the run replayed with every op's own measured duration, each op starting as soon as
    its rank is free and its inputs are there (a remote one ``latency`` after it was made).

    Against the simulation from per-stage means this isolates the variance of op durations; against
    the measured run, the time ops started later than that (the runtime between instructions)."""
    events = sorted(timeline.compute_events(), key=lambda e: (e.start, e.rank))  # producers start first
    if not events:
        return 0.0
    made: dict[tuple, float] = {}
    free: dict[int, float] = defaultdict(float)
    busy: dict[int, float] = defaultdict(float)
    for e in events:
        item = event_item(e)
        start = free[e.rank]
        for need in item_producers(item, placement):
            t = made.get((need.signal, need.chain, need.stage, need.mb))
            if t is not None:
                start = max(start, t + (latency if need.rank != e.rank else 0.0))
        free[e.rank] = start + e.duration
        busy[e.rank] += e.duration
        for op in parts(item):
            key = makes(op)
            if key is not None:
                made[key] = free[e.rank]
    makespan = max(free.values())
    P = timeline.num_ranks
    return idle_share([busy[r] for r in range(P)], makespan)


@dataclass(frozen=True)
class BubbleBreakdown:
    """A measured bubble rate next to its simulations (all rates are fractions of rank time)."""

    measured: float          # up to the step's end: its last op or gradient reduction
    to_last_op: float        # measured up to the last compute op (a reductions' tail left out)
    compute_only: float      # simulated with per-stage, per-kind mean measured costs, no latency
    simulated: float         # the same plus the measured hop latency
    replayed: float          # every op with its own measured duration, plus the hop latency
    hop_latency: float       # seconds per hop
    costs: Costs             # per-stage costs, comm = hop_latency

    @property
    def communication(self) -> float:
        """Bubble the hop latency adds to the simulation."""
        return self.simulated - self.compute_only

    @property
    def variance(self) -> float:
        """Bubble from ops of one stage and kind taking different times (the simulation uses their mean)."""
        return self.replayed - self.simulated

    @property
    def reduction(self) -> float:
        """Bubble from gradient reductions that end after the last op: the step's tail."""
        return self.measured - self.to_last_op

    @property
    def overhead(self) -> float:
        """Bubble from ops starting later than their rank and inputs allowed: the runtime between ops."""
        return self.to_last_op - self.replayed

    def explain(self) -> str:
        """One sentence: the simulated rate, then what the rest of the measured bubble is (the four
        parts add up to measured − compute-only)."""
        pts = 100.0
        text = (f"simulated from per-stage costs {pts * self.compute_only:.1f} %, "
                f"{pts * self.simulated:.1f} % with the measured hop latency "
                f"{1e3 * self.hop_latency:.2f} ms; measured {pts * self.measured:.1f} %")
        parts = []
        if self.compute_only < 0.0005 and self.measured > 0.0005:
            parts.append("the schedule itself has no bubble at these costs")
        for value, what in ((self.communication, "communication (hop latency)"),
                            (self.variance, "op-time variance (the same op on the same stage taking different "
                                            "times)"),
                            (self.overhead, "runtime overhead between ops"),
                            (self.reduction, "gradient reductions after the last op")):
            if abs(value) > 0.0005:
                parts.append(f"{pts * value:+.1f} points {what}")
        return text + (": " + ", ".join(parts) if parts else "")

    def to_dict(self) -> dict:
        return {"measured": self.measured, "simulated": self.simulated, "simulated_compute_only": self.compute_only,
                "replayed": self.replayed, "hop_latency_s": self.hop_latency, "communication": self.communication,
                "op_time_variance": self.variance, "runtime_overhead": self.overhead,
                "gradient_reduction": self.reduction, "explanation": self.explain(),
                "stage_costs_s": {k: getattr(self.costs, k) for k in ("f", "b", "w", "fb")}}


def compare_bubble(timeline: Timeline, schedule: Schedule) -> BubbleBreakdown:
    """Measured bubble of ``timeline`` (a run of ``schedule``) against the schedule simulated with the
    run's own per-stage costs, without and with its hop latency, and the runtime overhead."""
    placement = schedule.placement
    costs = stage_costs(timeline, len(placement[0]))
    latency = hop_latency(timeline, placement)
    with_comm = Costs(costs.f, costs.b, costs.w, fb=costs.fb, comm=latency)
    summary = Summary.from_timeline(timeline)
    return BubbleBreakdown(
        measured=summary.bubble_rate,
        to_last_op=idle_share(summary.busy, timeline.makespan),  # Timeline.makespan: compute only, to the last op
        compute_only=simulate(schedule, costs).bubble_rate,
        simulated=simulate(schedule, with_comm).bubble_rate,
        replayed=replay_bubble(timeline, placement, latency),
        hop_latency=latency,
        costs=with_comm,
    )
