"""Timelines: what ran where and when, from the simulator or from a measured run.

The simulator and the runtime produce the same records, so every diagram can draw either.
A record is a plain ``TimelineEvent`` (a named tuple); an FB unit is one event whose F half is
in ``chain/stage/mb`` and whose backward half is in ``pair``. Communication events of measured
runs use ``lane="comm"`` and the comm op's kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import ScheduleError

TIMELINE_FORMAT = "mt-dualpipe.timeline/1"


class TimelineEvent(NamedTuple):
    rank: int
    op: str
    chain: int
    stage: int
    mb: int
    start: float
    end: float
    pair: tuple[str, int, int, int] | None = None  # (kind, chain, stage, mb) of an FB's backward half
    lane: str = "compute"

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        d = {"rank": self.rank, "op": self.op, "chain": self.chain, "stage": self.stage, "mb": self.mb,
             "start": self.start, "end": self.end, "lane": self.lane}
        if self.pair is not None:
            d["pair"] = {"op": self.pair[0], "chain": self.pair[1], "stage": self.pair[2], "mb": self.pair[3]}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TimelineEvent:
        pair = d.get("pair")
        return cls(int(d["rank"]), str(d["op"]), int(d["chain"]), int(d["stage"]), int(d["mb"]),
                   float(d["start"]), float(d["end"]),
                   None if pair is None else (str(pair["op"]), int(pair["chain"]), int(pair["stage"]), int(pair["mb"])),
                   str(d.get("lane", "compute")))


@dataclass
class Timeline:
    """A list of events plus what they are of (schedule name, P, M, and where they came from)."""

    name: str
    num_ranks: int
    num_microbatches: int
    events: list[TimelineEvent]
    source: str = "simulated"  # or "measured"
    meta: dict = field(default_factory=dict)

    def compute_events(self) -> list[TimelineEvent]:
        return [e for e in self.events if e.lane == "compute"]

    @property
    def makespan(self) -> float:
        ev = self.compute_events()
        if not ev:
            return 0.0
        return max(e.end for e in ev) - min(e.start for e in ev)

    def to_dict(self) -> dict:
        return {"format": TIMELINE_FORMAT, "name": self.name, "num_ranks": self.num_ranks,
                "num_microbatches": self.num_microbatches, "source": self.source, "meta": self.meta,
                "events": [e.to_dict() for e in self.events]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"timeline is not valid JSON: {exc}") from exc
        if data.get("format") != TIMELINE_FORMAT:
            raise ScheduleError(f"timeline format must be {TIMELINE_FORMAT!r}, got {data.get('format')!r}")
        return cls(data["name"], int(data["num_ranks"]), int(data["num_microbatches"]),
                   [TimelineEvent.from_dict(e) for e in data["events"]], data.get("source", "measured"),
                   data.get("meta", {}))
