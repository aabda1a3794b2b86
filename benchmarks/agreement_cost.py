"""What one step agreement costs: gloo's all-reduce against the star the runtime posts (``runtime/agree.py``).

Every step runs two agreements (the step-start row of checks and the end-of-step "every rank finished"): a sum
of one small int64 vector per rank that every rank gets back. This script times ``--rounds`` agreements back to
back on ``--ranks`` local gloo ranks, both ways, interleaved in blocks, and prints per agreement the CPU time of
all ranks together and the wall time, side by side:

    python benchmarks/agreement_cost.py [--ranks 2 4] [--rounds 400] [--width 5]
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

from mt_dualpipe.runtime.agree import END_TAG, StarSum  # noqa: E402

BLOCKS = 8  # interleaved blocks per method: both see the same machine load


def _timed(agree, rounds: int) -> tuple[float, float]:
    """(CPU of all ranks, slowest rank's wall) per agreement over ``rounds`` agreements."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        agree()
    cpu = torch.tensor([time.process_time() - c0])
    wall = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(cpu)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return cpu.item() / rounds, wall.item() / rounds


def worker(rank: int, ranks: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))
    pg = dist.group.WORLD
    timeout = datetime.timedelta(seconds=60)
    expected = ranks * (ranks + 1) // 2

    def allreduce() -> None:
        vec = torch.full((args.width,), rank + 1, dtype=torch.int64)
        pg.allreduce([vec]).wait(timeout)
        assert int(vec[0]) == expected

    def star() -> None:
        vec = torch.full((args.width,), rank + 1, dtype=torch.int64)
        assert StarSum(pg, rank, ranks, END_TAG, vec).wait(timeout)
        assert int(vec[0]) == expected

    per_block = max(1, args.rounds // BLOCKS)
    got: dict[str, list[tuple[float, float]]] = {"gloo all-reduce": [], "star (runtime/agree.py)": []}
    for fn in (allreduce, star):  # warm-up
        _timed(fn, 20)
    for _ in range(BLOCKS):
        got["gloo all-reduce"].append(_timed(allreduce, per_block))
        got["star (runtime/agree.py)"].append(_timed(star, per_block))
    if rank == 0:
        out.put({k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in got.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=400, help="agreements per method and rank count")
    parser.add_argument("--width", type=int, default=5, help="integers per rank's vector")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one agreement: a sum of {args.width} int64 per rank, {args.rounds} in a row, "
                        f"median of {BLOCKS} interleaved blocks; {os.cpu_count()} cores")
    for col in ("ranks", "method", "CPU, all ranks (ms)", "wall (ms)", "CPU / star"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for ranks in args.ranks:
        rows = run_local(worker, ranks, (args,), timeout=600)
        star_cpu = rows["star (runtime/agree.py)"][0]
        for name, (cpu, wall) in rows.items():
            table.add_row(str(ranks), name, f"{cpu * 1e3:.2f}", f"{wall * 1e3:.2f}", f"{cpu / star_cpu:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
