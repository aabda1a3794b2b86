"""Train DeepSeek-V3 (tiny preset) with DualPipe on local CPU processes — the README's first command.

    python examples/deepseek_v3_repro.py                      # 2 ranks, DualPipe, ~2 minutes on 2 cores
    python examples/deepseek_v3_repro.py --schedule dualpipev --ranks 2 --steps 20 --summary out.json
    torchrun --nproc-per-node 4 examples/deepseek_v3_repro.py --schedule zbv
    python examples/deepseek_v3_repro.py --ranks 2 --ep 2        # + expert parallelism: 4 processes

It spawns ``--ranks`` x ``--ep`` processes itself (gloo on 127.0.0.1), or runs as one of them under
torchrun. With ``--ep E`` there are E data-parallel pipelines whose ranks at the same position
shard that stage's routed experts and exchange tokens by all-to-all (overlapped with the other
micro-batch's compute inside DualPipe's F&B units).
Each rank builds the same seeded model, keeps only its stages, and trains with AdamW on a
synthetic task (or ``--corpus FILE``, any local text, byte-level). A rich progress bar shows the
loss, the MTP loss, the expert-load balance (max violation: max load / mean load − 1) and tokens/s;
the last step is timed per instruction, and the summary compares its measured bubble rate with the
simulator's for the same schedule and the measured op costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt_dualpipe.integrations.deepseek_v3 import (  # noqa: E402
    DeepSeekV3Config,
    DeepSeekV3Model,
    criterion_for,
    max_violation,
    stages_for_rank,
    sync_replicas,
    update_expert_bias,
)
from mt_dualpipe.integrations.deepseek_v3.data import TextCorpus, synthetic_batch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks, default 2")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: --ranks x --ep processes; each pipeline rank's experts are sharded\n"
                        "over --ep data-parallel replicas and tokens travel by all-to-all (default 1)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps, default 100")
    p.add_argument("--schedule", default="dualpipe", help="dualpipe (default), dualpipev, or any registered schedule")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 2 x stages)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch, default 4")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, default 64")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, default 3e-3")
    p.add_argument("--preset", default="tiny", help="model preset, default tiny")
    p.add_argument("--layout", default=None, help="stage layout, e.g. 'Et*2|t*2mL' (default: balanced)")
    p.add_argument("--corpus", default=None, help="train on this local text file instead of the synthetic task")
    p.add_argument("--fp8", action="store_true", help="FP8 linears (mt_dualpipe.integrations.fp8)")
    p.add_argument("--summary", default=None, help="write the run summary as JSON here")
    p.add_argument("--timeline", default=None, help="save the last step's measured timeline JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the progress bar")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.ep < 1:
        p.error("--ranks, --ep and --steps must be >= 1")
    return args


# ----- one rank -------------------------------------------------------------------------------------------
def process_groups(world: int, ep: int, rank: int):
    """Global rank g is pipeline rank g // ep of expert-parallel replica g % ep: (pp group, ep group)."""
    pp_ranks, ep_size = world // ep, ep
    pp_groups = [dist.new_group([p * ep_size + e for p in range(pp_ranks)]) for e in range(ep_size)]
    ep_groups = [dist.new_group([p * ep_size + e for e in range(ep_size)]) for p in range(pp_ranks)]
    return pp_groups[rank % ep], (ep_groups[rank // ep] if ep > 1 else None)


def setup(args: argparse.Namespace, rank: int, world: int):
    """This rank's pipeline, stage modules, schedule and optimizer."""
    from mt_dualpipe import DualPipe, DualPipeV, Pipeline
    from mt_dualpipe.schedules.registry import build_schedule

    if world != args.ranks * args.ep:
        raise SystemExit(f"{world} processes but --ranks {args.ranks} x --ep {args.ep} = {args.ranks * args.ep}")
    pp_group, ep_group = process_groups(world, args.ep, rank)
    pp_rank, world = rank // args.ep, args.ranks

    config = DeepSeekV3Config.preset(args.preset, max_seq_len=max(args.seq_len, 64))
    if args.corpus:
        config = config.replace(vocab_size=max(config.vocab_size, 256))
    stages_per_rank = 2 if args.schedule in ("dualpipe", "dualpipev", "zbv", "interleaved-1f1b") else 1
    mbs = args.microbatches or 2 * world * (1 if args.schedule == "dualpipe" else stages_per_rank)
    sched = build_schedule(args.schedule, world, mbs)
    torch.manual_seed(args.seed)
    full = DeepSeekV3Model(config)  # every rank builds the same weights, then keeps its stages
    mods = stages_for_rank(config, sched, pp_rank, args.layout, source=full, ep_group=ep_group)
    del full
    if args.fp8:
        try:
            from mt_dualpipe.integrations.fp8 import convert_to_fp8
        except ImportError as exc:
            raise SystemExit(f"--fp8 needs mt_dualpipe.integrations.fp8, which is not available here ({exc})") from exc
        for m in mods:
            convert_to_fp8(m)
    if args.schedule == "dualpipe":
        pipe = DualPipe(tuple(mods), process_group=pp_group)
    elif args.schedule == "dualpipev":
        pipe = DualPipeV(tuple(mods), process_group=pp_group)
    else:
        pipe = Pipeline(mods, sched, pp_group)
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=args.lr, weight_decay=0.1)
    return config, sched, mods, pipe, opt, pp_rank


def step_batch(args, config, corpus, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch for one data-parallel replica; the ranks of a pipeline draw the same one
    (seeded by step and replica), so no data is sent."""
    gen = torch.Generator().manual_seed((args.seed * 100003 + step) * 1009 + replica)
    rows = args.micro_batch_size * args.num_mb
    if corpus is not None:
        return corpus.batch(rows, args.seq_len, gen)
    return synthetic_batch(config.vocab_size, rows, args.seq_len, gen)


def train(args, rank: int, world: int, on_step=None) -> dict:
    """The training loop: step, sum replicated gradients, AdamW, balance-bias update; returns the history."""
    config, sched, mods, pipe, opt, pp_rank = setup(args, rank, world)
    args.num_mb = sched.num_microbatches
    corpus = TextCorpus(args.corpus) if args.corpus else None
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == pp_rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == pp_rank]
    criterion = criterion_for(mods)
    tokens_per_step = args.num_mb * args.micro_batch_size * args.seq_len * args.ep
    history: dict = {"loss": [], "mtp_loss": [], "balance": [], "tokens_per_s": []}
    for step in range(args.steps):
        x, y = step_batch(args, config, corpus, step, rank % args.ep)
        mb_x, mb_y = x.tensor_split(args.num_mb), y.tensor_split(args.num_mb)
        inputs = [torch.cat([mb_x[m] for m in sched.microbatches_of(first[0])])] if first else []
        labels = (torch.cat([mb_y[m] for m in sched.microbatches_of(last[0])]),) if last else ()
        pipe.record_timeline = step == args.steps - 1
        for m in mods:
            m.loss_log.clear()
        t0 = time.perf_counter()
        pipe.step(*inputs, num_chunks=args.num_mb, criterion=criterion, labels=labels)
        sync_replicas(mods, dist.group.WORLD)  # mirrored stage copies (DualPipe) and the MTP embedding copy
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync_replicas(mods, dist.group.WORLD, what="load")
        balance = max_violation(torch.nn.ModuleList(mods))
        update_expert_bias(torch.nn.ModuleList(mods))
        elapsed = time.perf_counter() - t0
        logs = [entry for m in mods for entry in m.loss_log]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (logs, balance))
        all_logs = [e for got, _ in everyone for e in got]
        main = sum(e[0] for e in all_logs) / len(all_logs)
        mtp = sum(sum(e[1]) / len(e[1]) for e in all_logs) / len(all_logs) if all_logs[0][1] else 0.0
        history["loss"].append(main)
        history["mtp_loss"].append(mtp)
        history["balance"].append(sum(b for _, b in everyone) / world)
        history["tokens_per_s"].append(tokens_per_step / elapsed)
        if on_step is not None:
            on_step(step, history)
    history["timeline"] = pipe.timeline if rank == 0 else None
    history["schedule"] = sched
    history["config"] = config
    return history


def summarize(args, world: int, history: dict) -> dict:
    from mt_dualpipe.schedules.simulate import simulate
    from mt_dualpipe.visualize.metrics import Summary, costs_from_timeline

    tl, sched = history["timeline"], history["schedule"]
    measured = Summary.from_timeline(tl).bubble_rate if tl is not None else None
    simulated = simulate(sched, costs_from_timeline(tl)).bubble_rate if tl is not None else None
    if tl is not None and args.timeline:
        Path(args.timeline).write_text(tl.to_json(indent=1))
    steady = history["tokens_per_s"][1:] or history["tokens_per_s"]
    return {
        "schedule": args.schedule, "ranks": args.ranks, "ep": args.ep, "steps": args.steps, "microbatches": args.num_mb,
        "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "preset": args.preset, "fp8": args.fp8,
        "data": args.corpus or "synthetic",
        "loss": history["loss"], "mtp_loss": history["mtp_loss"], "expert_load_max_violation": history["balance"],
        "tokens_per_s": sum(steady) / len(steady),
        "bubble_rate": {"measured": measured, "simulated": simulated},
        "config": history["config"].to_dict(),
    }


def report(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ep = f" x ep {summary['ep']}" if summary["ep"] > 1 else ""
    t = Table(title=f"DeepSeek-V3 ({summary['preset']}) · {summary['schedule']} on {summary['ranks']}{ep} CPU ranks")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("loss (first → last step)", f"{summary['loss'][0]:.3f} → {summary['loss'][-1]:.3f}")
    t.add_row("MTP loss (first → last step)", f"{summary['mtp_loss'][0]:.3f} → {summary['mtp_loss'][-1]:.3f}")
    t.add_row("expert load max violation (last)", f"{summary['expert_load_max_violation'][-1]:.3f}")
    t.add_row("tokens/s", f"{summary['tokens_per_s']:.0f}")
    bub = summary["bubble_rate"]
    if bub["measured"] is not None:
        t.add_row("bubble rate measured / simulated", f"{100 * bub['measured']:.1f} % / {100 * bub['simulated']:.1f} %")
    Console().print(t)


def run_rank(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        progress = None
        on_step = None
        if rank == 0 and not args.no_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
            where = f"{args.ranks} ranks" + (f" x ep {args.ep}" if args.ep > 1 else "")
            task = progress.add_task(f"{args.schedule} · {where}", total=args.steps, stats="")

            def on_step(step, h):
                progress.update(task, advance=1, stats=f"loss {h['loss'][-1]:.3f} mtp {h['mtp_loss'][-1]:.3f} "
                                f"maxvio {h['balance'][-1]:.2f} {h['tokens_per_s'][-1]:.0f} tok/s")

            progress.start()
        elif rank == 0:
            def on_step(step, h):
                print(f"step {step + 1}/{args.steps} loss {h['loss'][-1]:.4f} mtp {h['mtp_loss'][-1]:.4f} "
                      f"balance {h['balance'][-1]:.3f} {h['tokens_per_s'][-1]:.0f} tok/s", flush=True)
        try:
            history = train(args, rank, world, on_step)
        finally:
            if progress is not None:
                progress.stop()
        if rank == 0:
            summary = summarize(args, world, history)
            report(summary)
            if args.summary:
                Path(args.summary).write_text(json.dumps(summary, indent=1))
                print(f"summary written to {args.summary}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: we are one of the ranks
        world = int(os.environ["WORLD_SIZE"])
        if world % args.ep:
            raise SystemExit(f"torchrun started {world} processes, not a multiple of --ep {args.ep}")
        args.ranks = world // args.ep
        run_rank(int(os.environ["RANK"]), world, args, "env://")
        return 0
    init = f"tcp://127.0.0.1:{_free_port()}"
    world = args.ranks * args.ep
    torch.multiprocessing.spawn(run_rank, args=(world, args, init), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
