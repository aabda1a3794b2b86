"""Per-rank figures computed from a timeline alone (so measured runs get the same numbers).

The simulator already reports these for simulated runs (``SimResult``); a recorded run only has
its events, so the diagrams recompute makespan, idle time and peak activations from them using the
activation rule of ``schedules.ops`` (docs/schedules.md): +1 when a stage's F runs, -1 when its W
or BW finishes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..schedules.costs import Costs
from ..schedules.errors import ScheduleError
from ..schedules.ir import Op
from ..schedules.ops import RULES, OpKind, rule
from ..schedules.simulate import SimResult
from ..schedules.timeline import Timeline, TimelineEvent

COLLECTIVE_KINDS: tuple[str, ...] = tuple(k for k, r in RULES.items() if r.stream == "collective")
"""Op kinds posted to a rank's communication stream (``ops.RULES``: the data-parallel ``REDUCE_GRAD``).

They do not occupy the rank, but a step is not over before they are: they count in the makespan
and are drawn on a lane of their own under each rank."""


@dataclass(frozen=True)
class Summary:
    """What a diagram prints about one timeline."""

    name: str
    num_ranks: int
    num_microbatches: int
    makespan: float
    busy: list[float]
    bubble: list[float]  # makespan bubble per rank
    bubble_rate: float
    peak_activations: list[int]
    dp_exposed: list[float] = field(default_factory=list)  # per rank; empty when nothing reduces gradients

    @property
    def bubble_percent(self) -> list[float]:
        return [100.0 * b / self.makespan if self.makespan else 0.0 for b in self.bubble]

    @property
    def peak(self) -> int:
        return max(self.peak_activations, default=0)

    @property
    def exposed_dp_sync(self) -> float:
        """The most exposed rank's gradient-reduction time past its compute (0 without reductions)."""
        return max(self.dp_exposed, default=0.0)

    @classmethod
    def from_sim(cls, result: SimResult) -> Summary:
        reduces = any(e.op in COLLECTIVE_KINDS for e in result.timeline)
        return cls(result.name, result.num_ranks, result.num_microbatches, result.makespan, list(result.busy),
                   list(result.makespan_bubble), result.bubble_rate, list(result.peak_activations),
                   list(result.dp_exposed) if reduces else [])

    @classmethod
    def from_timeline(cls, timeline: Timeline) -> Summary:
        """The same figures as the simulator's, from the events: the makespan runs to the last
        compute op or gradient reduction; a rank's exposed sync is its reductions' end past its compute."""
        P = timeline.num_ranks
        per_rank = events_by_rank(timeline)
        makespan = step_span(timeline)
        busy = [sum(e.end - e.start for e in per_rank[r]) for r in range(P)]
        bubble = [makespan - b for b in busy]
        rate = idle_share(busy, makespan)
        reduces = collective_by_rank(timeline)
        exposed = [max(0.0, max((e.end for e in reduces[r]), default=0.0)
                       - max((e.end for e in per_rank[r]), default=0.0)) for r in range(P)] if any(reduces) else []
        return cls(timeline.name, P, timeline.num_microbatches, makespan, busy, bubble, rate,
                   [peak_activations(per_rank[r]) for r in range(P)], exposed)


def idle_share(busy: Sequence[float], span: float) -> float:
    """The share of the ranks' time over ``span`` that they sat idle, ``busy`` per rank: a bubble rate
    (0.0 for an empty span or no rank)."""
    return sum(span - b for b in busy) / (len(busy) * span) if span and busy else 0.0


def events_by_rank(timeline: Timeline, lane: str = "compute", collective: bool | None = None
                   ) -> list[list[TimelineEvent]]:
    """The events of ``lane`` grouped per rank, each list sorted by start time.

    ``collective`` keeps only the gradient reductions (True) or leaves them out (False)."""
    rows: list[list[TimelineEvent]] = [[] for _ in range(timeline.num_ranks)]
    for e in timeline.events:
        if e.lane == lane and (collective is None or (e.op in COLLECTIVE_KINDS) == collective):
            if not 0 <= e.rank < timeline.num_ranks:
                raise ScheduleError(f"timeline event {e} names rank {e.rank}, but num_ranks={timeline.num_ranks}")
            rows[e.rank].append(e)
    for row in rows:
        row.sort(key=lambda e: (e.start, e.end))
    return rows


