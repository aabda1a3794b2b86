"""``list``, ``show``, ``compare`` and ``export``: the schedule compiler from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..schedules import (
    Costs,
    ScheduleError,
    add_grad_reduction,
    build_schedule,
    list_schedules,
    lower,
    schedule_info,
    simulate,
    validate_program,
)
from ..schedules.ir import Op, Schedule
from ..schedules.ops import OpKind, parts
from ..schedules.simulate import SimResult
from ..visualize import ComparisonEntry, render_comparison, terminal_view
from ..visualize.style import CODES, reduce_label
from ..visualize.terminal import plain_width

# colours shared with the terminal diagrams: forward green, input-grad orange, weight-grad blue
OP_STYLE = {OpKind.F: "bold black on green3", OpKind.B: "bold black on orange1", OpKind.W: "bold white on blue3",
            OpKind.BW: "bold black on gold1", OpKind.FB: "bold white on purple4",
            OpKind.REDUCE_GRAD: "bold white on dark_goldenrod"}
SECOND_STYLE = {OpKind.F: "bold black on pale_green1", OpKind.B: "bold black on light_salmon1",
                OpKind.W: "bold white on royal_blue1", OpKind.BW: "bold black on khaki1"}
SEARCHING = {"auto"}  # schedules that search (need costs, take seconds): left out of compare unless asked
EXPORT_FORMATS = ("json", "csv")
PEAK_UNIT = ("peak activations: the most loaded rank, in full-size stages (one stage = 1/P of the model; a "
             "schedule with v-times smaller stages counts each as 1/v)")


def add_schedule_args(p: argparse.ArgumentParser, name: bool = True) -> None:
    if name:
        p.add_argument("name", help="schedule name (see `mt-dualpipe list`)")
    p.add_argument("-p", "--ranks", type=int, required=True, help="pipeline ranks (devices)")
    p.add_argument("-m", "--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--costs", default="1,1,1", help="f,b,w[,fb[,comm]] per stage (default 1,1,1)")
    p.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank for interleaved-1f1b")


DP_SYNC_HELP = ("data-parallel gradient sync per stage, in the units of --costs (a schedule with smaller stages "
                "gets a proportionally smaller one): adds one REDUCE_GRAD per stage right after its last W/BW, run "
                "on the rank's communication stream; what outlasts the rank's compute is reported as exposed")


def add_dp_sync_args(p: argparse.ArgumentParser, when: bool = True) -> None:
    """``--dp-sync X`` (and ``--sync-at``): price and place the data-parallel gradient reductions."""
    p.add_argument("--dp-sync", type=float, default=None, metavar="X", help=DP_SYNC_HELP)
    if when:
        p.add_argument("--sync-at", choices=("last_w", "step_end"), default="last_w",
                       help="with --dp-sync: reduce each stage after its last W/BW (default, overlapped) or all "
                            "after the rank's last op (what a sync after the step does)")


def with_dp_sync(schedule: Schedule, costs: Costs, dp_sync: float | None, when: str = "last_w"
                 ) -> tuple[Schedule, Costs]:
    """``schedule`` with its gradient reductions (``add_grad_reduction``) and ``costs`` pricing them at
    ``dp_sync`` per stage; both unchanged when ``dp_sync`` is None."""
    if dp_sync is None:
        return schedule, costs
    if not dp_sync >= 0:
        raise ScheduleError(f"--dp-sync must be a non-negative number, got {dp_sync:g}")
    return add_grad_reduction(schedule, when), replace(costs, dp_sync=dp_sync)


def build_options(name: str, costs: Costs | None = None, virtual_stages: int | None = None) -> dict:
    """The options of ``name`` that the command line sets: ``virtual_stages`` where the schedule takes
    it, and the costs for a schedule that searches against them (``auto``)."""
    options = schedule_info(name).options
    opts: dict = {}
    if virtual_stages is not None and "virtual_stages" in options:
        opts["virtual_stages"] = virtual_stages
    if costs is not None and "costs" in options:
        opts["costs"] = costs
    return opts


def schedule_from_args(args: argparse.Namespace, name: str | None = None) -> Schedule:
    name = name or args.name
    opts = build_options(name, Costs.parse(args.costs), args.virtual_stages)
    return build_schedule(name, args.ranks, args.microbatches, **opts)


def use_plain(console: Console, args: argparse.Namespace) -> bool:
    """Plain text (no colour) when asked, or when the output is not a terminal (a file, a pipe)."""
    return bool(getattr(args, "plain", False)) or not console.is_terminal or console.no_color


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


# ----- show --------------------------------------------------------------------------------------
def op_text(op: Op, with_stage: bool) -> str:
    """One op as text: ``F3`` (``b`` a full backward), with its stage (``F3/s5``) when ranks run several;
    a stage's gradient reduction is ``R/s5`` (once per stage, not per micro-batch)."""
    if op.kind == OpKind.REDUCE_GRAD:
        return reduce_label(op.stage)
    return f"{CODES[op.kind]}{op.mb}" + (f"/s{op.stage}" if with_stage else "")


