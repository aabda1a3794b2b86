"""The terminal view: one row per rank, time left to right, drawn with rich.

Time is scaled to the available width. An op wide enough to hold its micro-batch number shows it;
narrower ops are plain coloured cells, and a column shorter than any op (huge schedules) takes
the colour of the kind that fills most of it, so a 64 x 1024 run still fits on one screen. Idle
time is blank. Ranks beyond ``max_ranks`` are summarised in one line instead of overflowing.
An op on a rank's second stage (a V's way back, DualPipe's reverse chain) is drawn in a light tint.

``plain=True`` draws the same rows for a reader without colour (output piped to a file): each op
writes its kind code and micro-batch (``F3``, ``B3``, ``W3``, ``b3`` for a full backward,
``F3|b5`` for an FB pair), ``'`` marks an op of the rank's second stage, ``.`` fills the rest of
an op's columns and idle time stays blank.

A schedule with data-parallel gradient reductions (``REDUCE_GRAD``, ``add_grad_reduction``) gets
a second row under each rank, between dashed bars: its communication stream, one ``R/s3`` cell
per stage reduced, on the same time scale, and at the right ``+x dp``, the reduction time past
the rank's compute (exposed). The metrics end with the exposed sync per rank.
"""

from __future__ import annotations

import math

from rich.console import Console, Group
from rich.style import Style
from rich.text import Text

from ..schedules.ops import OpKind
from ..schedules.simulate import SimResult
from ..schedules.timeline import Timeline, TimelineEvent
from .metrics import (
    COLLECTIVE_KINDS,
    StageSlots,
    Summary,
    collective_by_rank,
    event_ops,
    events_by_rank,
    start_time,
    step_span,
)
from .style import (
    CODES,
    KIND_NAMES,
    KINDS,
    REDUCE_NAME,
    SECOND_STAGE,
    SECOND_STAGE_NAME,
    cell_label,
    colour,
    fmt_time,
    plain_label,
    reduce_label,
)

MIN_COLUMNS = 10
_SUFFIX = "   idle  peak"  # what follows the row's closing bar: f"{idle:6.1f}%{peak:>6}"


PLAIN_FILL = "."


