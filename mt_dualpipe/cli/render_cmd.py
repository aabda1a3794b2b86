"""``render``: draw one schedule's simulation, or a measured run, to a file or the terminal.

    mt-dualpipe render NAME -p P -m M -o out.svg|out.png|out.json [--costs f,b,w[,fb[,comm]]]
    mt-dualpipe render NAME -p P -m M --dp-sync X -o out.svg  # with each stage's gradient reduction
    mt-dualpipe render NAME -p P -m M --deps -o deps.svg      # which op waits on which
    mt-dualpipe render --timeline run.json -o run.svg [--against NAME]

Without ``-o`` the diagram is printed to the terminal. ``--against`` simulates the named schedule
for the run's P and M, with costs measured from the run itself unless ``--costs`` is given, and
draws it beneath the run on the same time scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from ..schedules import Costs, ScheduleError, build_schedule, schedule_info, simulate
from ..schedules.ir import Schedule
from ..schedules.simulate import SimResult
from ..schedules.timeline import Timeline
from ..visualize import GraphvizNotFound, costs_from_timeline, dependency_graph, render_file, terminal_view
from ..visualize.terminal import plain_width
from .schedule_cmds import add_dp_sync_args, with_dp_sync


def _build(name: str, ranks: int, microbatches: int, virtual_stages: int | None, costs: Costs | None = None
           ) -> Schedule:
    opts: dict = {}
    if costs is not None and "costs" in schedule_info(name).options:  # a search (auto) plans for these costs
        opts["costs"] = costs
    if virtual_stages is not None:
        if "virtual_stages" not in schedule_info(name).options:
            raise ScheduleError(f"--virtual-stages applies to schedules with chunks per rank "
                                f"(e.g. interleaved-1f1b), not {name!r}")
        opts["virtual_stages"] = virtual_stages
    return build_schedule(name, ranks, microbatches, **opts)


def _check(args: argparse.Namespace) -> None:
    if (args.name is None) == (args.timeline is None):
        raise ScheduleError("render needs a schedule NAME (with -p and -m) or --timeline run.json, not both")
    if args.name is not None and (args.ranks is None or args.microbatches is None):
        raise ScheduleError(f"render {args.name} needs -p RANKS and -m MICROBATCHES")
    if args.timeline is not None and (args.ranks is not None or args.microbatches is not None):
        raise ScheduleError("-p/-m come from the timeline file with --timeline; leave them out")
    if args.against is not None and args.timeline is None:
        raise ScheduleError("--against NAME draws a simulation beneath a measured run: it needs --timeline")
    if args.deps and args.timeline is not None:
        raise ScheduleError("--deps draws a schedule's dependency graph: give a NAME, not --timeline")
    if args.dp_sync is not None and args.timeline is not None:
        raise ScheduleError("--dp-sync prices a simulated schedule's gradient reductions: give a NAME, not --timeline")
    if args.deps and args.output is None:
        raise ScheduleError("--deps needs -o FILE (.svg, .png, .pdf or .dot)")


def _load_timeline(path: str) -> Timeline:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleError(f"cannot read timeline {path!r}: {exc.strerror}") from exc
    return Timeline.from_json(text)


def _print_terminal(args: argparse.Namespace, timeline: Timeline, against: Timeline | None,
                    metrics: SimResult | None) -> None:
    """The terminal view; plain text (no colour, wide enough for each op's text) into a file or pipe."""
    console = Console(width=args.width) if args.width else Console()
    plain = args.plain or not console.is_terminal or console.no_color
    width = args.width
    if plain and width is None:
        width = max(plain_width(t) for t in (timeline, against) if t is not None)
        console = Console(width=width)
    console.print(terminal_view(timeline, width=width, metrics=metrics, plain=plain))
    if against is not None:
        console.print(terminal_view(against, width=width, plain=plain))


def cmd_render(args: argparse.Namespace) -> int:
    _check(args)
    schedule = against = metrics = None
    try:
        if args.timeline is not None:
            timeline = _load_timeline(args.timeline)
            if args.against is not None:
                costs = Costs.parse(args.costs) if args.costs else costs_from_timeline(timeline)
                sched = _build(args.against, timeline.num_ranks, timeline.num_microbatches, args.virtual_stages, costs)
                against = simulate(sched, costs).to_timeline()
                if timeline.source == "measured":
                    against.meta["time_unit"] = "s"  # costs are in the run's seconds
        else:
            costs = Costs.parse(args.costs or "1,1,1")
            schedule = _build(args.name, args.ranks, args.microbatches, args.virtual_stages, costs)
            if args.deps:
                print(f"wrote {dependency_graph(schedule, args.output)}")
                return 0
            schedule, costs = with_dp_sync(schedule, costs, args.dp_sync, args.sync_at)
            metrics = simulate(schedule, costs)
            timeline = metrics.to_timeline()
        if args.output is None:
            _print_terminal(args, timeline, against, metrics)
            return 0
        print(f"wrote {render_file(args.output, timeline, title=args.title, against=against, schedule=schedule)}")
    except GraphvizNotFound as exc:
        print(f"mt-dualpipe: {exc}", file=sys.stderr)
        return 3
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "render", help="draw a schedule or a measured run (.svg/.png to scale, .json Chrome trace, or terminal)",
        description="Draw a schedule's simulation or a recorded run. The output format follows -o's extension: "
                    ".svg/.png/.pdf to scale (graphviz), .dot (graphviz source), .json (Chrome/Perfetto trace); "
                    "without -o the diagram is printed to the terminal.")
    p.add_argument("name", nargs="?", default=None, help="schedule name (see `mt-dualpipe list`)")
    p.add_argument("-p", "--ranks", type=int, default=None, help="pipeline ranks (devices)")
    p.add_argument("-m", "--microbatches", type=int, default=None, help="micro-batches per step")
    p.add_argument("-o", "--output", default=None, help="output file: .svg, .png, .pdf, .dot or .json")
    p.add_argument("--costs", default=None,
                   help="f,b,w[,fb[,comm]] per stage (default 1,1,1; with --against: measured from the run)")
    p.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (interleaved-1f1b)")
    p.add_argument("--timeline", default=None, help="a recorded run (mt-dualpipe.timeline/1 JSON) to draw")
    p.add_argument("--against", default=None, metavar="NAME",
                   help="with --timeline: also draw NAME's simulation beneath the run, on the same scale")
    add_dp_sync_args(p)
    p.add_argument("--deps", action="store_true", help="draw the dependency graph (which op waits on which)")
    p.add_argument("--title", default=None, help="diagram title (default: schedule, P and M)")
    p.add_argument("--width", type=int, default=None, help="terminal width for the terminal view")
    p.add_argument("--plain", action="store_true", help="terminal view as text without colour (each op's kind and "
                   "micro-batch written out; the default when the output is not a terminal)")
    p.set_defaults(func=cmd_render)
