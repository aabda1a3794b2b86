"""``auto`` on the runtime: a measured DeepSeek-V3 (tiny) run, re-scheduled for its own costs, beside the hand schedule.

Two local gloo ranks (``torch.set_num_threads(1)``) train the tiny DeepSeek-V3 preset (embedding,
dense and MoE blocks, MLA, the head, the MTP module and both losses) on a V placement. The hand
schedule (``--hand``: dualpipev or zbv) runs a few warm-up steps, then ``--recorded`` recorded
steps; their measured timelines give per-stage, per-kind costs and the hop latency (the median
over the steps of ``visualize.measured.stage_costs`` / ``hop_latency``). ``auto`` is searched for
exactly those costs, within the hand schedule's peak activations, on rank 0 and broadcast; both schedules
then run on the same stage modules in interleaved rounds (so both see the same machine load) and
the table gives, per schedule, the makespan the simulator predicts from the measured costs and the
measured median step time (slowest rank), each with its ratio to the hand schedule's, and, from one
more recorded step of each, the bubble simulated with that step's own costs against the measured
one and what of the difference is runtime overhead between ops and op-time variance
(``visualize.measured.compare_bubble``).

    python benchmarks/auto_runtime.py                          # about a minute on 2 idle cores
    python benchmarks/auto_runtime.py --hand zbv --rounds 5 --steps 6

With more ranks than idle cores the step time measures the machine more than the schedule (the
``runtime_step.py`` benchmark's core bound says by how much).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from local_ranks import run_local  # noqa: E402  (benchmarks/, the script's own folder)

HANDS = ("dualpipev", "zbv")
"""Hand schedules of the V placement (the placement ``auto`` searches with ``placement="v"``)."""


def measured_costs(timelines, schedule):
    """Per-stage costs and the hop latency (seconds) of measured steps of ``schedule``: per field and
    stage, the median over the steps (one step on a shared machine is noisy)."""
    from mt_dualpipe.schedules import Costs
    from mt_dualpipe.visualize.measured import hop_latency, stage_costs

    each = [stage_costs(t, schedule.num_stages(0)) for t in timelines]

    def med(name: str):
        values = [getattr(c, name) for c in each]
        if any(v is None for v in values):
            return None
        return [statistics.median(col) for col in zip(*values)]

    comm = statistics.median(hop_latency(t, schedule.placement) for t in timelines)
    return Costs(med("f"), med("b"), med("w"), fb=med("fb"), comm=comm)


class Runner:
    """One schedule on this rank's stage modules: a step, and a recorded step."""

    def __init__(self, mods, schedule, criterion, inputs, labels, M: int):
        from mt_dualpipe import Pipeline

        self.pipe = Pipeline(mods, schedule)
        self.mods, self.M = mods, M
        self.criterion = criterion
        self.inputs, self.labels = inputs, labels

    def step(self) -> None:
        self.pipe.step(*self.inputs, num_chunks=self.M, criterion=self.criterion, labels=self.labels)
        for m in self.mods:
            m.zero_grad(set_to_none=True)

    def record(self):
        self.pipe.record_timeline = True
        self.step()
        self.pipe.record_timeline = False
        return self.pipe.timeline


def timed(step, n: int) -> list[float]:
    """Wall seconds of ``n`` steps, each started together on every rank (a barrier before it)."""
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def build_rank(args: argparse.Namespace, rank: int, P: int):
    """This rank's stage modules for the V placement, the hand schedule and the batch share."""
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, criterion_for, stages_for_rank
    from mt_dualpipe.models.deepseek_v3.data import synthetic_batch
    from mt_dualpipe.schedules import build_schedule

    config = DeepSeekV3Config.preset("tiny", max_seq_len=max(args.seq_len, 64))
    hand = build_schedule(args.hand, P, args.microbatches)
    torch.manual_seed(0)
    full = DeepSeekV3Model(config)  # every rank builds the same weights, then keeps its stages
    mods = stages_for_rank(config, hand, rank, source=full)
    del full
    x, y = synthetic_batch(config.vocab_size, args.mb_size * args.microbatches, args.seq_len,
                           torch.Generator().manual_seed(1))
    chain = hand.placement[0]
    inputs = (x,) if chain[0] == rank else ()
    labels = (y,) if chain[-1] == rank else ()
    return mods, hand, criterion_for(mods), inputs, labels


