"""Bubble diagrams: every schedule that accepts P = 8, M = 20, simulated and drawn on one time scale.

    python examples/bubble_diagrams.py [-o bubble_comparison.svg] [-p 8] [-m 20] [--costs 1,1,1]

Prints a table (makespan, bubble rate, peak activations) and writes the stacked diagram, in the
table's order, with the same peaks (in full-size stages) and the fastest schedule marked ★. Costs
are those of one rank's share of the model: schedules that cut it into v smaller stages (V shapes,
interleaving) get per-stage costs divided by v, so the makespans compare like for like. Without
graphviz's `dot` the table is still printed and a Chrome trace (.json) is written instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, list_schedules, simulate
from mt_dualpipe.visualize import ComparisonEntry, GraphvizNotFound, render_comparison

SEARCHING = {"auto"}  # cost-driven searches take seconds; they are compared by `mt-dualpipe plan`


def simulate_all(ranks: int, microbatches: int, costs: Costs):
    """(label, result, stage fraction) of every schedule that can be built for (P, M), and
    (label, reason) of those that cannot."""
    out, left_out = [], []
    for info in list_schedules():
        if info.name in SEARCHING:
            continue
        opts = {"virtual_stages": 2} if "virtual_stages" in info.options else {}
        label = info.name + (" (v=2)" if opts else "")
        try:
            schedule = build_schedule(info.name, ranks, microbatches, **opts)
        except ScheduleError as exc:
            left_out.append((label, str(exc)))
            continue
        fraction = ranks / schedule.num_stages()  # one stage's share of a rank's layers
        out.append((label, simulate(schedule, costs.scaled(fraction)), fraction))
    return out, left_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="bubble_comparison.svg", help=".svg, .png or .json")
    parser.add_argument("-p", "--ranks", type=int, default=8)
    parser.add_argument("-m", "--microbatches", type=int, default=20)
    parser.add_argument("--costs", default="1,1,1", help="f,b,w[,fb[,comm]] of one rank's share of the model")
    args = parser.parse_args()

    costs = Costs.parse(args.costs)
    built, left_out = simulate_all(args.ranks, args.microbatches, costs)
    rows = sorted(built, key=lambda row: row[1].makespan)
    best = rows[0][1].makespan
    table = Table(title=f"P={args.ranks} M={args.microbatches}, costs {costs.describe()}")
    for col in ("schedule", "makespan", "bubble rate", "span bubble rate", "peak activations"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for label, res, fraction in rows:
        table.add_row(label + (" ★" if res.makespan == best else ""), f"{res.makespan:g}",
                      f"{100 * res.bubble_rate:.2f} %", f"{100 * res.span_bubble_rate:.2f} %",
                      f"{max(res.peak_activations) * fraction:g}")
    console = Console()
    console.print(table)
    unit = "peak activations: the most loaded rank, in full-size stages (1/P of the model each)"
    console.print(f"★ lowest makespan; {unit}")
    for label, reason in left_out:
        console.print(f"not run: {label}: {reason}")

    # the diagram shows the table's rows in its order, with the same peaks and the same mark
    entries = [ComparisonEntry(label, res, fraction, res.makespan == best) for label, res, fraction in rows]
    title = f"P={args.ranks}, M={args.microbatches}, costs {costs.describe()}"
    notes = f"★ lowest makespan · {unit}" + "".join(f" · not run: {label}" for label, _ in left_out)
    try:
        path = render_comparison(args.output, entries, title=title, notes=notes)
    except GraphvizNotFound as exc:
        console.print(str(exc), markup=False)
        path = render_comparison(Path(args.output).with_suffix(".json"), entries, title=title)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
