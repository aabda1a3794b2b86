"""``auto``'s time per call and its quality on the held-out cost profiles, side by side with a revision before.

The held-out set: at P = 8, M = 24, each placement (dual, v, linear) under the memory of its reference
hand schedule (DualPipe: P + 1, DualPipeV: 2P + 1, ZB-H1: P) with the eight profiles of
``held_out_profiles``: the six of ``auto_schedule.profiles`` and two no constant of ``auto`` was tuned
on (uneven stages with latency and all-to-all; heavy first and last stages with both). 24 profiles.

Per profile it prints the best known makespan (``results/auto_best_known.json``: the best of every run
made, which runs found it), ``auto``'s makespan at each seed asked for, the gap above the best known
(the largest over the seeds) and the time per call: wall clock, and the CPU seconds of this process
and of the child process that runs ``auto``'s hand chain (``time.process_time`` and
``RUSAGE_CHILDREN``), since on a shared machine the wall clock says more about the neighbours than
about ``auto``. Wall on an idle two-core machine is about the larger of the two CPU figures.

``--before REV`` runs the same calls on a revision of the package taken from git (``git archive``;
``115892a`` is the last one before this benchmark's changes), in a subprocess, and prints its figures
in the same rows. ``--large`` adds the time per call at P = 16, M = 64 for four profiles. Pure Python::

    python benchmarks/auto_speed.py                          # seed 0, this revision
    python benchmarks/auto_speed.py --seeds 0,1,2,3 --before 115892a --large
    python benchmarks/auto_speed.py --update                 # record better makespans as best known
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEST_KNOWN = ROOT / "benchmarks" / "results" / "auto_best_known.json"
REFERENCE = {"linear": "zb-h1", "v": "dualpipev", "dual": "dualpipe"}
"""The hand schedule whose peak memory sets the limit of each placement's rows."""
LARGE = [("dual", "latency 0.3"), ("dual", "a2a 0.5F"), ("v", "latency 0.3"), ("v", "a2a 0.5F")]
"""The profiles timed at P = 16, M = 64 with ``--large``."""


def held_out_profiles(S: int) -> dict:
    """The eight cost profiles for a chain of ``S`` stages (per-stage lists indexed by position in the chain)."""
    from mt_dualpipe.schedules import Costs

    def heavy(pos: int, k: float) -> list[float]:
        v = [1.0] * S
        v[pos] = k
        return v

    rng = random.Random(7)

    def mixed() -> list[float]:
        return [round(rng.uniform(0.75, 1.25), 2) for _ in range(S)]

    ends = [1.0] * S
    ends[0], ends[-1] = 1.5, 2.0
    return {
        "uniform": Costs(1, 1, 1),
        "heavy first x1.5": Costs(heavy(0, 1.5), heavy(0, 1.5), 1),
        "heavy last x2": Costs(heavy(-1, 2.0), heavy(-1, 2.0), heavy(-1, 2.0)),
        "latency 0.3": Costs(1, 1, 1, comm=0.3),
        "a2a 0.5F": Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5),
        "a2a 1.0F": Costs(1, 1, 1, a2a_f=1.0, a2a_b=1.0),
        "mixed stages": Costs(mixed(), mixed(), mixed(), comm=0.1, a2a_f=0.3, a2a_b=0.3),
        "heavy ends a2a": Costs(ends, ends, 1, comm=0.2, a2a_f=0.5, a2a_b=0.5),
    }


def run_calls(calls: list[tuple[str, str, int, int, int]], progress: bool = False) -> list[dict]:
    """``auto`` on each (placement, profile, P, M, seed) with the package importable now: makespan and times
    (``progress``: each as a line on stderr as it ends)."""
    from mt_dualpipe.schedules import build_schedule, simulate

    out = []
    for placement, label, P, M, seed in calls:
        costs = held_out_profiles(2 * P if placement == "v" else P)[label]
        limit = max(simulate(build_schedule(REFERENCE[placement], P, M), costs).peak_activations)
        wall, cpu = time.perf_counter(), time.process_time()
        child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        sched = build_schedule("auto", P, M, costs=costs, placement=placement, memory_limit=limit, seed=seed)
        out.append({"placement": placement, "label": label, "P": P, "M": M, "seed": seed,
                    "makespan": sched.meta["makespan"], "wall": time.perf_counter() - wall,
                    "cpu": time.process_time() - cpu,
                    "child": resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - child})
        if progress:
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        assert simulate(sched, costs).makespan == sched.meta["makespan"]
        assert max(simulate(sched, costs).peak_activations) <= limit
    return out


