"""``list``, ``show``, ``compare`` and ``export``: the schedule compiler from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..schedules import (
    Costs,
    ScheduleError,
    build_schedule,
    list_schedules,
    lower,
    schedule_info,
    simulate,
    validate_program,
)
from ..schedules.ir import FB, Op, Schedule
from ..schedules.simulate import SimResult

# colours shared with the terminal diagrams: forward green, input-grad orange, weight-grad blue
OP_STYLE = {"F": "bold black on green3", "B": "bold black on orange1", "W": "bold white on blue3",
            "BW": "bold black on gold1", "FB": "bold white on purple4"}
CHAIN1_STYLE = {"F": "bold black on pale_green1", "B": "bold black on light_salmon1", "W": "bold white on royal_blue1",
                "BW": "bold black on khaki1"}
SEARCHING = {"auto"}  # schedules that search (need costs, take seconds): left out of compare unless asked


def add_schedule_args(p: argparse.ArgumentParser, name: bool = True) -> None:
    if name:
        p.add_argument("name", help="schedule name (see `mt-dualpipe list`)")
    p.add_argument("-p", "--ranks", type=int, required=True, help="pipeline ranks (devices)")
    p.add_argument("-m", "--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--costs", default="1,1,1", help="f,b,w[,fb[,comm]] per stage (default 1,1,1)")
    p.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank for interleaved-1f1b")


def schedule_from_args(args: argparse.Namespace, name: str | None = None) -> Schedule:
    opts = {}
    name = name or args.name
    if args.virtual_stages is not None and name == "interleaved-1f1b":
        opts["virtual_stages"] = args.virtual_stages
    return build_schedule(name, args.ranks, args.microbatches, **opts)


def cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="mt_dualpipe schedules")
    table.add_column("name", style="bold cyan")
    table.add_column("what it is")
    table.add_column("constraints")
    table.add_column("options")
    for info in list_schedules():
        table.add_row(info.name, info.description, info.constraints, ", ".join(info.options) or "-")
    Console().print(table)
    return 0


def _token(item: Op | FB, first_stage: tuple[int, int]) -> Text:
    """One op as a coloured token; ops of a rank's second stage (chain 1, or a V's way back) are lighter."""
    if type(item) is FB:
        return Text(f"{item.f.mb}|{item.b.mb}", style=OP_STYLE["FB"])
    style = (OP_STYLE if (item.chain, item.stage) == first_stage else CHAIN1_STYLE)[item.kind]
    label = {"F": "F", "B": "B", "W": "W", "BW": "b"}[item.kind]
    return Text(f"{label}{item.mb}", style=style)


def op_grid(schedule: Schedule) -> Table:
    """Each rank's op sequence (order, not time) as a row of coloured tokens."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", style="bold")
    grid.add_column()
    for r, ops in enumerate(schedule.ranks):
        first = schedule.local_stages(r)[0] if schedule.local_stages(r) else (-1, -1)
        row = Text()
        for item in ops:
            row.append_text(_token(item, first))
            row.append(" ")
        grid.add_row(f"rank {r}", row)
    return grid


def metrics_table(result: SimResult) -> Table:
    table = Table(title=f"{result.name}: makespan {result.makespan:g}, bubble rate {100 * result.bubble_rate:.2f} %")
    table.add_column("rank", justify="right")
    for col in ("busy", "makespan bubble", "span bubble", "peak activations"):
        table.add_column(col, justify="right")
    for r in range(result.num_ranks):
        table.add_row(str(r), f"{result.busy[r]:g}", f"{result.makespan_bubble[r]:g}", f"{result.span_bubble[r]:g}",
                      str(result.peak_activations[r]))
    return table


def cmd_show(args: argparse.Namespace) -> int:
    console = Console()
    schedule = schedule_from_args(args)
    costs = Costs.parse(args.costs)
    result = simulate(schedule, costs)
    console.print(f"[bold]{schedule.name}[/] P={schedule.num_ranks} M={schedule.num_microbatches} "
                  f"costs: {costs.describe()}")
    console.print("[bold]order per rank[/] (F forward, B input-grad, W weight-grad, b full backward, f|b F&B pair):")
    console.print(op_grid(schedule))
    from ..visualize import terminal_view

    console.print(terminal_view(result.to_timeline(), title=f"{schedule.name} timeline", metrics=result))
    console.print(metrics_table(result))
    return 0


