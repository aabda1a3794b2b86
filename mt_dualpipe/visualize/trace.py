"""Chrome trace / Perfetto JSON: a process per rank, a slice per op, flow arrows between ranks.

Open the file in ui.perfetto.dev or chrome://tracing. Thread 0 of each rank's process holds the
compute ops (an FB unit is one slice), thread 1 the communication ops of measured runs and the
data-parallel gradient reductions (``REDUCE_GRAD R/s3``, one slice per stage reduced). Every
dependency between ranks (what ``schedules.ops`` says an op waits for, made on another rank) is a
flow arrow. Trace times are microseconds: measured timelines (seconds) are converted exactly;
simulated ones, in cost units, use 1 unit = 1 ms, so ``ts = (start - t0) * 1000`` (unless their
``meta["time_unit"]`` is "s": a simulation run with costs measured in seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..schedules.ops import makes, needs
from ..schedules.timeline import Timeline, TimelineEvent
from .metrics import COLLECTIVE_KINDS, event_ops, start_time
from .style import cell_label, describe

US_PER_SECOND = 1e6
US_PER_UNIT = 1e3  # simulated cost units are drawn as milliseconds
COMPUTE_TID, COMM_TID = 0, 1


def time_scale(timeline: Timeline) -> float:
    """Microseconds per timeline time unit: seconds for measured runs (or ``meta["time_unit"] == "s"``)."""
    seconds = timeline.source == "measured" or timeline.meta.get("time_unit") == "s"
    return US_PER_SECOND if seconds else US_PER_UNIT


def num_stages(events: list[TimelineEvent]) -> int:
    """Stages per chain of the schedule a timeline ran: one past the highest stage any op ran."""
    return 1 + max((op.stage for e in events for op in event_ops(e)), default=-1)


def _producers(events: list[TimelineEvent]) -> dict[tuple, int]:
    """(signal, chain, stage, mb) -> index of the event that makes that signal (``ops.makes``)."""
    out: dict[tuple, int] = {}
    for i, e in enumerate(events):
        for op in event_ops(e):
            made = makes(op)
            if made is not None:
                out[made] = i
    return out


def _needs(e: TimelineEvent, stages: int) -> list[tuple]:
    """The signals an event waits for (``ops.needs``); the flows keep those made on another rank."""
    return [need for op in event_ops(e) for need in needs(op, stages)]


def trace_events(timeline: Timeline, *, pid_base: int = 0, label: str | None = None,
                 flow_base: int = 0) -> list[dict]:
    """The trace events of one timeline, its ranks as processes ``pid_base + rank``."""
    scale = time_scale(timeline)
    t0 = start_time(timeline)
    prefix = f"{label} / " if label else ""
    out: list[dict] = []
    for r in range(timeline.num_ranks):
        pid = pid_base + r
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{prefix}rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID, "args": {"name": "comm"}})
    compute = timeline.compute_events()
    for e in timeline.events:
        args = {"chain": e.chain, "stage": e.stage, "mb": e.mb}
        if e.pair is not None:
            args["pair"] = {"op": e.pair[0], "chain": e.pair[1], "stage": e.pair[2], "mb": e.pair[3]}
        name = f"{e.op} {cell_label(e)}" if e.lane == "compute" or e.op in COLLECTIVE_KINDS else f"{e.op} m{e.mb}"
        out.append({"name": name, "cat": e.op, "ph": "X", "pid": pid_base + e.rank,
                    "tid": COMPUTE_TID if e.lane == "compute" else COMM_TID,
                    "ts": (e.start - t0) * scale, "dur": (e.end - e.start) * scale,
                    "args": dict(args, op=describe(e))})
    producers = _producers(compute)
    stages = num_stages(compute)
    flow = flow_base
    for e in compute:
        for need in _needs(e, stages):
            i = producers.get(need)
            if i is None or compute[i].rank == e.rank:
                continue
            src = compute[i]
            src_ts, src_dur = (src.start - t0) * scale, (src.end - src.start) * scale
            dst_ts, dst_dur = (e.start - t0) * scale, (e.end - e.start) * scale
            common = {"name": f"{need[0].value} c{need[1]} s{need[2]} m{need[3]}", "cat": "dependency", "id": flow}
            out.append(dict(common, ph="s", pid=pid_base + src.rank, tid=COMPUTE_TID, ts=src_ts + 0.9 * src_dur))
            out.append(dict(common, ph="f", bp="e", pid=pid_base + e.rank, tid=COMPUTE_TID,
                            ts=dst_ts + 0.1 * dst_dur))
            flow += 1
    return out


def chrome_trace(timelines: list[tuple[str | None, Timeline]]) -> dict:
    """A trace of one or more timelines (labelled when several), each rank a process."""
    events: list[dict] = []
    pid = 0
    for label, tl in timelines:
        flows = sum(1 for e in events if e.get("ph") == "s")
        events.extend(trace_events(tl, pid_base=pid, label=label, flow_base=flows))
        pid += tl.num_ranks
    units = {lbl or tl.name: ("seconds" if time_scale(tl) == US_PER_SECOND else "cost units (1 unit = 1 ms)")
             for lbl, tl in timelines}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "mt_dualpipe.visualize", "time_units": units}}


def write_trace(path: str | Path, timelines: list[tuple[str | None, Timeline]]) -> str:
    Path(path).write_text(json.dumps(chrome_trace(timelines)), encoding="utf-8")
    return str(path)