def _style(kind: str, slot: int, shade: int = 0) -> Style:
    """Cell style; ``shade=1`` is a slightly darker variant that separates touching same-kind cells."""
    hex_colour = colour(kind, slot)
    if shade:
        rgb = [int(hex_colour[i:i + 2], 16) * 85 // 100 for i in (1, 3, 5)]
        hex_colour = "#" + "".join(f"{v:02x}" for v in rgb)
    return Style(color="black", bgcolor=hex_colour)


def _plain_text(e: TimelineEvent, slots: StageSlots) -> str:
    """An op's text in the plain view: ``F3``, ``b3'``, ``F3|b5'``; a gradient reduction ``R/s3``."""
    if e.op in COLLECTIVE_KINDS:
        return cell_label(e)
    return "|".join(plain_label(op.kind, op.mb, slots.second(e.rank, op)) for op in event_ops(e))


def _plain_cell(e: TimelineEvent, slots: StageSlots, width: int) -> str:
    """``width`` characters for an op in the plain view: its full text, else its kind code(s), then dots."""
    text = _plain_text(e, slots)
    if len(text) > width:
        text = "".join(CODES.get(op.kind, "?") + (SECOND_STAGE if slots.second(e.rank, op) else "")
                       for op in event_ops(e))
    if len(text) > width:
        text = text[:1]
    return text + PLAIN_FILL * (width - len(text))


def _row_cells(events: list[TimelineEvent], t0: float, scale: float, ncols: int, slots: StageSlots,
               plain: bool = False) -> list[tuple[str, Style | None]]:
    """Characters and styles of one rank's row of ``ncols`` columns."""
    chars = [" "] * ncols
    styles: list[Style | None] = [None] * ncols
    tiny: dict[int, dict[tuple[str, int], float]] = {}
    prev_end, prev_key, shade = -1, None, 0
    for e in events:
        a, b = (e.start - t0) * scale, (e.end - t0) * scale
        key = (e.op, 0 if e.op in COLLECTIVE_KINDS else slots.event(e))  # touching reductions alternate shade
        if b - a >= 1.0:  # at least one column: a cell of its own
            c0, c1 = min(round(a), ncols), min(round(b), ncols)
            shade = 1 - shade if (c0 == prev_end and key == prev_key) else 0
            prev_end, prev_key = c1, key
            if plain:
                chars[c0:c1] = _plain_cell(e, slots, c1 - c0)
                continue
            st = _style(e.op, key[1], shade)
            for c in range(c0, c1):
                styles[c], chars[c] = st, " "
            label = cell_label(e)
            if len(label) <= c1 - c0:
                at = c0 + (c1 - c0 - len(label)) // 2
                chars[at:at + len(label)] = label
            continue
        col = int(a)  # narrower than a column: add its share to the columns it touches
        while a < b and col < ncols:
            nxt = min(b, col + 1.0)
            share = tiny.setdefault(col, {})
            share[key] = share.get(key, 0.0) + (nxt - a)
            a, col = nxt, col + 1
    for col, share in tiny.items():
        if styles[col] is None and chars[col] == " " and sum(share.values()) >= 0.5:
            kind, slot = max(share, key=share.__getitem__)
            if plain:
                chars[col] = CODES.get(kind, kind[:1])
            else:
                styles[col] = _style(kind, slot)
    return list(zip(chars, styles, strict=True))


def _append_cells(text: Text, cells: list[tuple[str, Style | None]]) -> None:
    """Append cells to ``text``, merging runs of one style into one span."""
    i = 0
    while i < len(cells):
        j = i
        while j < len(cells) and cells[j][1] == cells[i][1]:
            j += 1
        text.append("".join(c for c, _ in cells[i:j]), style=cells[i][1])
        i = j


def _nice_step(span: float, ncols: int, min_gap: int = 10) -> float:
    """A 1/2/5 x 10^k tick step that leaves at least ``min_gap`` columns between ticks."""
    if span <= 0:
        return 1.0
    raw = span * min_gap / ncols
    base = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if base * mult >= raw:
            return base * mult
    return base * 10


def _axis(label_w: int, span: float, scale: float, ncols: int) -> Text:
    line = [" "] * ncols
    step = _nice_step(span, ncols)
    k = 0
    while k * step <= span + 1e-9:
        tick = fmt_time(k * step)
        col = round(k * step * scale)
        if col + len(tick) <= ncols and all(ch == " " for ch in line[max(0, col - 1):col + len(tick)]):
            line[col:col + len(tick)] = tick
        k += 1
    return Text(" " * (label_w + 1) + "".join(line), style="dim", no_wrap=True, overflow="crop")


def _legend(timeline: Timeline, width: int, plain: bool = False) -> list[Text]:
    """Swatches of the kinds present (the second stages' tints after them), wrapped to ``width``;
    in the plain view, the codes instead of swatches."""
    slots = StageSlots(timeline)
    present = {(e.op, slots.event(e) % 2) for e in timeline.compute_events()}
    kinds = [kind for kind in KINDS if (kind, 0) in present or (kind, 1) in present]
    if plain:
        entries = [(f"{CODES[kind]}", None, f" {KIND_NAMES[kind]}  ") for kind in kinds if kind in CODES]
        if OpKind.FB in kinds:
            entries.append(("F3|b5", None, f" {KIND_NAMES[OpKind.FB]}  "))
        if slots.multi:
            entries.append((SECOND_STAGE, None, f" {SECOND_STAGE_NAME}  "))
        entries.append((PLAIN_FILL, None, " busy, blank idle"))
    else:
        entries = [(f" {kind} ", _style(kind, 0), f" {KIND_NAMES[kind]}  ") for kind in kinds]
        second = [kind for kind in kinds if (kind, 1) in present]
        if second:
            entries.append(("", None, f"{SECOND_STAGE_NAME}: "))
            entries += [(f" {kind} ", _style(kind, 1), " ") for kind in second]
    if any(e.op in COLLECTIVE_KINDS for e in timeline.events):
        swatch = reduce_label(3)
        entries.append((swatch if plain else f" {swatch} ", None if plain else _style(COLLECTIVE_KINDS[0], 0),
                        f" {REDUCE_NAME}; +x dp: exposed past compute  "))
    lines = [Text(no_wrap=True, overflow="crop")]
    for swatch, style, name in entries:
        if lines[-1].cell_len and lines[-1].cell_len + len(swatch) + len(name) > width:
            lines.append(Text(no_wrap=True, overflow="crop"))
        lines[-1].append(swatch, style=style)
        lines[-1].append(name)
    for line in lines:
        line.rstrip()
    return lines


def _metrics_line(summary: Summary) -> Text:
    peaks = summary.peak_activations
    if len(peaks) <= 16:
        per_rank = " ".join(str(p) for p in peaks)
        peak_text = f"peak activations {summary.peak} (per rank: {per_rank})"
    else:
        peak_text = f"peak activations {summary.peak} (per rank: min {min(peaks)}, max {max(peaks)})"
    return Text(f"makespan {fmt_time(summary.makespan)} · bubble rate {100 * summary.bubble_rate:.2f}% · {peak_text}",
                no_wrap=True, overflow="crop")


def dp_sync_line(summary: Summary) -> Text | None:
    """``exposed DP sync 3 (per rank: 3 0 0 3)``: the gradient reductions' time past each rank's compute."""
    if not summary.dp_exposed:
        return None
    per = summary.dp_exposed
    detail = " ".join(fmt_time(x) for x in per) if len(per) <= 16 else \
        f"min {fmt_time(min(per))}, max {fmt_time(max(per))}"
    return Text(f"exposed DP sync {fmt_time(summary.exposed_dp_sync)} (per rank: {detail}) · "
                f"gradient reductions on the comm stream, not hidden by compute", no_wrap=True, overflow="crop")


def _shown_ranks(num_ranks: int, max_ranks: int) -> tuple[list[int], int]:
    """Ranks to draw and the position of the 'n more ranks' line (-1 when every rank is drawn)."""
    if num_ranks <= max_ranks:
        return list(range(num_ranks)), -1
    head = max_ranks // 2
    tail = max_ranks - head
    return list(range(head)) + list(range(num_ranks - tail, num_ranks)), head


PLAIN_COLUMNS_PER_OP = 4  # a typical op's text ("F12'") fits
PLAIN_MAX_WIDTH = 400


def plain_width(timeline: Timeline) -> int:
    """A width for the plain view of a file or pipe (no terminal to fit): wide enough for a typical
    op's text, at least 80 and at most ``PLAIN_MAX_WIDTH`` columns."""
    durs = sorted(e.end - e.start for e in timeline.compute_events() if e.end > e.start)
    if not durs:
        return 80
    span = step_span(timeline)
    ncols = math.ceil(PLAIN_COLUMNS_PER_OP * span / durs[len(durs) // 2])
    label_w = len(f"r{timeline.num_ranks - 1}") + 1
    return max(80, min(PLAIN_MAX_WIDTH, label_w + 2 + len(_SUFFIX) + ncols))


def terminal_view(timeline: Timeline, *, width: int | None = None, title: str | None = None,
                  metrics: SimResult | None = None, max_ranks: int = 32, plain: bool = False):
    """A rich renderable of ``timeline``: rank rows scaled to ``width`` columns, a legend and metrics.

    ``width`` defaults to the terminal's; ``metrics`` (the simulation result) supplies the numbers,
    otherwise they are computed from the events. More than ``max_ranks`` ranks are summarised.
    ``plain`` writes each op's kind and micro-batch as text instead of colouring it (for files and pipes).
    """
    if width is None:
        width = plain_width(timeline) if plain else Console().width
    P = timeline.num_ranks
    summary = Summary.from_sim(metrics) if metrics is not None else Summary.from_timeline(timeline)
    label_w = len(f"r{P - 1}") + 1
    ncols = max(MIN_COLUMNS, width - label_w - 2 - len(_SUFFIX))  # two bars around the time columns
    t0 = start_time(timeline)
    span = step_span(timeline)
    scale = ncols / span if span > 0 else 0.0
    rows = events_by_rank(timeline)
    reduces = collective_by_rank(timeline)
    slots = StageSlots(timeline)

    if title is None:
        title = f"{timeline.name}  P={P} M={timeline.num_microbatches}"
        if timeline.meta.get("costs"):
            title += f"  {timeline.meta['costs']}"
        if timeline.source == "measured":
            title += "  (measured, seconds)"
    lines: list[Text] = [Text(title, style="bold", no_wrap=True, overflow="crop"),
                         Text(" " * (label_w + ncols + 2) + _SUFFIX, style="dim", no_wrap=True, overflow="crop")]
    shown, gap_at = _shown_ranks(P, max_ranks)
    pct = summary.bubble_percent
    for i, r in enumerate(shown):
        if i == gap_at:
            hidden = [q for q in range(P) if q not in set(shown)]
            lo, hi = min(pct[q] for q in hidden), max(pct[q] for q in hidden)
            pk = [summary.peak_activations[q] for q in hidden]
            lines.append(Text(f"{'⋮':>{label_w}} {len(hidden)} more ranks (r{hidden[0]}..r{hidden[-1]}): "
                              f"idle {lo:.1f}..{hi:.1f}%, peak {min(pk)}..{max(pk)}",
                              style="dim", no_wrap=True, overflow="crop"))
        line = Text(f"{'r' + str(r):<{label_w}}│", no_wrap=True, overflow="crop")
        _append_cells(line, _row_cells(rows[r], t0, scale, ncols, slots, plain))
        line.append(f"│{pct[r]:6.1f}%{summary.peak_activations[r]:>6}")
        lines.append(line)
        if any(reduces):
            exposed = summary.dp_exposed[r] if summary.dp_exposed else 0.0
            comm = Text(f"{'':<{label_w}}╎", no_wrap=True, overflow="crop")
            _append_cells(comm, _row_cells(reduces[r], t0, scale, ncols, slots, plain))
            comm.append(f"╎{'+' + fmt_time(exposed) + ' dp':>{len(_SUFFIX)}}")
            lines.append(comm)
    lines.append(_axis(label_w, span, scale, ncols))
    lines.extend(_legend(timeline, width, plain))
    lines.append(_metrics_line(summary))
    sync = dp_sync_line(summary)
    if sync is not None:
        lines.append(sync)
    return Group(*lines)
