"""Per-step overhead of ``Rewind`` (in-memory snapshots, asynchronous checkpoints) on tiny DeepSeek-V3.

Trains the ``tiny`` preset (all stages in one process through ``LocalPipeline``, so the numbers
measure the wrapper, not the pipeline) in four configurations, interleaved round by round so that
a busy machine slows them alike, and reports the median time per step of each:

- plain: ``zero_grad``, ``step``, ``optimizer.step`` — no wrapper;
- rewind: ``Rewind`` with snapshots every N steps (the fault checks and agreement included);
- rewind+ckpt: the same plus an asynchronous checkpoint of every snapshot;
- the cost parts: one snapshot, the main-thread share of starting one checkpoint, snapshot size.

Two measures: end to end (best round per configuration: other load only ever adds time, so the
minimum is the least disturbed), and the time the training thread spends inside Rewind's own code
(``Rewind.seconds``: checks, agreement, snapshots, starting checkpoints), which does not depend on
what else runs on the machine. On a CPU-only box the background checkpoint writer competes with
training for the same cores; on a GPU node it runs on otherwise idle host cores.

Target (issue 7): overhead < 5 % at snapshot_every = 10.

``--agreement-ranks N`` first measures the per-step agreement on N gloo ranks (Rewind over a 1F1B
``Pipeline``): the time the training thread waits for the verdict exchange, with the optimizer
step overlapping it (the default) and after it (``overlap_optimizer=False``, the old order).

    python benchmarks/resilience_overhead.py [--steps 20] [--rounds 3] [--snapshot-every 10] [--device cpu]
                                             [--agreement-ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, build_stages, criterion_for
from mt_dualpipe.resilience import LocalPipeline, Rewind, take_snapshot


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _setup(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)
    config = DeepSeekV3Config.preset("tiny", max_seq_len=max(64, args.seq_len))
    stages = [s.to(device) for s in build_stages(config, 2)]
    pipe = LocalPipeline(stages)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    rows = args.num_mb * args.micro_batch_size
    data = [torch.randint(0, config.vocab_size, (rows, args.seq_len + 1), generator=gen) for _ in range(8)]

    def batch_fn(pos: int) -> dict:
        seq = data[pos % len(data)].to(device)
        return {"inputs": (seq[:, :-1],), "labels": (seq[:, 1:],)}

    return pipe, opt, criterion_for(stages), batch_fn


def _timed_steps(step, n: int, device: torch.device) -> list[float]:
    times = []
    for i in range(n):
        _sync(device)
        t = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration and round, default 20")
    p.add_argument("--rounds", type=int, default=3, help="rounds (configurations interleaved), default 3")
    p.add_argument("--snapshot-every", type=int, default=10, help="N of snapshot_every, default 10")
    p.add_argument("--num-mb", type=int, default=4, help="micro-batches per step, default 4")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch, default 2")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, default 64")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--agreement-ranks", type=int, default=0,
                   help="also measure the per-step agreement on this many gloo ranks (0: off)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    console = Console(width=150)
    if args.agreement_ranks:
        agreement_cost(args.agreement_ranks, args.steps, args.rounds, console)

    pipe, opt, criterion, batch_fn = _setup(args, device)

    def plain(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        b = batch_fn(i)
        pipe.step(*b["inputs"], num_chunks=args.num_mb, criterion=criterion, labels=b["labels"])
        opt.step()

    tmp = tempfile.TemporaryDirectory(prefix="rewind_bench_")
    rewind = Rewind(pipe, opt, num_chunks=args.num_mb, criterion=criterion, snapshot_every=args.snapshot_every)
    ckpt = Rewind(pipe, opt, num_chunks=args.num_mb, criterion=criterion, snapshot_every=args.snapshot_every,
                  checkpoint_dir=tmp.name, resume=False)
    configs = {"plain": plain, "rewind": lambda i: rewind.step(batch_fn),
               "rewind+ckpt": lambda i: ckpt.step(batch_fn)}
    for fn in configs.values():  # warm-up (allocator, first optimizer step)
        _timed_steps(fn, 2, device)
    per_config: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, fn in configs.items():
            per_config[name] += _timed_steps(fn, args.steps, device)
    ckpt.close()

    snap_times, start_times, write_times = [], [], []
    snap = None
    for _ in range(4):
        t = time.perf_counter()
        snap = take_snapshot(0, 0, rewind.modules, opt, reuse=snap)
        snap_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        ckpt.checkpoints.save(snap)
        start_times.append(time.perf_counter() - t)
        ckpt.checkpoints.wait()
        write_times.append(time.perf_counter() - t)
    snap_times, start_times, write_times = snap_times[1:], start_times[1:], write_times[1:]  # first: fresh buffers
    tmp.cleanup()

    # end to end: the best round of each configuration (a busy machine only ever adds time)
    rounds = {name: [statistics.mean(times[i * args.steps:(i + 1) * args.steps]) for i in range(args.rounds)]
              for name, times in per_config.items()}
    base = min(rounds["plain"])
    table = Table(title=f"Rewind overhead, tiny DeepSeek-V3, {args.num_mb}x{args.micro_batch_size}x{args.seq_len} "
                        f"tokens/step, snapshot_every={args.snapshot_every}, {device.type}")
    for col in ("configuration", "ms/step (best round)", "ms/step (median)", "end-to-end overhead",
                "Rewind's own time/step", "= % of a plain step"):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    for name, times in per_config.items():
        best = min(rounds[name])
        own = "-" if name == "plain" else (rewind if name == "rewind" else ckpt)
        own_ms = "-" if own == "-" else sum(own.seconds.values()) / max(1, own.counters["steps"]) * 1e3
        table.add_row(name, f"{best * 1e3:.1f}", f"{statistics.median(times) * 1e3:.1f}",
                      "-" if name == "plain" else f"{(best / base - 1) * 100:+.1f} %",
                      "-" if own == "-" else f"{own_ms:.2f} ms",
                      "-" if own == "-" else f"{own_ms / (base * 1e3) * 100:.2f} %")
    console.print(table)
    for name, rw in (("rewind", rewind), ("rewind+ckpt", ckpt)):
        steps = max(1, rw.counters["steps"])
        parts = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in sorted(rw.seconds.items()))
        console.print(f"{name}: training-thread ms/step by part: {parts}")
    n = args.snapshot_every
    snap_ms, start_ms = statistics.median(snap_times) * 1e3, statistics.median(start_times) * 1e3
    console.print(f"snapshot: {snap.nbytes() / 2**20:.1f} MiB, {snap_ms:.1f} ms each into reused buffers "
                  f"(= {snap_ms / n / (base * 1e3) * 100:.2f} % of a step amortized over {n} steps); starting an "
                  f"async checkpoint: {start_ms:.1f} ms on the training thread; writing it: "
                  f"{statistics.median(write_times) * 1e3:.0f} ms in the background; mode: {ckpt.checkpoint_mode}")


# ----- the per-step agreement on several ranks ------------------------------------------------------
def _agreement_worker(rank: int, world: int, port: int, steps: int, rounds: int, out: Any) -> None:
    """Rewind over a 1F1B Pipeline of MLP stages; per round, ``steps`` steps with the optimizer step
    overlapping the agreement and ``steps`` without (interleaved, so load slows both alike)."""
    import datetime

    import torch.distributed as dist
    import torch.nn as nn

    from mt_dualpipe import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(rank)
    pipe = Pipeline([nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])], "1f1b", timeout=60)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)

    def batch(pos: int) -> dict:
        return {"inputs": (x,)} if rank == 0 else {"labels": (y,)} if rank == world - 1 else {}

    rws = {mode: Rewind(pipe, opt, num_chunks=4, criterion=nn.functional.mse_loss, snapshot_every=10**6,
                        spike_zscore=None, overlap_optimizer=mode == "overlapped")
           for mode in ("overlapped", "after the verdict")}
    result = {mode: [0.0, 0.0] for mode in rws}  # agreement s, step s
    for r in range(rounds + 1):  # round 0: warm-up
        for mode, rw in rws.items():
            rw.seconds.clear()
            t = time.perf_counter()
            for _ in range(steps):
                rw.step(batch)
            if r:
                result[mode][0] += rw.seconds["agreement"]
                result[mode][1] += time.perf_counter() - t
    out.put((rank, {mode: (a / (rounds * steps), s / (rounds * steps)) for mode, (a, s) in result.items()}))
    dist.barrier()
    dist.destroy_process_group()


def agreement_cost(ranks: int, steps: int, rounds: int, console: Console) -> None:
    """Print the agreement's exposed time per step (``Rewind.seconds["agreement"]``) on ``ranks`` gloo ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agreement_worker, args=(r, ranks, port, steps, rounds, out)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    per_rank = dict(out.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join()
    table = Table(title=f"Rewind's per-step agreement, {ranks} gloo ranks, 1F1B, 4x(256x256 linear) per stage")
    for col in ("optimizer.step()", "agreement ms/step (mean of ranks)", "per rank", "step ms"):
        table.add_column(col, justify="left" if col == "optimizer.step()" else "right")
    for mode in per_rank[0]:
        vals = [per_rank[r][mode] for r in sorted(per_rank)]
        table.add_row(mode, f"{statistics.mean(v[0] for v in vals) * 1e3:.2f}",
                      " / ".join(f"{v[0] * 1e3:.2f}" for v in vals), f"{statistics.mean(v[1] for v in vals) * 1e3:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