def _token(item: Op, first_stage: tuple[int, int], with_stage: bool) -> Text:
    """One op (or F&B pair) as a token; ops of a rank's second stage (chain 1, a V's way back) are lighter."""
    text = "|".join(op_text(op, with_stage) for op in parts(item))
    if item.kind in (OpKind.FB, OpKind.REDUCE_GRAD):
        return Text(text, style=OP_STYLE[item.kind])
    style = (OP_STYLE if (item.chain, item.stage) == first_stage else SECOND_STYLE)[item.kind]
    return Text(text, style=style)


def op_grid(schedule: Schedule) -> Table:
    """Each rank's op sequence (order, not time) as a row of tokens, each naming its stage when a
    rank runs more than one (a V's two stages on one rank are otherwise both "F0")."""
    with_stage = any(len(schedule.local_stages(r)) > 1 for r in range(schedule.num_ranks))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", style="bold", no_wrap=True)
    grid.add_column()
    for r, ops in enumerate(schedule.ranks):
        first = schedule.local_stages(r)[0] if schedule.local_stages(r) else (-1, -1)
        row = Text()
        for item in ops:
            row.append_text(_token(item, first, with_stage))
            row.append(" ")
        grid.add_row(f"rank {r}", row)
    return grid


def metrics_table(result: SimResult, dp_sync: bool = False) -> Table:
    """Per-rank figures; with ``dp_sync``, each rank's exposed gradient-sync time (past its compute)."""
    title = f"{result.name}: makespan {result.makespan:g}, bubble rate {100 * result.bubble_rate:.2f} %"
    if dp_sync:
        title += f", exposed DP sync {max(result.dp_exposed, default=0.0):g}"
    table = Table(title=title)
    table.add_column("rank", justify="right")
    cols = ["busy", "makespan bubble", "span bubble", "peak activations"] + (["exposed DP sync"] if dp_sync else [])
    for col in cols:
        table.add_column(col, justify="right")
    for r in range(result.num_ranks):
        cells = [str(r), f"{result.busy[r]:g}", f"{result.makespan_bubble[r]:g}", f"{result.span_bubble[r]:g}",
                 str(result.peak_activations[r])]
        table.add_row(*cells, *([f"{result.dp_exposed[r]:g}"] if dp_sync else []))
    return table


def lower_bound_line(schedule: Schedule, makespan: float) -> str | None:
    """What a searched schedule's ``meta["lower_bound"]`` says: the bound and the makespan's gap to it."""
    bound = schedule.meta.get("lower_bound") if isinstance(schedule.meta, dict) else None
    if not isinstance(bound, (int, float)) or bound <= 0:
        return None
    return (f"lower bound {bound:g} (no order on this placement is faster, memory ignored); "
            f"makespan {makespan:g} is {gap_percent(makespan, bound):.2f} % above it")


def gap_percent(makespan: float, bound: float) -> float:
    return 100.0 * (makespan / bound - 1.0)


def cmd_show(args: argparse.Namespace) -> int:
    console = Console()
    plain = use_plain(console, args)
    schedule, costs = with_dp_sync(schedule_from_args(args), Costs.parse(args.costs), args.dp_sync, args.sync_at)
    result = simulate(schedule, costs)
    console.print(f"[bold]{schedule.name}[/] P={schedule.num_ranks} M={schedule.num_microbatches} "
                  f"costs: {costs.describe()}")
    reduce_note = "; R/s5: stage 5's data-parallel gradient reduction" if args.dp_sync is not None else ""
    console.print("[bold]order per rank[/] (F forward, B input-grad, W weight-grad, b full backward, F3|b5 F&B "
                  f"pair; /s5: the op's stage, where a rank runs two{reduce_note}):")
    console.print(op_grid(schedule))

    timeline = result.to_timeline()
    view = terminal_view(timeline, title=f"{schedule.name} timeline", metrics=result, plain=plain,
                         width=plain_width(timeline) if plain else None)
    (Console(width=plain_width(timeline)) if plain else console).print(view)
    console.print(metrics_table(result, dp_sync=args.dp_sync is not None))
    line = lower_bound_line(schedule, result.makespan)
    if line:
        console.print(line)
    return 0


