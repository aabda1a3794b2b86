"""To-scale pipeline diagrams (SVG/PNG) drawn with graphviz, in the spirit of the DualPipe figure.

Every op is one box whose width is proportional to its duration, placed at its start time on
its rank's row; the layout is computed here and graphviz only draws it (``neato -n2`` keeps the
given positions), so there is no layout pass and 200k ops draw in seconds. Each op's SVG group
has ``class="node op <kind> chain<c> stage<s> slot<k>"`` and ``id="op_r<rank>_<n>"``
(``op_p<k>_r<rank>_<n>`` in the k-th of several panels), so tools and tests can find exactly one
box per op. Several timelines (a comparison, or a measured run over its simulation) are stacked
as panels sharing one time scale.

When a rank runs more than one stage (V shapes, DualPipe, interleaving), an op on the rank's
second stage is drawn in a light tint of its kind's colour, and each box that is wide enough
says its stage under its micro-batch (``3`` over ``s5``): a V schedule's two F0 on rank 0 are
then told apart by colour and by text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from ..schedules.timeline import Timeline, TimelineEvent
from ._graphviz import quote, write_graph
from .metrics import StageSlots, Summary, collective_by_rank, events_by_rank, start_time, step_span
from .style import (
    COMM_COLOUR,
    KIND_NAMES,
    KINDS,
    REDUCE_COLOUR,
    REDUCE_NAME,
    SECOND_STAGE_NAME,
    cell_label,
    colour,
    describe,
    fmt_time,
    stage_label,
)

# sizes in points (1/72 inch)
MARGIN = 12.0
ROW_H = 16.0
ROW_H_STAGES = 22.0  # rows whose boxes also say their stage (a second text line)
ROW_GAP = 3.0
COMM_H = 5.0
REDUCE_H = 9.0  # the gradient-reduction lane: thinner than an op row, tall enough for "R/s3"
REDUCE_FONT = 6.0
LEFT_W = 44.0
RIGHT_W = 104.0
PANEL_GAP = 14.0
HEADER_H = 16.0
MIN_TIME_W = 640.0
MAX_TIME_W = 7200.0
TARGET_OP_W = 14.0  # a typical op gets about this many points, within the limits above
CELL_FONT = 7.0
CHAR_W = 0.6  # text width per character, as a fraction of the font size (Helvetica, generous)


@dataclass
class Panel:
    """One timeline drawn as rank rows, optionally under a header line."""

    timeline: Timeline
    summary: Summary
    header: str | None = None
    peak_scale: float = 1.0  # per-rank peaks are printed times this (a comparison's common unit)


def _text_w(text: str, size: float) -> float:
    return len(text) * size * CHAR_W + 2


class _Canvas:
    """Collects pinned nodes with top-down coordinates in points; ``source`` emits them for graphviz.

    Graphviz rounds node sizes to whole layout points, which would put a 2-point op off by 25 %.
    The source is therefore laid out ``ZOOM`` times larger and scaled back with the graph's
    ``size``: boxes stay to scale within 0.1 pt and the output keeps the size computed here.
    """

    ZOOM = 10

    def __init__(self) -> None:
        # (attributes, centre x, centre y from the top, width, height, font size or 0)
        self.nodes: list[tuple[str, float, float, float, float, float]] = []
        self.width = 0.0
        self.height = 0.0

    def box(self, x: float, y: float, w: float, h: float, attrs: str) -> None:
        """A box with top-left corner (x, y)."""
        w, h = max(w, 0.1), max(h, 0.1)
        self.nodes.append((attrs, x + w / 2, y + h / 2, w, h, 0.0))

    def text(self, x: float, y: float, text: str, size: float = 9.0, *, centre: bool = False,
             bold: bool = False, cls: str = "text") -> float:
        """A line of text with its left edge (or centre) at x and top at y; returns its width."""
        w, h = _text_w(text, size), size * 1.3
        cx = x if centre else x + w / 2
        font = ' fontname="Helvetica-Bold"' if bold else ""
        label = quote(text) if centre else quote(text)[:-1] + '\\l"'  # \l: left-justified in the node
        self.nodes.append((f'shape=plaintext style=""{font} class="{cls}" label={label}', cx, y + h / 2, w, h, size))
        return w

    @property
    def size(self) -> tuple[int, int]:
        """Drawing size in points (multiples of 3: whole pixels at 72 and 96 dpi)."""
        return math.ceil(max(self.width, 1.0) / 3) * 3, math.ceil(max(self.height, 1.0) / 3) * 3

    def source(self) -> str:
        W, H = self.size
        Z = self.ZOOM
        out = ["digraph pipeline {",
               f'graph [pad=0 outputorder=nodesfirst bgcolor=white size="{W / 72:.6f},{H / 72:.6f}!"];',
               f'node [shape=box style=filled fixedsize=true penwidth={0.4 * Z:g} color="#444444" '
               f'fontsize={CELL_FONT * Z:g} fontname=Helvetica margin=0 label=""];',
               'corner0 [shape=point style=invis width=0 height=0 pos="0,0!"];',
               f'corner1 [shape=point style=invis width=0 height=0 pos="{W * Z},{H * Z}!"];']
        for n, (attrs, x, y, w, h, font) in enumerate(self.nodes):
            fs = f" fontsize={font * Z:g}" if font else ""
            out.append(f'n{n} [{attrs}{fs} width={w * Z / 72:.5f} height={h * Z / 72:.5f} '
                       f'pos="{x * Z:.1f},{(H - y) * Z:.1f}!"];')
        out.append("}")
        return "\n".join(out)


def time_width(panels: list[Panel]) -> tuple[float, float]:
    """Points for the time axis and the shared time span: a typical op about ``TARGET_OP_W`` wide."""
    span = max((step_span(p.timeline) for p in panels), default=0.0)
    durs = [e.end - e.start for p in panels for e in p.timeline.compute_events() if e.end > e.start]
    typical = median(durs) if durs else 1.0
    width = TARGET_OP_W * span / typical if typical > 0 else MIN_TIME_W
    return min(MAX_TIME_W, max(MIN_TIME_W, width)), span


def _draw_panel(cv: _Canvas, panel: Panel, y: float, scale: float, right_x: float, ids: str = "") -> float:
    """Draw one panel's rows from ``y`` down, per-rank figures at ``right_x``; returns the y below it.

    Op boxes get ids ``op_<ids>r<rank>_<n>`` (``ids`` tells panels apart: "p1_" for the second).
    Under a rank's row come its measured point-to-point communication (``comm_...``) and its
    gradient reductions (``reduce_<ids>r<rank>_<n>``, one labelled box per stage reduced, on
    the same time scale), each on a lane of its own when the timeline has any.
    """
    tl = panel.timeline
    x0 = MARGIN + LEFT_W
    if panel.header:
        cv.text(MARGIN, y, panel.header, 10, bold=True, cls="panel-header")
        y += HEADER_H
    t0 = start_time(tl)
    rows = events_by_rank(tl)
    comm_rows = events_by_rank(tl, "comm", collective=False)
    reduce_rows = collective_by_rank(tl)
    slots = StageSlots(tl)
    row_h = ROW_H_STAGES if slots.multi else ROW_H
    pct = panel.summary.bubble_percent
    span = step_span(tl)
    for r in range(tl.num_ranks):
        cv.text(MARGIN + LEFT_W / 2, y + 1, f"rank {r}", 8, centre=True, cls="rank-label")
        cv.box(x0, y, span * scale, row_h, 'color="#e6e6e6" fillcolor="#f7f7f7" class="lane"')
        for i, e in enumerate(rows[r]):
            w = (e.end - e.start) * scale
            slot = slots.event(e)
            cv.box(x0 + (e.start - t0) * scale, y, w, row_h,
                   f'id="op_{ids}r{r}_{i}" class="op {e.op} chain{e.chain} stage{e.stage} slot{slot}" '
                   f'fillcolor="{colour(e.op, slot)}"{_box_label(e, w, slots.multi)} '
                   f'tooltip={quote(f"{describe(e)} {fmt_time(e.start - t0)}-{fmt_time(e.end - t0)}")}')
        right = f"idle {pct[r]:.1f}%  peak {panel.summary.peak_activations[r] * panel.peak_scale:g}"
        cv.text(right_x, y + 1, right, 8, cls="rank-metrics")
        y += row_h
        if any(comm_rows):
            for i, e in enumerate(comm_rows[r]):
                cv.box(x0 + (e.start - t0) * scale, y + 0.5, (e.end - e.start) * scale, COMM_H - 1,
                       f'id="comm_{ids}r{r}_{i}" class="comm {e.op}" fillcolor="{COMM_COLOUR}" color="{COMM_COLOUR}" '
                       f'tooltip={quote(f"{e.op} (c{e.chain},s{e.stage},m{e.mb})")}')
            y += COMM_H
        if any(reduce_rows):
            exposed = panel.summary.dp_exposed[r] if panel.summary.dp_exposed else 0.0
            _draw_reduce_lane(cv, reduce_rows[r], x0, y, t0, scale, f"{ids}r{r}")
            cv.text(right_x, y, f"dp sync exposed {fmt_time(exposed)}", REDUCE_FONT, cls="reduce-metrics")
            y += REDUCE_H
        y += ROW_GAP
    return y


def _draw_reduce_lane(cv: _Canvas, events: list[TimelineEvent], x0: float, y: float, t0: float, scale: float,
                      ids: str) -> None:
    """One rank's gradient reductions: a thin box per stage reduced, labelled ``R/s3`` where it fits."""
    for i, e in enumerate(events):
        w = (e.end - e.start) * scale
        text = cell_label(e)
        fits = _text_w(text, REDUCE_FONT) <= w
        label = f" label={quote(text)} fontsize={REDUCE_FONT * _Canvas.ZOOM:g}" if fits else ""
        cv.box(x0 + (e.start - t0) * scale, y + 0.5, w, REDUCE_H - 1,
               f'id="reduce_{ids}_{i}" class="reduce {e.op} chain{e.chain} stage{e.stage}" '
               f'fillcolor="{REDUCE_COLOUR}" color="{REDUCE_COLOUR}" fontcolor=white{label} '
               f'tooltip={quote(f"{describe(e)} {fmt_time(e.start - t0)}-{fmt_time(e.end - t0)}")}')