def search_auto(rank: int, hand, timelines, M: int):
    """Rank 0 measures the costs and searches ``auto`` for them within the hand schedule's peak
    activations; every rank gets both (a broadcast)."""
    from mt_dualpipe.schedules import build_schedule, simulate

    got = [None, None, 0.0]
    if rank == 0:
        costs = measured_costs(timelines, hand)
        limit = max(simulate(hand, costs).peak_activations)
        t0 = time.process_time()
        got = [costs, build_schedule("auto", hand.num_ranks, M, costs=costs, placement="v", memory_limit=limit), 0.0]
        got[2] = time.process_time() - t0
    dist.broadcast_object_list(got, src=0)
    return got


def worker(rank: int, P: int, port: int, args: argparse.Namespace, out) -> None:
    from mt_dualpipe.schedules import simulate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=600))
    mods, hand, criterion, inputs, labels = build_rank(args, rank, P)
    runners = {"hand": Runner(mods, hand, criterion, inputs, labels, args.microbatches)}
    for _ in range(args.warmup):
        runners["hand"].step()
    recorded = [runners["hand"].record() for _ in range(args.recorded)]
    costs, auto, auto_cpu = search_auto(rank, hand, recorded, args.microbatches)
    if auto.local_stages(rank) != hand.local_stages(rank):
        raise RuntimeError("auto placed this rank's stages differently from the hand schedule")
    runners["auto"] = Runner(mods, auto, criterion, inputs, labels, args.microbatches)
    runners["auto"].step()  # its first step builds the executor
    walls: dict[str, list[float]] = {"hand": [], "auto": []}
    for _ in range(args.rounds):  # interleaved: both schedules see the same machine load
        for name in ("hand", "auto"):
            walls[name] += timed(runners[name].step, args.steps)
    last = {name: runners[name].record() for name in ("hand", "auto")}  # one more step each, recorded
    stats = torch.tensor([walls["hand"], walls["auto"]], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(P)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        from mt_dualpipe.visualize.measured import compare_bubble

        slowest = torch.stack(gathered).max(0).values  # per step: the slowest rank's wall time
        rows = []
        for i, (name, sched) in enumerate((("hand", hand), ("auto", auto))):
            res = simulate(sched, costs)
            bubble = compare_bubble(last[name], sched)
            rows.append({"schedule": args.hand if name == "hand" else f"auto ({auto.meta['source']})",
                         "sim_ms": res.makespan * 1e3, "peak": max(res.peak_activations),
                         "step_ms": statistics.median(slowest[i].tolist()) * 1e3,
                         "steps": len(slowest[i]), "bubble": bubble.measured, "sim_bubble": bubble.simulated,
                         "overhead": bubble.overhead, "variance": bubble.variance})
        out.put({"rows": rows, "costs": costs.describe(), "auto_cpu_s": auto_cpu,
                 "memory_limit": auto.meta["memory_limit"]})
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    """The benchmark on ``args.ranks`` local gloo ranks; rank 0's result. A rank that dies fails it at once."""
    return run_local(worker, args.ranks, (args,), args.timeout)


def table(result: dict, args: argparse.Namespace):
    from rich.table import Table

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    t = Table(title=f"DeepSeek-V3 tiny, {args.ranks} gloo ranks on {cores} core(s), V placement, "
                    f"M={args.microbatches} x {args.mb_size} sequences of {args.seq_len}; median of "
                    f"{args.rounds} x {args.steps} interleaved steps (slowest rank)")
    for col in ("schedule", "peak act.", "simulated ms", "sim vs hand", "measured step ms", "measured vs hand",
                "measured / simulated", "bubble sim / measured", "of which overhead / variance"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    hand = result["rows"][0]
    for r in result["rows"]:
        t.add_row(r["schedule"], str(r["peak"]), f"{r['sim_ms']:.1f}", f"{r['sim_ms'] / hand['sim_ms'] - 1:+.1%}",
                  f"{r['step_ms']:.1f}", f"{r['step_ms'] / hand['step_ms'] - 1:+.1%}",
                  f"{r['step_ms'] / r['sim_ms']:.2f}", f"{r['sim_bubble']:.1%} / {r['bubble']:.1%}",
                  f"{r['overhead']:+.1%} / {r['variance']:+.1%}")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hand", default="dualpipev", choices=HANDS, help="the hand schedule measured and compared")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2, help="hand steps before the recorded one")
    ap.add_argument("--recorded", type=int, default=3, help="recorded hand steps the costs are measured on")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per schedule per round")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the benchmark gives up")
    args = ap.parse_args(argv)
    result = run(args)
    from rich.console import Console

    console = Console(width=max(Console().width, 140))
    console.print(table(result, args))
    console.print(f"measured costs (s): {result['costs']}")
    console.print(f"auto searched in {result['auto_cpu_s']:.1f} s of CPU, memory limit "
                  f"{result['memory_limit']} activations per rank (the hand schedule's peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
