"""Measured timelines: gather every rank's recorded events to rank 0 as a ``Timeline``.

The executor records one ``TimelineEvent`` per compute instruction (wall-clock seconds, the same
record the simulator produces, an FB unit as one event with its backward half in ``pair``). Rank 0
shifts them so the step starts at 0 and returns a ``Timeline`` with ``source="measured"`` that every
diagram and the trace exporter can draw beside a simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..schedules.timeline import Timeline, TimelineEvent


def gather_timeline(events: Sequence[TimelineEvent], name: str, num_ranks: int, num_microbatches: int,
                    rank: int, group: Any, dst_global: int, meta: dict | None = None) -> Timeline | None:
    """Collect ``events`` of all ranks on the rank whose global rank is ``dst_global``; None elsewhere."""
    gathered: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst_global else None
    dist.gather_object(list(events), gathered, dst=dst_global, group=group)
    if gathered is None:
        return None
    return build_timeline([e for evs in gathered for e in evs], name, num_ranks, num_microbatches, meta)


def build_timeline(events: Sequence[TimelineEvent], name: str, num_ranks: int, num_microbatches: int,
                   meta: dict | None = None) -> Timeline:
    """Events of all ranks, shifted so that the earliest start is 0 and sorted by (rank, start)."""
    t0 = min((e.start for e in events), default=0.0)
    shifted = sorted((e._replace(start=e.start - t0, end=e.end - t0) for e in events),
                     key=lambda e: (e.rank, e.start))
    return Timeline(name, num_ranks, num_microbatches, shifted, "measured", dict(meta or {}, unit="s"))
