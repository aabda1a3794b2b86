"""Runtime step time: mt_dualpipe beside torch.distributed.pipelining, same model, same M.

4 local gloo ranks, ``torch.set_num_threads(1)``. For DualPipeV, ZB-V and 1F1B it reports the
median step time (slowest rank) and the mean CPU time per rank per step of both runtimes, and, for
mt_dualpipe, the step time against the makespan the simulator predicts from the per-op costs
measured in the same run (the runtime's overhead), with that overhead per instruction.

    python benchmarks/runtime_step.py [--ranks 4] [--chunks 8] [--hidden 256] [--rows 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROUNDS = 3
PAIRS = [("dualpipev", "ScheduleDualPipeV"), ("zbv", "ScheduleZBVZeroBubble"), ("1f1b", "Schedule1F1B")]


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def loss_fn(out, target):
    return F.mse_loss(out, target)


def _timed(step, steps: int, group) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(steps):
        dist.barrier(group)
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


def _mt(name, rank, P, blocks, x, y, M, steps):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.schedules import build_schedule

    sched = build_schedule(name, P, M)
    mods = [copy.deepcopy(blocks[s]) for _, s in sched.local_stages(rank)]
    pipe = Pipeline(mods, sched)
    first, last = sched.placement[0][0] == rank, sched.placement[0][-1] == rank

    def step():
        pipe.step(*((x,) if first else ()), num_chunks=M, criterion=loss_fn, labels=(y,) if last else ())
        for m in mods:
            m.zero_grad(set_to_none=True)

    def record():
        pipe.record_timeline = True
        step()
        pipe.record_timeline = False
        return pipe.timeline

    return step, record, sched


def _torch(cls_name, rank, P, blocks, x, y, M, steps):
    from torch.distributed import pipelining as pp

    v = cls_name != "Schedule1F1B"
    idx = [rank, 2 * P - 1 - rank] if v else [rank]
    n = 2 * P if v else P
    stages = [pp.PipelineStage(copy.deepcopy(blocks[i]), i, n, torch.device("cpu")) for i in idx]
    cls = getattr(pp, cls_name)
    sched = cls(stages if v else stages[0], M, loss_fn=loss_fn, scale_grads=False)
    first, last = rank == 0, rank == (0 if v else P - 1)

    def step():
        kwargs = {}
        if last:
            kwargs = {"target": y, "losses": []}
        sched.step(*((x,) if first else ()), **kwargs)
        for s in stages:
            s.submod.zero_grad(set_to_none=True)

    return step


def _costs_from(timeline):
    """Median measured seconds of F, B, W and BW (an FB unit counts as F + BW here: no overlap on CPU)."""
    from mt_dualpipe.schedules import Costs

    by = {}
    for e in timeline.compute_events():
        by.setdefault(e.op, []).append(e.duration)
    med = {k: statistics.median(v) for k, v in by.items()}
    f = med.get("F", 0.0)
    bw = med.get("BW", med.get("B", 0.0) + med.get("W", 0.0))
    b = med.get("B", bw / 2)
    w = med.get("W", bw - b)
    fb = med.get("FB", f + b + w)
    return Costs(f, b, w, fb=fb)


def worker(rank, P, port, M, hidden, rows, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    blocks = [Block(hidden) for _ in range(2 * P)]
    x = torch.randn(M * rows, hidden)
    y = torch.randn(M * rows, hidden)
    rows_out = []
    for name, tname in PAIRS:
        mt_step, record, sched = _mt(name, rank, P, blocks if name != "1f1b" else blocks[:P], x, y, M, steps)
        torch_step = _torch(tname, rank, P, blocks if name != "1f1b" else blocks[:P], x, y, M, steps)
        for _ in range(2):
            mt_step()
            torch_step()
        mw, mc, tw, tc = [], [], [], []
        for _ in range(ROUNDS):  # interleaved rounds: both runtimes see the same machine load
            w, c = _timed(mt_step, steps, None)
            mw += w
            mc += c
            w, c = _timed(torch_step, steps, None)
            tw += w
            tc += c
        timeline = record()
        stats = torch.tensor([mw, mc, tw, tc], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(P)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            g = torch.stack(gathered)  # rank, metric, step
            wall_m, wall_t = g[:, 0].max(0).values, g[:, 2].max(0).values
            cpu_m, cpu_t = g[:, 1].mean(0), g[:, 3].mean(0)
            from mt_dualpipe.schedules import lower, simulate

            sim = simulate(sched, _costs_from(timeline)).makespan
            n_ins = max(len(r) for r in lower(sched).ranks)
            med_m = wall_m.median().item()
            rows_out.append({"schedule": name, "torch": tname, "mt_step_ms": med_m * 1e3,
                             "torch_step_ms": wall_t.median().item() * 1e3,
                             "mt_cpu_ms": cpu_m.median().item() * 1e3, "torch_cpu_ms": cpu_t.median().item() * 1e3,
                             "sim_ms": sim * 1e3, "instructions": n_ins,
                             "overhead_per_instruction_ms": max(0.0, med_m - sim) / n_ins * 1e3})
    if rank == 0:
        out.put(rows_out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args.chunks, args.hidden, args.rows, args.steps, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = q.get(timeout=900)
    for p in procs:
        p.join()

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"step time, {args.ranks} gloo ranks, M={args.chunks}, hidden={args.hidden}, "
                    f"{args.rows} rows/micro-batch, 1 thread, median of {ROUNDS} x {args.steps} steps, interleaved")
    for col in ("schedule", "mt step ms", "torch step ms", "mt CPU ms/rank", "torch CPU ms/rank", "CPU mt/torch",
                "simulated ms", "measured/simulated", "overhead ms/instr"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['schedule']} vs {r['torch']}", f"{r['mt_step_ms']:.1f}", f"{r['torch_step_ms']:.1f}",
                  f"{r['mt_cpu_ms']:.1f}", f"{r['torch_cpu_ms']:.1f}", f"{r['mt_cpu_ms'] / r['torch_cpu_ms']:.2f}",
                  f"{r['sim_ms']:.1f}", f"{r['mt_step_ms'] / r['sim_ms']:.2f}",
                  f"{r['overhead_per_instruction_ms']:.3f}")
    console = Console(width=200)
    console.print(t)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores < args.ranks:
        console.print(f"note: {cores} CPU core(s) for {args.ranks} ranks: ranks share cores, so measured step "
                      "times exceed the simulated makespan (which gives every rank its own core); CPU time per "
                      "rank is the comparable figure here.")


if __name__ == "__main__":
    main()
