"""Runtime step time: mt_dualpipe beside torch.distributed.pipelining, same model, same M.

Local gloo ranks (4, then 2 by default), ``torch.set_num_threads(1)``. For DualPipeV, ZB-V and
1F1B it reports the median step time (slowest rank) and the mean CPU time per rank per step (all
threads of the process: gloo's transport thread included) of both runtimes, and, for mt_dualpipe,
the step time against two lower bounds: the makespan the simulator predicts from the per-op
costs measured in the same run (every rank on its own core), and the core bound, the CPU time of
all ranks together divided by the cores they share (no schedule beats it when ranks outnumber
cores). The overhead per instruction is the CPU a rank spends outside its compute ops, per
instruction of its program (comm posts included).

    python benchmarks/runtime_step.py [--ranks 4,2] [--chunks 8] [--hidden 256] [--rows 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from local_ranks import run_local  # noqa: E402  (benchmarks/, the script's own folder)

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


def _hop_latency(rank, hidden, rows, reps: int = 50) -> float:
    """Median one-way time of one activation message between ranks 0 and 1 (half a gloo round trip)."""
    t = torch.randn(rows, hidden)
    times = []
    dist.barrier()
    if rank in (0, 1):
        peer = 1 - rank
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
            times.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return statistics.median(times) if times else 0.0


def _costs_from(timeline, comm: float = 0.0):
    """Median measured seconds of F, B, W and BW (an FB unit counts as F + BW here: no overlap on CPU);
    ``comm``: the measured latency of one cross-rank hop."""
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
    return Costs(f, b, w, fb=fb, comm=comm)


def worker(rank, P, port, M, hidden, rows, steps, out):
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    blocks = [Block(hidden) for _ in range(2 * P)]
    x = torch.randn(M * rows, hidden)
    y = torch.randn(M * rows, hidden)
    rows_out = []
    hop = _hop_latency(rank, hidden, rows)
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
        from mt_dualpipe.schedules import lower, simulate

        stats = torch.tensor([mw, mc, tw, tc], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(P)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            g = torch.stack(gathered)  # rank, metric, step
            wall_m, wall_t = g[:, 0].max(0).values, g[:, 2].max(0).values
            cpu_m, cpu_t = g[:, 1].mean(0), g[:, 3].mean(0)
            cpu_all = g[:, 1].sum(0)  # CPU seconds of all ranks together, per step
            costs = _costs_from(timeline)
            sim = simulate(sched, costs).makespan
            sim_comm = simulate(sched, _costs_from(timeline, hop)).makespan
            progs = lower(sched).ranks
            n_ins = max(len(r) for r in progs)
            ins_per_rank = statistics.mean(len(r) for r in progs)
            per_rank_busy = [sum(e.duration for e in timeline.compute_events() if e.rank == r) for r in range(P)]
            med_m = wall_m.median().item()
            cpu_med = cpu_m.median().item()
            rows_out.append({"schedule": name, "torch": tname, "mt_step_ms": med_m * 1e3,
                             "torch_step_ms": wall_t.median().item() * 1e3,
                             "mt_cpu_ms": cpu_med * 1e3, "torch_cpu_ms": cpu_t.median().item() * 1e3,
                             "sim_ms": sim * 1e3, "sim_comm_ms": sim_comm * 1e3, "hop_ms": hop * 1e3,
                             "core_bound_ms": cpu_all.median().item() / cores * 1e3,
                             "instructions": n_ins,
                             "overhead_per_instruction_ms": max(0.0, med_m - sim) / n_ins * 1e3,
                             "cpu_overhead_per_instruction_ms":
                                 max(0.0, cpu_med - statistics.mean(per_rank_busy)) / ins_per_rank * 1e3})
    if rank == 0:
        out.put(rows_out)
    dist.destroy_process_group()


def run(ranks: int, args: argparse.Namespace) -> list[dict]:
    """One benchmark on ``ranks`` local gloo ranks; rank 0's rows. A rank that dies fails it at once."""
    return run_local(worker, ranks, (args.chunks, args.hidden, args.rows, args.steps), 900)


def table(ranks: int, rows: list[dict], args: argparse.Namespace, cores: int):
    from rich.table import Table

    hop = rows[0]["hop_ms"] if rows else 0.0
    t = Table(title=f"step time, {ranks} gloo ranks on {cores} core(s), M={args.chunks}, hidden={args.hidden}, "
                    f"{args.rows} rows/micro-batch, 1 thread, median of {ROUNDS} x {args.steps} steps, interleaved; "
                    f"measured hop latency {hop:.3f} ms")
    for col in ("schedule", "mt step ms", "torch step ms", "mt CPU ms/rank", "torch CPU ms/rank", "CPU mt/torch",
                "simulated ms", "measured/simulated", "sim + hop latency ms", "measured/sim+hop", "core bound ms",
                "measured/max(bounds)",
                "overhead ms/instr (wall)", "overhead ms/instr (CPU)"):
        t.add_column(col, justify="right")
    for r in rows:
        bound = max(r["sim_comm_ms"], r["core_bound_ms"])
        t.add_row(f"{r['schedule']} vs {r['torch']}", f"{r['mt_step_ms']:.1f}", f"{r['torch_step_ms']:.1f}",
                  f"{r['mt_cpu_ms']:.1f}", f"{r['torch_cpu_ms']:.1f}", f"{r['mt_cpu_ms'] / r['torch_cpu_ms']:.2f}",
                  f"{r['sim_ms']:.1f}", f"{r['mt_step_ms'] / r['sim_ms']:.2f}", f"{r['sim_comm_ms']:.1f}",
                  f"{r['mt_step_ms'] / r['sim_comm_ms']:.2f}", f"{r['core_bound_ms']:.1f}",
                  f"{r['mt_step_ms'] / bound:.2f}", f"{r['overhead_per_instruction_ms']:.3f}",
                  f"{r['cpu_overhead_per_instruction_ms']:.3f}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,2", help="comma-separated numbers of ranks, one benchmark each")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rich.console import Console

    console = Console(width=260)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for ranks in (int(r) for r in args.ranks.split(",")):
        console.print(table(ranks, run(ranks, args), args, cores))
    console.print(
        "notes: 'simulated' is simulate() with the median F/B/W/BW/FB durations measured in the same run (wall "
        "clock), as if every rank had its own core and messages took no time; 'sim + hop latency' adds the measured "
        "one-way time of one activation message between two ranks (gloo ping-pong) to every cross-rank hop. "
        "'core bound' is the CPU time of all ranks together (gloo's transport thread included) divided by the "
        f"cores: no runtime finishes a step sooner. With {cores} core(s) for more than {cores} ranks, "
        "measured/simulated is bounded below by that core sharing, not by the runtime; measured/max(bounds) (the "
        "larger of sim + hop latency and the core bound) is the runtime's own share. The per-op durations are "
        "wall-clock and include time a rank waited for its core, so under core sharing the simulation is also "
        "inflated and the CPU overhead per instruction (CPU per rank minus its compute, per instruction of its "
        "program, comm posts included) is underestimated; the runs with no more ranks than cores are the clean ones. "
        "CPU time per rank is the figure comparable between the runtimes in every case.")

if __name__ == "__main__":
    main()
