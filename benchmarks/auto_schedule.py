"""The ``auto`` schedule against the hand schedules, each at the hand schedule's own peak memory.

For a grid of cost profiles (uniform; a heavy last stage: head + loss + MTP; an embedding-heavy
first stage; point-to-point latency; exposed MoE all-to-all; a mix) and every placement, build
each hand schedule, read its peak activations, search ``auto`` under exactly that memory limit and
print both makespans, the gain, auto's bubble rate and the lower bound (max over ranks of its work
plus the unavoidable start-up and drain). Pure Python (no torch)::

    python benchmarks/auto_schedule.py --ranks 8 --microbatches 24 --time-budget 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, simulate  # noqa: E402
from mt_dualpipe.schedules.auto import HAND_SCHEDULES  # noqa: E402


def profiles(S: int) -> dict[str, Costs]:
    """Cost profiles for a chain of ``S`` stages (per-stage lists indexed by position in the chain)."""
    def heavy(pos: int, k: float) -> list[float]:
        v = [1.0] * S
        v[pos] = k
        return v

    return {
        "uniform": Costs(1, 1, 1),
        "heavy last x2": Costs(heavy(-1, 2.0), heavy(-1, 2.0), heavy(-1, 2.0)),
        "heavy first x1.5": Costs(heavy(0, 1.5), heavy(0, 1.5), 1),
        "p2p 0.3": Costs(1, 1, 1, comm=0.3),
        "a2a 1:1": Costs(1, 1, 1, a2a_f=1.0, a2a_b=1.0),
        "mixed": Costs(heavy(-1, 1.8), heavy(-1, 1.6), 0.7, comm=0.1, a2a_f=0.3, a2a_b=0.3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=24)
    ap.add_argument("--time-budget", type=float, default=3.0, help="seconds per auto search")
    ap.add_argument("--placements", default="linear,v,dual")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    P, M = args.ranks, args.microbatches
    table = Table(title=f"auto vs hand schedules at equal peak memory, P={P}, M={M}")
    for col in ("placement", "costs", "hand", "peak", "hand makespan", "auto makespan", "gain", "auto bubble",
                "lower bound", "auto / LB", "search s"):
        table.add_column(col, justify="left" if col in ("placement", "costs", "hand") else "right")
    wins = rows = 0
    for placement in args.placements.split(","):
        S = 2 * P if placement == "v" else P
        for label, costs in profiles(S).items():
            for hand in HAND_SCHEDULES[placement]:
                try:
                    ref = simulate(build_schedule(hand, P, M), costs)
                except ScheduleError:
                    continue
                peak = max(ref.peak_activations)
                t0 = time.perf_counter()
                sched = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=peak,
                                       seed=args.seed, time_budget=args.time_budget)
                took = time.perf_counter() - t0
                got = simulate(sched, costs)
                assert max(got.peak_activations) <= peak
                gain = 1 - got.makespan / ref.makespan
                lb = sched.meta["lower_bound"]
                rows += 1
                wins += gain > 1e-9
                table.add_row(placement, label, hand, str(peak), f"{ref.makespan:.1f}", f"{got.makespan:.1f}",
                              f"{gain:+.1%}", f"{got.bubble_rate:.1%}", f"{lb:.1f}", f"{got.makespan / lb:.3f}",
                              f"{took:.1f}", style="bold green" if gain > 1e-9 else None)
    console = Console()
    if console.width < 130:
        console = Console(width=130)
    console.print(table)
    console.print(f"auto is faster in {wins} of {rows} comparisons and never slower (it keeps the hand schedule "
                  "as a candidate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
