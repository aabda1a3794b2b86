"""PP2 x DP2 on 4 local gloo ranks: the data-parallel sync after each stage's last W vs after the step.

For each schedule the same pipeline runs with its ``REDUCE_GRAD`` ops placed ``when="last_w"``
(right after each stage's last W/BW: the reduction overlaps the rest of the drain) and
``when="step_end"`` (after the rank's last op: what a sync after ``step()`` does). Reported: the
median step time (slowest rank), the measured blocking cost of one stage's reduction (``dp_sync``),
the simulator's exposed sync (``simulate(...).dp_exposed``, max over ranks) for each placement and the
measured one (per rank, how long its last ``REDUCE_GRAD`` completed after its last compute op in the
recorded timeline, max over ranks, median of 5 recorded steps: what the planner's DP-sync estimate
claims to predict),
with ``Costs(f, b, w)`` measured from a recorded timeline of the same run and ``dp_sync`` measured.
Four processes share the machine's cores: on 2 cores the collectives compete with compute for CPU,
so the measured difference is small and noisy; the simulator says what a machine with a core per
rank would show.

    python benchmarks/hybrid_step.py [--hidden 256] [--rows 32] [--chunks 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe.parallel import init_parallel  # noqa: E402
from mt_dualpipe.runtime import Pipeline, defer_weight_grads  # noqa: E402
from mt_dualpipe.schedules import Costs, add_grad_reduction, build_schedule, simulate  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402

SCHEDULES = ("zb-h1", "zbv", "dualpipe")
RECORDED = 5  # recorded steps whose measured exposed sync is reported (median)


def _stage(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return defer_weight_grads(nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)))


def _run(pipe: Pipeline, dims, sched, x: torch.Tensor) -> None:
    pp = dims.coord("pp")
    first = [c for c, ch in enumerate(sched.placement) if ch[0] == pp]
    last = [c for c, ch in enumerate(sched.placement) if ch[-1] == pp]
    part = x.chunk(len(sched.placement))
    pipe.step(*((part[first[0]],) if first else ()), num_chunks=sched.num_microbatches,
              criterion=(lambda o, t: ((o - t) ** 2).mean()) if last else None,
              labels=(part[last[0]],) if last else ())


def _measure(rank: int, world: int, name: str, when: str, args) -> dict:
    dims = init_parallel(pp=2, dp=2)
    sched = add_grad_reduction(build_schedule(name, 2, args.chunks), when=when)
    pp = dims.coord("pp")
    local = sched.local_stages(pp)
    pipe = Pipeline([_stage(args.hidden, s) for _, s in local], sched, mesh=dims, dp_batch="local")
    x = torch.randn(args.rows, args.hidden)
    times = []
    for i in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        _run(pipe, dims, sched, x)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            times.append(t.item())
    pipe.record_timeline = True
    exposed = []  # one recorded step is too noisy on shared cores: the median of RECORDED steps
    for _ in range(RECORDED):
        dist.barrier()
        _run(pipe, dims, sched, x)
        if pipe.timeline is not None:
            exposed.append(_measured_exposed(pipe.timeline.events))
    syncs = []
    # the sync of this rank's lowest stage: DualPipe's mirrored stage 0 shares one group across the pp ranks
    sync = pipe.grad_syncs[min(pipe.grad_syncs, key=lambda cs: cs[1])]
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        sync.start()
        sync.wait()
        syncs.append(time.perf_counter() - t0)
    out = {"step": statistics.median(times), "dp_sync": statistics.median(syncs)}
    if pipe.timeline is not None:
        ev = [e for e in pipe.timeline.events if e.lane == "compute"]
        out["costs"] = {k: statistics.mean(e.duration for e in ev if e.op == k) for k in ("F", "B", "W")
                        if any(e.op == k for e in ev)}
        out["exposed"] = statistics.median(exposed)
    return out


def _measured_exposed(events) -> float:
    """The measured counterpart of ``dp_exposed``: per rank, how long the last reduction completed after
    the rank's last compute op (0 when the drain hid it), max over the ranks."""
    worst = 0.0
    for rank in {e.rank for e in events}:
        compute = [e.end for e in events if e.rank == rank and e.lane == "compute"]
        reduces = [e.end for e in events if e.rank == rank and e.lane == "comm" and e.op == "REDUCE_GRAD"]
        if compute and reduces:
            worst = max(worst, max(reduces) - max(compute))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"PP2 x DP2, 4 gloo ranks on {os.cpu_count()} cores, hidden {args.hidden}, "
                        f"{args.rows} rows/replica, M={args.chunks}")
    for col in ("schedule", "sync placed", "step ms (median, slowest rank)", "dp_sync ms per stage (measured)",
                "simulated exposed sync ms", "measured exposed sync ms (timeline)", "simulated makespan ms"):
        table.add_column(col, justify="right")
    for name in SCHEDULES:
        runs = {when: run_ranks(_measure, 4, name, when, args, timeout=600) for when in ("last_w", "step_end")}
        # one set of costs for both placements (the mean of the two runs), so the simulations differ by
        # the placement of the REDUCE_GRAD ops alone
        measured = [next(r["costs"] for r in res if "costs" in r) for res in runs.values()]
        costs = {k: statistics.mean(c.get(k, 0.0) for c in measured) for k in ("F", "B", "W")}
        dp_sync = statistics.mean(r["dp_sync"] for res in runs.values() for r in res)
        for when, res in runs.items():
            sched = add_grad_reduction(build_schedule(name, 2, args.chunks), when=when)
            sim = simulate(sched, Costs(f=costs["F"], b=costs["B"], w=costs["W"], dp_sync=dp_sync))
            table.add_row(name, when, f"{1e3 * max(r['step'] for r in res):.1f}", f"{1e3 * dp_sync:.2f}",
                          f"{1e3 * max(sim.dp_exposed):.2f}",
                          f"{1e3 * max(r.get('exposed', 0.0) for r in res):.2f}", f"{1e3 * sim.makespan:.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