def collective_by_rank(timeline: Timeline) -> list[list[TimelineEvent]]:
    """Each rank's gradient reductions (``COLLECTIVE_KINDS``, on the comm lane), by start time."""
    return events_by_rank(timeline, "comm", collective=True)


def step_span(timeline: Timeline) -> float:
    """A step's length: from the first compute op or reduction to the last one's end.

    ``Timeline.makespan`` counts compute only; a reduction that outlasts the compute ends the step
    later (the simulator's ``makespan`` does the same). Point-to-point comm events do not count."""
    ev = [e for e in timeline.events if e.lane == "compute" or e.op in COLLECTIVE_KINDS]
    return max(e.end for e in ev) - min(e.start for e in ev) if ev else 0.0


def event_ops(e: TimelineEvent) -> tuple[Op, ...]:
    """The plain ops of a compute event: itself, or an FB unit's forward and backward halves."""
    if e.pair is None:
        return (Op(e.op, e.chain, e.stage, e.mb),)
    return Op(OpKind.F, e.chain, e.stage, e.mb), Op(*e.pair)


def peak_activations(rank_events: list[TimelineEvent]) -> int:
    """Peak in-flight activations of one rank's compute events (sorted by start), counted with the
    activation rule of ``schedules.ops`` (what an op holds when it starts, frees when it ends)."""
    live = peak = 0
    for e in rank_events:
        kinds = [rule(op.kind) for op in event_ops(e)]
        live += sum(k.holds for k in kinds)
        peak = max(peak, live)
        live -= sum(k.frees for k in kinds)
    return peak


class StageSlots:
    """Which of its stages a rank runs an op on: slot 0 for the rank's first (chain, stage), 1 for
    its second, ... — read from the events alone, so measured runs get it too.

    A V schedule runs stage s and stage 2P-1-s of one chain on a rank, DualPipe one stage of each
    chain, interleaving v stages: the slot (with the stage number) is what tells them apart in a
    diagram, where the chain alone would not.
    """

    def __init__(self, timeline: Timeline) -> None:
        per_rank: dict[int, set[tuple[int, int]]] = defaultdict(set)
        for e in timeline.compute_events():
            for op in event_ops(e):
                per_rank[e.rank].add((op.chain, op.stage))
        self.slots = {(r, c, s): k for r, pairs in per_rank.items() for k, (c, s) in enumerate(sorted(pairs))}
        self.multi = any(len(pairs) > 1 for pairs in per_rank.values())
        """Whether some rank runs more than one stage (then diagrams label the stage in each op)."""

    def of(self, rank: int, chain: int, stage: int) -> int:
        return self.slots.get((rank, chain, stage), 0)

    def event(self, e: TimelineEvent) -> int:
        """The slot of an event (an FB unit: that of its forward half)."""
        return self.of(e.rank, e.chain, e.stage)

    def second(self, rank: int, op: Op) -> bool:
        """Whether ``op`` runs on one of the rank's later stages (drawn in the light tint)."""
        return self.of(rank, op.chain, op.stage) % 2 == 1


def start_time(timeline: Timeline) -> float:
    """Time origin of a drawing: the earliest start of any event (measured runs are not at 0)."""
    return min((e.start for e in timeline.events), default=0.0)


def costs_from_timeline(timeline: Timeline) -> Costs:
    """Mean measured duration of each op kind, as ``Costs`` to simulate the same schedule against.

    W is 0 when the run never split a backward (then BW's time goes to B); ``fb`` is the mean of FB
    units that pair an F with a full backward, when there are any.
    """
    durations: dict[str, list[float]] = defaultdict(list)
    for e in timeline.compute_events():
        key = OpKind.FB + e.pair[0] if e.pair is not None else e.op
        durations[key].append(e.end - e.start)

    def mean(key: str) -> float | None:
        vals = durations.get(key)
        return sum(vals) / len(vals) if vals else None

    f = mean(OpKind.F) or 0.0
    w = mean(OpKind.W) or 0.0
    b = mean(OpKind.B)
    if b is None:
        bw = mean(OpKind.BW)
        b = max(0.0, bw - w) if bw is not None else 0.0
    fb = mean(OpKind.FB + OpKind.BW)
    if fb is None and mean(OpKind.FB + OpKind.B) is not None:
        fb = mean(OpKind.FB + OpKind.B) + w
    return Costs(f, b, w, fb=fb)
