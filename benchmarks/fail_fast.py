"""Fail fast: how long after one rank raises every rank of the pipeline has raised too.

Local gloo ranks (2, then 4), ``torch.set_num_threads(1)``, one small linear stage per stage
(``tests/helpers/faulty.py``), the pipeline's timeout at 60 s (what a stalled rank used to wait).
For each case one rank raises in its F, B or W of one micro-batch, or while its step splits its
labels (a batch whose split raises an error no check foresees); reported over ``--reps`` failed
steps: the time from the raise (``time.time()`` on the failing rank) to the moment the last rank
caught its ``PipelineError`` (median and max), and whether the next step of the same pipeline gave
the gradients of a clean step every time. The clean step's median time is shown beside it.

    python benchmarks/fail_fast.py [--ranks 2,4] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tests.helpers.dist import run_ranks  # noqa: E402
from tests.helpers.faulty import Faulty, Unsplittable  # noqa: E402

DIM = 64
TIMEOUT = 60.0


def _cases(world: int) -> list[tuple]:
    """(label, schedule, failing rank, op, its local module, the n-th call that raises, num_chunks)."""
    last, m = world - 1, 2 * world
    return [("1F1B, F on rank 0", "1f1b", 0, "F", 0, 1, m),
            (f"1F1B, BW on rank {last}", "1f1b", last, "B", 0, 0, m),
            (f"1F1B, splitting the labels on rank {last}", "1f1b", last, "labels", 0, 0, m),
            ("ZB-V, last W of rank 0", "zbv", 0, "W", 0, m - 1, m),
            (f"ZB-V, B on rank {last}", "zbv", last, "B", 0, 1, m),
            (f"DualPipeV, F on rank {last}", "dualpipev", last, "F", 1, 2, m),
            ("DualPipeV, last W of rank 0", "dualpipev", 0, "W", 0, m - 1, m)]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _case(rank: int, world: int, case: tuple, reps: int) -> dict:
    from mt_dualpipe import DualPipeV, Pipeline
    from mt_dualpipe.runtime import PipelineError

    _, sched, frank, op, module, n, chunks = case
    stages = [rank] if sched == "1f1b" else [rank, 2 * world - 1 - rank]
    mods = []
    for s in stages:
        torch.manual_seed(s)
        mods.append(Faulty(DIM))
    pipe = DualPipeV(tuple(mods), timeout=TIMEOUT) if sched == "dualpipev" else Pipeline(mods, sched, timeout=TIMEOUT)
    x, y = torch.randn(4 * chunks, DIM), torch.randn(4 * chunks, DIM)
    bad_y = y.as_subclass(Unsplittable) if rank == frank and op == "labels" else y

    def step(labels: torch.Tensor) -> float:
        t = time.perf_counter()
        pipe.step(*((x,) if pipe.needs_inputs else ()), num_chunks=chunks, criterion=_mse,
                  labels=(labels,) if pipe.needs_labels else ())
        return time.perf_counter() - t

    clean = [step(y) for _ in range(3)]  # gradients accumulate over the three
    reference = [p.grad.clone() for p in pipe.parameters()]
    out: dict = {"raised": [], "caught": [], "same": True, "clean": clean}
    for _ in range(reps):
        pipe.zero_grad()
        if rank == frank and op != "labels":
            mods[module].arm(op, n)
        start = time.time()
        try:
            step(bad_y)
        except PipelineError:
            pass
        out["caught"].append(time.time())
        out["raised"].append(start if op == "labels" else mods[module].raised_at)
        pipe.zero_grad()
        for _ in range(3):
            out["clean"].append(step(y))
        out["same"] &= all(torch.equal(a, p.grad) for a, p in zip(reference, pipe.parameters()))
    return out


def _worker(rank: int, world: int, reps: int) -> list[dict]:
    return [_case(rank, world, case, reps) for case in _cases(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated numbers of ranks, one run each")
    ap.add_argument("--reps", type=int, default=5, help="failed steps per case")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Time from one rank's raise to every rank's PipelineError, gloo on {os.cpu_count()} cores, "
                        f"pipeline timeout {TIMEOUT:g} s")
    for col in ("ranks", "case", "to every rank's error, median ms", "max ms", "next step as a clean one",
                "clean step ms"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for world in (int(r) for r in args.ranks.split(",")):
        per_rank = run_ranks(_worker, world, args.reps, timeout=600)
        for i, case in enumerate(_cases(world)):
            frank = case[2]
            raised = per_rank[frank][i]["raised"]
            spans = [max(res[i]["caught"][k] for res in per_rank) - raised[k] for k in range(args.reps)]
            clean = max(statistics.median(res[i]["clean"]) for res in per_rank)
            table.add_row(str(world), case[0], f"{1e3 * statistics.median(spans):.0f}", f"{1e3 * max(spans):.0f}",
                          "yes" if all(res[i]["same"] for res in per_rank) else "NO", f"{1e3 * clean:.1f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