def stage_fraction(schedule: Schedule) -> float:
    """The size of one stage relative to one rank's share of the model (1/v for v chunks per rank)."""
    return schedule.num_ranks / schedule.num_stages()


def compare_results(ranks: int, microbatches: int, costs: Costs, virtual_stages: int = 2,
                    include: set[str] | None = None) -> list[tuple[str, Schedule, SimResult]]:
    """Every schedule that accepts (P, M), simulated on the same model.

    ``costs`` are those of one rank's share of the model (1/P of it); a schedule that cuts that
    share into v smaller stages (V shapes, interleaving) gets per-stage costs scaled by 1/v, so
    makespans compare like for like. DualPipe's two stages per rank are full-size copies.
    """
    out = []
    for info in list_schedules():
        if info.name in SEARCHING and not (include and info.name in include):
            continue
        opts = {"virtual_stages": virtual_stages} if "virtual_stages" in info.options else {}
        try:
            schedule = build_schedule(info.name, ranks, microbatches, **opts)
        except ScheduleError:
            continue
        label = info.name + (f" (v={virtual_stages})" if opts else "")
        out.append((label, schedule, simulate(schedule, costs.scaled(stage_fraction(schedule)))))
    return out


def _peak_memory(schedule: Schedule, res: SimResult) -> float:
    return max(res.peak_activations) * stage_fraction(schedule)


def cmd_compare(args: argparse.Namespace) -> int:
    console = Console()
    costs = Costs.parse(args.costs)
    rows = compare_results(args.ranks, args.microbatches, costs, args.virtual_stages or 2)
    if not rows:
        raise ScheduleError(f"no schedule accepts P={args.ranks}, M={args.microbatches}")
    best = min(r.makespan for _, _, r in rows)
    table = Table(title=f"P={args.ranks} ranks, M={args.microbatches} micro-batches, costs {costs.describe()}")
    for col in ("schedule", "makespan", "bubble rate", "peak activations", "stages", "params per rank", "devices"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for label, schedule, res in sorted(rows, key=lambda x: (x[2].makespan, _peak_memory(x[1], x[2]))):
        info_copies = schedule_info(schedule.name).param_copies
        mark = " ★" if res.makespan == best else ""
        table.add_row(f"{label}{mark}", f"{res.makespan:g}", f"{100 * res.bubble_rate:.2f} %",
                      f"{_peak_memory(schedule, res):g}", str(schedule.num_stages()),
                      f"{info_copies}×", str(schedule.num_ranks),
                      style="bold green" if mark else None)
    console.print(table)
    console.print("★ lowest makespan. Costs are per rank's share of the model; schedules with smaller stages get "
                  "proportionally smaller per-stage costs. Peak activations: the most loaded rank, in units of one "
                  "full-size (1/P of the model) stage's activations.")
    if args.output:
        from ..visualize import render_comparison

        path = render_comparison(args.output, [(label, res) for label, _, res in rows],
                                 title=f"P={args.ranks}, M={args.microbatches}, costs {costs.describe()}")
        console.print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    schedule = schedule_from_args(args)
    validate_program(lower(schedule))
    out = Path(args.output)
    if args.format == "csv" or (args.format is None and out.suffix == ".csv"):
        out.write_text(schedule.to_pipelining_csv())
    else:
        out.write_text(schedule.to_json(indent=None) + "\n")
    Console().print(f"wrote {out} ({schedule.num_ops()} ops on {schedule.num_ranks} ranks, validated and lowered)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the schedules with their constraints")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="a schedule's per-rank op sequence and its simulated metrics")
    add_schedule_args(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("compare", help="simulate every schedule that accepts P and M, side by side")
    add_schedule_args(p, name=False)
    p.add_argument("-o", "--output", default=None, help="also draw them stacked on one time scale (.svg/.png)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("export", help="save a schedule as JSON (mt-dualpipe.schedule/1) or pipelining CSV")
    add_schedule_args(p)
    p.add_argument("-o", "--output", required=True, help="output file (.json or .csv)")
    p.add_argument("--format", choices=("json", "csv"), default=None, help="default: from the file extension")
    p.set_defaults(func=cmd_export)