def _box_label(e: TimelineEvent, width: float, with_stage: bool) -> str:
    """The label attribute of an op box: micro-batch(es), over the stage(s) when asked and it fits."""
    mbs = cell_label(e)
    if with_stage:
        stages = stage_label(e)
        if max(_text_w(mbs, CELL_FONT), _text_w(stages, CELL_FONT)) <= width:
            return f" label={quote(mbs + chr(10) + stages)}"
    return f' label="{mbs}"' if _text_w(mbs, CELL_FONT) <= width else ""


def _draw_axis(cv: _Canvas, y: float, span: float, scale: float) -> float:
    if span <= 0:
        return y
    step = 10 ** math.floor(math.log10(span / 2))
    for mult in (1, 2, 5, 10):  # about 5-10 ticks
        if span / (step * mult) <= 10:
            step *= mult
            break
    k = 0
    while k * step <= span * (1 + 1e-9):
        x = MARGIN + LEFT_W + k * step * scale
        cv.box(x - 0.2, y, 0.4, 4, 'color="#888888" fillcolor="#888888" class="tick"')
        cv.text(x, y + 4, fmt_time(k * step), 8, centre=True, cls="tick-label")
        k += 1
    return y + 18


def _draw_legend(cv: _Canvas, y: float, panels: list[Panel]) -> float:
    present = set()
    for p in panels:
        slots = StageSlots(p.timeline)
        present |= {(e.op, slots.event(e) % 2) for e in p.timeline.compute_events()}
    for slot in (0, 1):
        kinds = [k for k in KINDS if (k, slot) in present]
        if not kinds:
            continue
        x = MARGIN
        name = "ops" if not any(s for _, s in present) else "the rank's first stage" if slot == 0 else SECOND_STAGE_NAME
        x += cv.text(x, y, name, 8, cls="legend") + 6
        for kind in kinds:
            cv.box(x, y + 1, 18, 10, f'class="legend-swatch {kind} slot{slot}" fillcolor="{colour(kind, slot)}"')
            x += 22
            x += cv.text(x, y, f"{kind} {KIND_NAMES[kind]}", 8, cls="legend") + 10
        cv.width = max(cv.width, x + MARGIN)
        y += 15
    if any(any(collective_by_rank(p.timeline)) for p in panels):
        x = MARGIN + cv.text(MARGIN, y, "data parallel", 8, cls="legend") + 6
        cv.box(x, y + 1, 18, REDUCE_H - 1, f'class="legend-swatch reduce-lane" fillcolor="{REDUCE_COLOUR}" '
               f'color="{REDUCE_COLOUR}"')
        cv.text(x + 22, y, f"R/s3 {REDUCE_NAME}; right: its time past the rank's compute", 8, cls="legend")
        y += 15
    if any(any(events_by_rank(p.timeline, "comm", collective=False)) for p in panels):
        x = MARGIN + cv.text(MARGIN, y, "measured", 8, cls="legend") + 6
        cv.box(x, y + 3, 18, COMM_H, f'class="legend-swatch comm-lane" fillcolor="{COMM_COLOUR}" color="{COMM_COLOUR}"')
        cv.text(x + 22, y, "communication (send/recv) under each rank", 8, cls="legend")
        y += 15
    return y


