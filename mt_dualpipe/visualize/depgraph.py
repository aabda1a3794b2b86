"""Dependency graph of a small schedule: which op waits on which.

Ops sit on their rank's row at their simulated start time (uniform costs), or at their position
in the rank's list when the schedule cannot be simulated (a deadlock is exactly when this graph
helps). Arrows go from the op that produces a tensor to the op that waits for it: an activation
to the next stage's F, a gradient to the previous stage's B, the stage's own F to its B (saved
activations) and a B to its W. Arrows that cross ranks are drawn bold: those are the waits that
communication must satisfy.
"""

from __future__ import annotations

from pathlib import Path

from ..schedules.costs import Costs
from ..schedules.errors import ScheduleError
from ..schedules.ir import ComputeItem, Op, Schedule
from ..schedules.ops import Need, OpKind, Signal, makes, parts, producers
from ..schedules.simulate import simulate
from ._graphviz import quote, write_graph
from .style import colour, reduce_label

MAX_OPS = 600
UNIT_W = 42.0  # points per cost unit
ROW_H = 26.0
ROW_PITCH = 70.0
EDGE_STYLE = {
    "activation": 'color="#d9822b" penwidth=1.4',
    "gradient": 'color="#3d6fb6" penwidth=1.4',
    "saved": 'color="#9a9a9a" style=dashed',
    "weight": 'color="#5fa04e" style=dotted',
}


def _item_key(rank: int, item: ComputeItem) -> tuple:
    head = item.f if item.kind == OpKind.FB else item
    return (rank, item.kind, head.chain, head.stage, head.mb)


def _positions(schedule: Schedule) -> tuple[dict[tuple[int, int], tuple[float, float]], bool]:
    """(rank, index) -> (start, duration) from a uniform-cost simulation, or list positions."""
    try:
        events = simulate(schedule, Costs()).timeline
    except ScheduleError:
        return {(r, i): (float(i) * 1.5, 1.0) for r, i, _ in schedule.iter_ops()}, False
    at = {(e.rank, e.op, e.chain, e.stage, e.mb): (e.start, e.end - e.start) for e in events}
    return {(r, i): at[_item_key(r, item)] for r, i, item in schedule.iter_ops()}, True


def edge_kind(op: Op, need: Need) -> str:
    """How a diagram names one wait of ``op``: an activation from upstream, its own saved activation,
    a gradient from downstream, or the input-gradient a W needs from its own B."""
    same_stage = need.stage == op.stage
    if need.signal is Signal.ACT:
        return "saved" if same_stage else "activation"
    return "weight" if same_stage else "gradient"


def dependencies(schedule: Schedule) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """Every (producer (rank, index), consumer (rank, index), kind) pair of the schedule.

    What waits for what comes from ``schedules.ops`` (``makes``/``producers``), so the graph draws
    the same rule the simulator and the runtime follow.
    """
    where: dict[tuple, tuple[int, int]] = {}
    for r, i, item in schedule.iter_ops():
        for op in parts(item):
            made = makes(op)
            if made is not None:
                where[made] = (r, i)
    out = []
    for r, i, item in schedule.iter_ops():
        for op in parts(item):
            for need in producers(op, schedule.placement):
                src = where.get((need.signal, need.chain, need.stage, need.mb))
                if src is not None and src != (r, i):
                    out.append((src, (r, i), edge_kind(op, need)))
    return out


def _label(item: ComputeItem) -> str:
    if item.kind == OpKind.REDUCE_GRAD:  # once per stage: no micro-batch
        return reduce_label(item.stage)
    if item.kind == OpKind.FB:
        return f"{item.f.kind}{item.f.mb}+{item.b.kind}{item.b.mb}\ns{item.f.stage}/s{item.b.stage}"
    return f"{item.kind}{item.mb}\ns{item.stage}"


def dependency_source(schedule: Schedule, *, max_ops: int = MAX_OPS) -> str:
    """The DOT source of the dependency graph (pinned positions, drawn with ``neato -n2``)."""
    n = schedule.num_ops()
    if n > max_ops:
        raise ScheduleError(f"a dependency graph is drawn for small schedules (at most {max_ops} ops); "
                            f"{schedule.name} with P={schedule.num_ranks} M={schedule.num_microbatches} has {n}: "
                            "use fewer ranks or micro-batches (e.g. -p 4 -m 8)")
    pos, simulated = _positions(schedule)
    P = schedule.num_ranks
    height = 40 + P * ROW_PITCH
    how = "simulated start times, F=B=W=1" if simulated else "list order (the schedule cannot be simulated)"
    lines = ["digraph dependencies {",
             f'graph [pad=0.2 splines=true outputorder=edgesfirst label={quote(f"{schedule.name} P={P} M={schedule.num_microbatches}: producer -> waiting op; x = {how}")} labelloc=t fontname=Helvetica fontsize=12];',  # noqa: E501
             'node [shape=box style="filled,rounded" fixedsize=true fontname=Helvetica fontsize=8 penwidth=0.6];',
             "edge [arrowsize=0.5];"]
    for r in range(P):
        y = height - 20 - r * ROW_PITCH
        lines.append(f'rank{r} [shape=plaintext style="" width=0.6 height=0.3 label="rank {r}" fontsize=10 '
                     f'pos="-30,{y:.1f}!"];')
    local = [schedule.local_stages(r) for r in range(P)]
    for r, i, item in schedule.iter_ops():
        start, dur = pos[(r, i)]
        head = item.f if item.kind == OpKind.FB else item
        w = max(dur, 0.5) * UNIT_W - 4
        x = start * UNIT_W + 2 + w / 2
        y = height - 20 - r * ROW_PITCH
        slot = local[r].index((head.chain, head.stage))  # a rank's second stage is drawn in the light tint
        lines.append(f'op_r{r}_{i} [id="op_r{r}_{i}" class="op {item.kind} chain{head.chain}" '
                     f'fillcolor="{colour(item.kind, slot)}" label={quote(_label(item))} '
                     f'tooltip={quote(str(item))} width={w / 72:.4f} height={ROW_H / 72:.4f} pos="{x:.1f},{y:.1f}!"];')
    for (sr, si), (dr, di), kind in dependencies(schedule):
        bold = " penwidth=2.2" if sr != dr else ""
        lines.append(f'op_r{sr}_{si} -> op_r{dr}_{di} [class="dep {kind}{" cross-rank" if sr != dr else ""}" '
                     f'{EDGE_STYLE[kind]}{bold}];')
    lines.append("}")
    return "\n".join(lines)


def dependency_graph(schedule: Schedule, path: str | Path, *, max_ops: int = MAX_OPS) -> str:
    """Draw the dependency graph of ``schedule`` to ``path`` (.svg/.png/.pdf, or .dot); returns the path."""
    return write_graph(path, dependency_source(schedule, max_ops=max_ops), engine="neato", pinned=True)
