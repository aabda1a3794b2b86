"""``auto`` against the hand schedules and against its own exact backend, over a grid of cost profiles.

For every placement (linear, v, dual), P in {4, 8} and profile (uniform; heavy first stage:
embedding; heavy last stage: head + loss + MTP; point-to-point latency; exposed expert all-to-all
of 0.5 and 1.0 of F), under the memory of the placement's reference hand schedule (zb-h1: P,
dualpipev: 2P + 1, dualpipe: P + 1), it prints one table: the best hand schedule that fits, the
default heuristic ``auto`` (deterministic, seed 0) and ``auto`` with ``solver="cpsat"`` (warm-started
from the heuristic, ``--cpsat-time`` seconds), the proven lower bound, each one's gap to it, and
the times. Pure Python (no torch); CP-SAT needs ``pip install mt_dualpipe[solver]``::

    python benchmarks/auto_schedule.py --quick          # 5 s per CP-SAT solve, P=4 only
    python benchmarks/auto_schedule.py --cpsat-time 60  # the full grid
    python benchmarks/auto_schedule.py --ranks 8 --cpsat-time 0 --chains 3   # P=8, three hand chains
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

REFERENCE = {"linear": "zb-h1", "v": "dualpipev", "dual": "dualpipe"}
"""The hand schedule whose peak memory sets the limit of each placement's rows."""


def profiles(S: int) -> dict[str, Costs]:
    """Cost profiles for a chain of ``S`` stages (per-stage lists indexed by position in the chain)."""
    def heavy(pos: int, k: float) -> list[float]:
        v = [1.0] * S
        v[pos] = k
        return v

    return {
        "uniform": Costs(1, 1, 1),
        "heavy first x1.5": Costs(heavy(0, 1.5), heavy(0, 1.5), 1),
        "heavy last x2": Costs(heavy(-1, 2.0), heavy(-1, 2.0), heavy(-1, 2.0)),
        "latency 0.3": Costs(1, 1, 1, comm=0.3),
        "a2a 0.5F": Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5),
        "a2a 1.0F": Costs(1, 1, 1, a2a_f=1.0, a2a_b=1.0),
    }


def best_hand(placement: str, P: int, M: int, costs: Costs, limit: int) -> tuple[str, float]:
    """The fastest hand schedule of the placement within ``limit`` activations per rank."""
    best = ("-", float("inf"))
    for name in HAND_SCHEDULES[placement]:
        try:
            res = simulate(build_schedule(name, P, M), costs)
        except ScheduleError:
            continue
        if max(res.peak_activations) <= limit and res.makespan < best[1]:
            best = (name, res.makespan)
    return best


def row(placement: str, P: int, M: int, label: str, costs: Costs, cpsat_time: float | None,
        search: dict | None = None) -> list[str]:
    """One table row; ``search``: extra options of both ``auto`` builds (``chains``, ``workers``)."""
    search = search or {}
    ref = simulate(build_schedule(REFERENCE[placement], P, M), costs)
    limit = max(ref.peak_activations)
    hand, hand_ms = best_hand(placement, P, M, costs, limit)
    t0 = time.perf_counter()
    heur = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=limit, **search)
    t_heur = time.perf_counter() - t0
    h_ms = simulate(heur, costs).makespan
    assert h_ms <= hand_ms + 1e-9 and h_ms == heur.meta["makespan"]
    bound, cp_ms, t_cp, status = heur.meta["lower_bound"], float("nan"), 0.0, "-"
    if cpsat_time:
        t0 = time.perf_counter()
        exact = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=limit,
                               solver="cpsat", time_limit=cpsat_time, **search)
        t_cp = time.perf_counter() - t0
        cp_ms = simulate(exact, costs).makespan  # re-checked by the simulator
        assert cp_ms <= h_ms + 1e-9 and max(simulate(exact, costs).peak_activations) <= limit
        bound, status = exact.meta["lower_bound"], exact.meta["solver_status"].lower()
    best = min(h_ms, cp_ms) if cpsat_time else h_ms
    return [placement, str(P), str(M), label, str(limit), f"{hand} {hand_ms:.1f}", f"{h_ms:.1f}",
            f"{1 - h_ms / hand_ms:+.1%}", f"{t_heur:.1f}", f"{cp_ms:.1f}" if cpsat_time else "-",
            f"{t_cp:.1f}" if cpsat_time else "-", status, f"{bound:.1f}", f"{h_ms / bound - 1:.1%}",
            f"{best / bound - 1:.1%}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8", help="comma-separated P values")
    ap.add_argument("--microbatches", type=int, default=None, help="M (default: 16 at P=4, 24 at P=8, else 3P)")
    ap.add_argument("--placements", default="linear,v,dual")
    ap.add_argument("--profiles", default=None, help="comma-separated profile names (default: all)")
    ap.add_argument("--cpsat-time", type=float, default=60.0, help="seconds per CP-SAT solve (0: skip CP-SAT)")
    ap.add_argument("--quick", action="store_true", help="P=4 only, 5 s per CP-SAT solve")
    ap.add_argument("--chains", type=int, default=1, help="auto's annealing chains from the best hand schedule")
    ap.add_argument("--workers", type=int, default=None, help="processes auto may use (default: one per chain + 1)")
    args = ap.parse_args(argv)
    ranks = [4] if args.quick else [int(x) for x in args.ranks.split(",")]
    cpsat_time = 5.0 if args.quick else args.cpsat_time
    table = Table(title="auto: heuristic and CP-SAT vs the best hand schedule (memory of the reference hand schedule)")
    for col in ("placement", "P", "M", "costs", "mem", "best hand", "heuristic", "vs hand", "heur s", "cp-sat",
                "cp s (+heur)", "status", "bound", "heur gap", "best gap"):
        table.add_column(col, justify="left" if col in ("placement", "costs", "best hand", "status") else "right")
    for P in ranks:
        M = args.microbatches or {4: 16, 8: 24}.get(P, 3 * P)
        for placement in args.placements.split(","):
            S = 2 * P if placement == "v" else P
            for label, costs in profiles(S).items():
                if args.profiles and label not in args.profiles.split(","):
                    continue
                table.add_row(*row(placement, P, M, label, costs, cpsat_time,
                                   {"chains": args.chains, "workers": args.workers}))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    console.print("heur gap / best gap: the heuristic's / the best schedule's makespan above the proven lower "
                  "bound (the solver's bound with CP-SAT, else the work-and-path bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
