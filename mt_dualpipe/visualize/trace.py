"""Chrome trace / Perfetto JSON: a process per rank, a slice per op, flow arrows between ranks.

Open the file in ui.perfetto.dev or chrome://tracing. Thread 0 of each rank's process holds the
compute ops (an FB unit is one slice), thread 1 the communication ops of measured runs. Every
cross-rank dependency (an F feeding the next stage's F, a B feeding the previous stage's B) is a
flow arrow. Trace times are microseconds: measured timelines (seconds) are converted exactly;
simulated ones, in cost units, use 1 unit = 1 ms, so ``ts = (start - t0) * 1000`` (unless their
``meta["time_unit"]`` is "s": a simulation run with costs measured in seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..schedules.timeline import Timeline, TimelineEvent
from .metrics import start_time
from .style import cell_label, describe

US_PER_SECOND = 1e6
US_PER_UNIT = 1e3  # simulated cost units are drawn as milliseconds
COMPUTE_TID, COMM_TID = 0, 1


def time_scale(timeline: Timeline) -> float:
    """Microseconds per timeline time unit: seconds for measured runs (or ``meta["time_unit"] == "s"``)."""
    seconds = timeline.source == "measured" or timeline.meta.get("time_unit") == "s"
    return US_PER_SECOND if seconds else US_PER_UNIT


def _producers(events: list[TimelineEvent]) -> dict[tuple[str, int, int, int], int]:
    """(F|B, chain, stage, mb) -> index of the event that produces that tensor."""
    out: dict[tuple[str, int, int, int], int] = {}
    for i, e in enumerate(events):
        if e.op in ("F", "FB"):
            out[("F", e.chain, e.stage, e.mb)] = i
        back = e.pair if e.pair is not None else (e.op, e.chain, e.stage, e.mb)
        if back[0] in ("B", "BW"):
            out[("B", back[1], back[2], back[3])] = i
    return out


def _needs(e: TimelineEvent) -> list[tuple[str, int, int, int]]:
    """The cross-stage inputs of an event: the previous stage's F, the next stage's B."""
    parts = [(e.op if e.pair is None else "F", e.chain, e.stage, e.mb)]
    if e.pair is not None:
        parts.append(e.pair)
    needs = []
    for kind, c, s, m in parts:
        if kind == "F" and s > 0:
            needs.append(("F", c, s - 1, m))
        elif kind in ("B", "BW"):
            needs.append(("B", c, s + 1, m))
    return needs


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
        name = f"{e.op} {cell_label(e)}" if e.lane == "compute" else f"{e.op} m{e.mb}"
        out.append({"name": name, "cat": e.op, "ph": "X", "pid": pid_base + e.rank,
                    "tid": COMPUTE_TID if e.lane == "compute" else COMM_TID,
                    "ts": (e.start - t0) * scale, "dur": (e.end - e.start) * scale,
                    "args": dict(args, op=describe(e))})
    producers = _producers(compute)
    flow = flow_base
    for e in compute:
        for need in _needs(e):
            i = producers.get(need)
            if i is None or compute[i].rank == e.rank:
                continue
            src = compute[i]
            src_ts, src_dur = (src.start - t0) * scale, (src.end - src.start) * scale
            dst_ts, dst_dur = (e.start - t0) * scale, (e.end - e.start) * scale
            common = {"name": f"{need[0]} c{need[1]} s{need[2]} m{need[3]}", "cat": "dependency", "id": flow}
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