def panels_drawing(panels: list[Panel], title: str, subtitle: str = "") -> _Canvas:
    """Lay out ``panels`` stacked on one time scale under a title; returns the canvas."""
    cv = _Canvas()
    time_w, span = time_width(panels)
    scale = time_w / span if span > 0 else 0.0
    y = MARGIN
    title_w = cv.text(MARGIN, y, title, 13, bold=True, cls="title")
    y += 19
    sub_w = 0.0
    if subtitle:
        sub_w = cv.text(MARGIN, y, subtitle, 9, cls="subtitle")
        y += 14
    y += 6
    for i, panel in enumerate(panels):
        if i:
            y += PANEL_GAP
        ids = f"p{i}_" if len(panels) > 1 else ""
        y = _draw_panel(cv, panel, y, scale, MARGIN + LEFT_W + time_w + 8, ids)
    y = _draw_axis(cv, y + 2, span, scale)
    cv.width = max(cv.width, 2 * MARGIN + LEFT_W + time_w + RIGHT_W, MARGIN * 2 + title_w, MARGIN * 2 + sub_w)
    for panel in panels:
        if panel.header:
            cv.width = max(cv.width, 2 * MARGIN + _text_w(panel.header, 10))
    y = _draw_legend(cv, y + 4, panels)
    cv.height = y + MARGIN
    return cv


def render_panels(path: str | Path, panels: list[Panel], title: str, subtitle: str = "") -> str:
    """Draw ``panels`` to ``path`` (.svg, .png, .pdf, or .dot for the source); returns the path."""
    cv = panels_drawing(panels, title, subtitle)
    return write_graph(path, cv.source(), engine="neato", pinned=True)


def summary_text(summary: Summary) -> str:
    text = (f"makespan {fmt_time(summary.makespan)} · bubble rate {100 * summary.bubble_rate:.2f}% · "
            f"peak activations {summary.peak}")
    if summary.dp_exposed:
        text += f" · exposed DP sync {fmt_time(summary.exposed_dp_sync)}"
    return text