def run_before(rev: str, calls: list) -> list[dict]:
    """``run_calls`` on the package as it was at git revision ``rev``, in a subprocess."""
    with tempfile.TemporaryDirectory(prefix="auto_before_") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "mt_dualpipe"], check=True,
                                 capture_output=True).stdout
        tar_path = Path(tmp) / "pkg.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": tmp}
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
                "import auto_speed; print(json.dumps(auto_speed.run_calls(json.loads(sys.argv[3]), True)))")
        got = subprocess.run([sys.executable, "-c", code, tmp, str(ROOT / "benchmarks"), json.dumps(calls)],
                             check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
        return json.loads(got.stdout.strip().splitlines()[-1])


def _key(row: dict) -> str:
    return f"{row['placement']} P={row['P']} M={row['M']} {row['label']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (the gap is the largest over them)")
    ap.add_argument("--before", default=None, help="git revision to run side by side (e.g. 115892a)")
    ap.add_argument("--large", action="store_true", help="also time P=16, M=64 (four profiles)")
    ap.add_argument("--large-only", action="store_true", help="only the P=16, M=64 calls")
    ap.add_argument("--placements", default="dual,v,linear")
    ap.add_argument("--update", action="store_true", help="record better makespans in the best-known file")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from rich.console import Console
    from rich.table import Table

    seeds = [int(x) for x in args.seeds.split(",")]
    calls = [] if args.large_only else [(pl, label, 8, 24, s) for s in seeds for pl in args.placements.split(",")
                                        for label in held_out_profiles(8)]
    if args.large or args.large_only:
        calls += [(pl, label, 16, 64, s) for s in seeds[:1] for pl, label in LARGE]
    now = run_calls(calls)
    before = run_before(args.before, calls) if args.before else []
    best = json.loads(BEST_KNOWN.read_text()) if BEST_KNOWN.exists() else {}
    for row in now + before:
        known = best.get(_key(row))
        if known is None or row["makespan"] < known["makespan"] - 1e-9:
            best[_key(row)] = {"makespan": row["makespan"], "found_by": f"auto_speed seed {row['seed']}"
                               + (" (before)" if row in before else "")}
    if args.update:
        BEST_KNOWN.write_text(json.dumps(dict(sorted(best.items())), indent=1) + "\n")
    table = Table(title="auto on the held-out profiles: makespan, gap above the best known, seconds per call")
    for col in ("placement", "P", "M", "costs", "best known", "auto", "gap", "wall s", "cpu s", "child cpu s",
                *(("before", "gap before", "wall s before", "cpu s before", "child before") if before else ())):
        table.add_column(col, justify="left" if col in ("placement", "costs") else "right")
    over = 0
    for key in dict.fromkeys(_key(r) for r in now):
        rows = [r for r in now if _key(r) == key]
        old = [r for r in before if _key(r) == key]
        ref = best[key]["makespan"]
        gap = max(r["makespan"] for r in rows) / ref - 1
        over += gap > 0.01 + 1e-12 and rows[0]["P"] == 8
        cells = [rows[0]["placement"], str(rows[0]["P"]), str(rows[0]["M"]), rows[0]["label"], f"{ref:.2f}",
                 " ".join(f"{r['makespan']:.2f}" for r in rows), f"{gap:.2%}",
                 f"{max(r['wall'] for r in rows):.1f}", f"{max(r['cpu'] for r in rows):.1f}",
                 f"{max(r['child'] for r in rows):.1f}"]
        if before:
            cells += [" ".join(f"{r['makespan']:.2f}" for r in old), f"{max(r['makespan'] for r in old) / ref - 1:.2%}",
                      f"{max(r['wall'] for r in old):.1f}", f"{max(r['cpu'] for r in old):.1f}",
                      f"{max(r['child'] for r in old):.1f}"]
        table.add_row(*cells)
    console = Console(width=max(Console().width, 180))
    console.print(table)
    mid = [r for r in now if r["P"] == 8]
    if not mid:
        return 0
    console.print(f"P=8, M=24: {len({_key(r) for r in mid}) - over} of {len({_key(r) for r in mid})} profiles within "
                  f"1 % of the best known at every seed run; the slowest call took {max(r['wall'] for r in mid):.1f} s "
                  f"wall, {max(r['cpu'] for r in mid):.1f} s CPU here and {max(r['child'] for r in mid):.1f} s in its "
                  f"child (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
