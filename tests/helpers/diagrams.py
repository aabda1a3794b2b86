"""Shared by the diagram and command-line tests: simulated and recorded-run timelines, SVG and text readers.

``measured`` builds a recorded-run lookalike (seconds from an arbitrary origin, a SEND_F after
each non-last F) from a simulation, so tests of measured runs need no runtime. ``svg_boxes`` and
``svg_text`` read what graphviz drew; ``render_text`` renders a rich renderable the way a
terminal (``styles=True``) or a pipe (``styles=False``) would show it.
"""

from __future__ import annotations

import io
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from mt_dualpipe.schedules import Costs, build_schedule, simulate
from mt_dualpipe.schedules.simulate import SimResult
from mt_dualpipe.schedules.timeline import Timeline, TimelineEvent

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` not installed (.ci/run installs it)")


def sim(name: str, P: int, M: int, costs: Costs | None = None) -> SimResult:
    return simulate(build_schedule(name, P, M), costs or Costs(1, 1, 1))


def measured(name: str = "dualpipe", P: int = 4, M: int = 8) -> tuple[Timeline, int]:
    """A recorded-run lookalike and its number of comm events."""
    res = sim(name, P, M, Costs(2, 3, 1))
    schedule = build_schedule(name, P, M)
    last = schedule.num_stages() - 1
    events, comms = [], 0
    for e in res.timeline:
        events.append(e._replace(start=100.0 + e.start * 0.01, end=100.0 + e.end * 0.01))
        if e.op == "F" and e.stage < last:
            end = 100.0 + e.end * 0.01
            events.append(TimelineEvent(e.rank, "SEND_F", e.chain, e.stage, e.mb, end, end + 0.002, lane="comm"))
            comms += 1
    return Timeline(name, P, M, events, "measured"), comms


def svg_groups(path: str | Path, cls: str) -> list[ET.Element]:
    """Every <g> of an SVG whose class has token ``cls``."""
    return [g for g in ET.parse(path).getroot().iter(f"{SVG}g") if cls in g.get("class", "").split()]


def svg_boxes(path: str | Path, cls: str = "op") -> dict[str, tuple[float, float]]:
    """id -> (left x, right x) in points of every <g> whose class has token ``cls``."""
    root = ET.parse(path).getroot()
    graph = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "graph")
    zoom = float(re.match(r"scale\(([\d.]+)", graph.get("transform")).group(1))
    out = {}
    for g in svg_groups(path, cls):
        poly = next(g.iter(f"{SVG}polygon"))
        xs = [float(p.split(",")[0]) * zoom for p in poly.get("points").split()]
        assert g.get("id") not in out
        out[g.get("id")] = (min(xs), max(xs))
    return out


def svg_text(path: str | Path) -> str:
    """All text drawn in an SVG, one line per <text> element."""
    return "\n".join("".join(t.itertext()) for t in ET.parse(path).getroot().iter(f"{SVG}text"))


def render_text(renderable: object, width: int, styles: bool) -> str:
    """What a terminal of ``width`` columns shows (``styles``: with its ANSI colour codes)."""
    console = Console(width=width, record=True, color_system="truecolor", force_terminal=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text(styles=styles)