# ----- compare -----------------------------------------------------------------------------------
@dataclass
class Compared:
    """One schedule of a comparison: simulated, or left out with the reason."""

    label: str
    name: str
    fraction: float = 1.0               # one stage's size relative to a rank's share of the model
    schedule: Schedule | None = None
    result: SimResult | None = None
    reason: str = ""
    at_end: SimResult | None = None     # with --dp-sync: the same schedule with every reduction at step end

    @property
    def peak(self) -> float:
        """The most loaded rank's peak activations, in full-size stages."""
        return max(self.result.peak_activations) * self.fraction if self.result else 0.0

    @property
    def lower_bound(self) -> float | None:
        meta = self.schedule.meta if self.schedule is not None else {}
        bound = meta.get("lower_bound") if isinstance(meta, dict) else None
        return bound if isinstance(bound, (int, float)) and bound > 0 else None


def exposed_sync(result: SimResult) -> float:
    """How much later the step ends because of its gradient reductions: the makespan past the compute's end."""
    compute_end = max((end - exp for end, exp in zip(result.rank_end, result.dp_exposed)), default=0.0)
    return max(0.0, result.makespan - compute_end) if result.dp_exposed else 0.0


def stage_fraction(schedule: Schedule) -> float:
    """The size of one stage relative to one rank's share of the model (1/v for v chunks per rank)."""
    return schedule.num_ranks / schedule.num_stages()


def compare_results(ranks: int, microbatches: int, costs: Costs, virtual_stages: int = 2,
                    include: set[str] | None = None, dp_sync: float | None = None) -> list[Compared]:
    """Every schedule, simulated on the same model for (P, M), or with the reason it cannot run.

    ``costs`` are those of one rank's share of the model (1/P of it); a schedule that cuts that
    share into v smaller stages (V shapes, interleaving) gets per-stage costs scaled by 1/v, so
    makespans compare like for like. DualPipe's two stages per rank are full-size copies.
    Searching schedules (``auto``) are tried only when named in ``include``; they search against
    those same scaled costs. ``dp_sync`` (per rank's share, scaled like the other costs) adds each
    stage's gradient reduction after its last W/BW (``result``) and, for contrast, all of them at
    the step's end (``at_end``).
    """
    out = []
    for info in list_schedules():
        if info.name in SEARCHING and not (include and info.name in include):
            continue
        opts = build_options(info.name, virtual_stages=virtual_stages)
        label = info.name + (f" (v={virtual_stages})" if opts else "")
        entry = Compared(label, info.name)
        try:
            entry.fraction = ranks / info.num_stages(ranks, **opts)
            scaled = costs.scaled(entry.fraction)
            entry.schedule = build_schedule(info.name, ranks, microbatches, **opts,
                                            **build_options(info.name, costs=scaled))
        except ScheduleError as exc:
            entry.reason = str(exc)
            out.append(entry)
            continue
        if dp_sync is None:
            entry.result = simulate(entry.schedule, scaled)
        else:
            sched, priced = with_dp_sync(entry.schedule, scaled, dp_sync * entry.fraction)
            entry.result = simulate(sched, priced)
            entry.at_end = simulate(add_grad_reduction(entry.schedule, "step_end"), priced)
        out.append(entry)
    return out


def ranked(rows: list[Compared]) -> list[Compared]:
    """The simulated schedules, fastest first (then the leanest): the order of the table and the image."""
    return sorted((r for r in rows if r.result), key=lambda r: (r.result.makespan, r.peak))


