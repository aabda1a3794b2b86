"""File outputs: pick the renderer from the extension (.svg/.png/.pdf/.dot to scale, .json trace)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..schedules.errors import ScheduleError
from ..schedules.ir import Schedule
from ..schedules.simulate import SimResult
from ..schedules.timeline import Timeline
from ._graphviz import GRAPHVIZ_FORMATS, SOURCE_FORMATS
from .gantt import Panel, panels_drawing, render_panels, summary_text
from .metrics import Summary
from .style import fmt_time
from .trace import write_trace

TRACE_FORMATS = ("json",)


def _format(path: str | Path) -> str:
    fmt = Path(path).suffix.lower().lstrip(".")
    allowed = GRAPHVIZ_FORMATS + SOURCE_FORMATS + TRACE_FORMATS
    if fmt not in allowed:
        raise ScheduleError(f"cannot write {str(path)!r}: the extension must be one of "
                            f"{', '.join('.' + f for f in allowed)} (diagram, graphviz source or Chrome trace)")
    return fmt


def _kind(tl: Timeline) -> str:
    return "measured" if tl.source == "measured" else "simulated"


def _subtitle(tl: Timeline, summary: Summary, schedule: Schedule | None, say_source: bool = True) -> str:
    parts = []
    options = {k: v for k, v in (schedule.meta if schedule is not None else {}).items() if isinstance(v, (int, str))}
    if options:
        parts.append(" ".join(f"{k}={v}" for k, v in options.items()))
    if tl.meta.get("costs"):
        parts.append(f"costs {tl.meta['costs']}")
    if tl.source == "measured":
        parts.append("measured, times in seconds" if say_source else "times in seconds")
    parts.append(summary_text(summary))
    return " · ".join(parts)


def _timeline_panels(timeline: Timeline, title: str | None, against: Timeline | None,
                     schedule: Schedule | None) -> tuple[list[Panel], str, str]:
    """Panels, title and subtitle of ``render_file``'s diagram."""
    summary = Summary.from_timeline(timeline)
    title = title or f"{timeline.name}  P={timeline.num_ranks} M={timeline.num_microbatches}"
    if against is None:
        return [Panel(timeline, summary)], title, _subtitle(timeline, summary, schedule)
    other = Summary.from_timeline(against)
    head = f"{_kind(timeline)}: {timeline.name} · {_subtitle(timeline, summary, schedule, say_source=False)}"
    return [Panel(timeline, summary, head),
            Panel(against, other, f"{_kind(against)}: {against.name} · {_subtitle(against, other, None)}")], title, ""


def drawing_size(timeline: Timeline, *, title: str | None = None, against: Timeline | None = None,
                 schedule: Schedule | None = None) -> tuple[int, int]:
    """Width and height in points of the diagram ``render_file`` draws (PNG pixels: x 96/72)."""
    return panels_drawing(*_timeline_panels(timeline, title, against, schedule)).size


def render_file(path: str | Path, timeline: Timeline, *, title: str | None = None,
                against: Timeline | None = None, schedule: Schedule | None = None) -> str:
    """Write ``timeline`` to ``path``, the format chosen by its extension; returns the path written.

    .svg/.png/.pdf draw it to scale with graphviz (.dot writes that graphviz source, no graphviz
    needed); .json writes a Chrome/Perfetto trace. ``against`` (typically the simulation of a
    measured run's schedule) is drawn beneath it on the same time scale. ``schedule`` adds its
    build options to the title.
    """
    fmt = _format(path)
    if fmt in TRACE_FORMATS:
        timelines = [(None, timeline)] if against is None else [(_kind(timeline), timeline), (_kind(against), against)]
        if against is not None and timelines[0][0] == timelines[1][0]:
            timelines = [("first", timeline), ("second", against)]
        return write_trace(path, timelines)
    return render_panels(path, *_timeline_panels(timeline, title, against, schedule))


@dataclass(frozen=True)
class ComparisonEntry:
    """One schedule of a comparison diagram.

    ``peak_scale`` converts the simulator's peak (in that schedule's stages) into the unit the
    diagram states in ``peak_unit`` (e.g. ``1/v`` for v-times smaller stages, so that every panel
    counts full-size stages, as ``mt-dualpipe compare``'s table does); ``best`` marks the panel.
    """

    label: str
    result: SimResult
    peak_scale: float = 1.0
    best: bool = False

    def header(self) -> str:
        summary = Summary.from_sim(self.result)
        peak = max(self.result.peak_activations, default=0) * self.peak_scale
        mark = f"{BEST_MARK} " if self.best else ""
        text = (f"{mark}{self.label} · makespan {fmt_time(summary.makespan)} · bubble rate "
                f"{100 * summary.bubble_rate:.2f}% · peak activations {peak:g}")
        if summary.dp_exposed:
            text += f" · exposed DP sync {fmt_time(summary.exposed_dp_sync)}"
        return text


BEST_MARK = "★"


def _entries(entries: list) -> list[ComparisonEntry]:
    return [e if isinstance(e, ComparisonEntry) else ComparisonEntry(*e) for e in entries]


def _comparison_title(entries: list[ComparisonEntry]) -> str:
    sizes = {(e.result.num_ranks, e.result.num_microbatches) for e in entries}
    costs = {e.result.costs.describe() for e in entries}
    title = "pipeline schedules"
    if len(sizes) == 1:
        P, M = sizes.pop()
        title += f"  P={P} M={M}"
    if len(costs) == 1:
        title += f"  costs {costs.pop()}"
    return title


def render_comparison(path: str | Path, entries: list, *, title: str | None = None, notes: str = "") -> str:
    """Stack several simulated schedules in one diagram on one time scale; returns the path.

    ``entries`` are ``(label, SimResult)`` pairs or ``ComparisonEntry`` (peak in stated units, best
    marked with ★). Each panel is labelled with its name, makespan, bubble rate and peak activations;
    ``notes`` (the unit of the peaks, schedules left out and why) goes under the title. A .json
    path writes one Chrome trace with every schedule's ranks as processes.
    """
    if not entries:
        raise ScheduleError("render_comparison needs at least one (label, SimResult) entry")
    items = _entries(entries)
    fmt = _format(path)
    if fmt in TRACE_FORMATS:
        return write_trace(path, [(e.label, e.result.to_timeline()) for e in items])
    panels = [Panel(e.result.to_timeline(), Summary.from_sim(e.result), e.header(), e.peak_scale) for e in items]
    return render_panels(path, panels, title or _comparison_title(items), notes)
