"""Diagrams of schedules, simulations and recorded runs: terminal (rich), SVG/PNG (graphviz), trace JSON.

Everything here reads the shared data types (``Schedule``, ``SimResult``, ``Timeline``) and never
the runtime, so a simulated and a measured run are drawn the same way::

    from mt_dualpipe.schedules import build_schedule, simulate, Costs
    from mt_dualpipe.visualize import render_file, terminal_view
    res = simulate(build_schedule("dualpipe", 8, 20), Costs(1, 1, 1))
    render_file("dualpipe.svg", res.to_timeline())     # to scale, needs graphviz's `dot`
    render_file("dualpipe.json", res.to_timeline())    # Chrome / Perfetto trace
"""

from ._graphviz import GraphvizNotFound, require_dot
from .depgraph import dependency_graph
from .metrics import Summary, costs_from_timeline
from .render import ComparisonEntry, render_comparison, render_file
from .terminal import terminal_view
from .trace import chrome_trace

__all__ = [
    "GraphvizNotFound", "require_dot", "dependency_graph", "Summary", "costs_from_timeline",
    "ComparisonEntry", "render_comparison", "render_file", "terminal_view", "chrome_trace",
]