def _compare_table(rows: list[Compared], title: str) -> Table:
    """The comparison table: simulated schedules fastest first (★ the best), then those left out and why.

    Headers are single short words with a minimum width, so an 80-column pipe wraps cells instead
    of cutting headers; the unit of the peak is in the footnote, as under the image.
    """
    built = ranked(rows)
    best = built[0].result.makespan if built else None
    bounds = any(r.lower_bound for r in built)
    table = Table(title=title)
    table.add_column("schedule", justify="left", overflow="fold", ratio=1)
    sync = any(r.at_end for r in built)
    cols = ["makespan"] + (["sync at end", "exposed"] if sync else []) + ["bubble", "peak", "stages", "params"] + \
        (["bound (gap)"] if bounds else [])
    for col in cols:
        table.add_column(col, justify="right", min_width=max(len(w) for w in col.split()), no_wrap=False)
    for r in built:
        res = r.result
        mark = " ★" if res.makespan == best else ""
        cells = [f"{r.label}{mark}", f"{res.makespan:g}"]
        if sync:
            cells += [f"{r.at_end.makespan:g}", f"{exposed_sync(res):g}"]
        cells += [f"{100 * res.bubble_rate:.2f} %", f"{r.peak:g}", str(r.schedule.num_stages()),
                  f"{schedule_info(r.name).param_copies}×"]
        if bounds:
            cells.append(f"{r.lower_bound:g} (+{gap_percent(res.makespan, r.lower_bound):.1f} %)"
                         if r.lower_bound else "-")
        table.add_row(*cells, style="bold green" if mark else None)
    left_out = [r for r in rows if r.result is None]
    if left_out:
        table.add_section()
        for r in left_out:
            table.add_row(Text(f"{r.label}: not run, {r.reason}", style="dim"), *["-"] * len(cols))
    return table


def cmd_compare(args: argparse.Namespace) -> int:
    console = Console()
    costs = Costs.parse(args.costs)
    include = {"auto"} if args.auto else None
    rows = compare_results(args.ranks, args.microbatches, costs, args.virtual_stages or 2, include, args.dp_sync)
    built = ranked(rows)
    if not built:
        reasons = "; ".join(f"{r.label}: {r.reason}" for r in rows)
        raise ScheduleError(f"no schedule accepts P={args.ranks}, M={args.microbatches} ({reasons})")
    console.print(_compare_table(rows, f"P={args.ranks} ranks, M={args.microbatches} micro-batches, "
                                       f"costs {costs.describe()}"))
    console.print(f"★ lowest makespan. Costs are per rank's share of the model; schedules with smaller stages get "
                  f"proportionally smaller per-stage costs. {PEAK_UNIT[0].upper()}{PEAK_UNIT[1:]}. params: parameter "
                  "copies per rank.")
    if args.dp_sync is not None:
        console.print(f"--dp-sync {args.dp_sync:g}: makespan with each stage's gradient reduction right after its last "
                      "W/BW (overlapping the rest of the drain); sync at end: the same reductions after the step; "
                      "exposed: how much later the overlapped step ends than its compute.")
    if args.output:
        best = min(r.result.makespan for r in built)
        entries = [ComparisonEntry(r.label, r.result, r.fraction, r.result.makespan == best) for r in built]
        notes = f"★ lowest makespan · {PEAK_UNIT}"
        left_out = [r.label for r in rows if r.result is None]
        if left_out:
            notes += f" · not run (see the table): {', '.join(left_out)}"
        path = render_comparison(args.output, entries, notes=notes,
                                 title=f"P={args.ranks}, M={args.microbatches}, costs {costs.describe()}")
        console.print(f"wrote {path}")
    return 0


# ----- export ------------------------------------------------------------------------------------
def export_format(path: Path, fmt: str | None) -> str:
    """``--format`` if given, else the file's extension; ``ScheduleError`` naming the allowed ones."""
    if fmt is not None:
        return fmt
    ext = path.suffix.lower().lstrip(".")
    if ext not in EXPORT_FORMATS:
        raise ScheduleError(f"cannot tell the format of {str(path)!r} from its extension "
                            f"{('.' + ext) if ext else '(none)'}: use a file ending in "
                            f"{' or '.join('.' + f for f in EXPORT_FORMATS)}, or give --format json|csv")
    return ext


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.output)
    fmt = export_format(out, args.format)
    schedule = schedule_from_args(args)
    validate_program(lower(schedule))
    if fmt == "csv":
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
    p.add_argument("--plain", action="store_true",
                   help="text without colour (the default when the output is not a terminal)")
    add_dp_sync_args(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("compare", help="simulate every schedule that accepts P and M, side by side")
    add_schedule_args(p, name=False)
    p.add_argument("-o", "--output", default=None, help="also draw them stacked on one time scale (.svg/.png)")
    p.add_argument("--auto", action="store_true",
                   help="also search the auto schedule for these costs (seconds), with its lower bound")
    add_dp_sync_args(p, when=False)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("export", help="save a schedule as JSON (mt-dualpipe.schedule/1) or pipelining CSV")
    add_schedule_args(p)
    p.add_argument("-o", "--output", required=True, help="output file (.json or .csv)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default=None, help="default: from the file extension")
    p.set_defaults(func=cmd_export)
