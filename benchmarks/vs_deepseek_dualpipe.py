"""Step time beside deepseek-ai/DualPipe's own code: DualPipe and DualPipeV, same model, same ranks, same M.

deepseek's implementation is CUDA-only in two places: its p2p receive buffers are allocated on "cuda" and its
constructor asserts the modules sit on the current CUDA device. This script runs it on CPU over gloo by
replacing the buffer factory (``dualpipe.comm.build_from_tensor_shapes``) with one that allocates on the CPU
and answering the device check with the CPU; nothing else of it is touched. Its code is not part of this
project: pass a checkout (``git clone https://github.com/deepseek-ai/DualPipe``) with ``--deepseek``.

Both run the same stages (``--blocks`` pre-norm MLP blocks of ``--hidden`` each), the same inputs and the same
``F.mse_loss``, with no ``overlapped_forward_backward`` hook (nothing to overlap on a dense model), in two
variants (``--linear``):

- ``deferred``: both split every zero-bubble backward for real, each the way its library offers. Ours wraps
  the linears with ``defer_weight_grads`` (``DeferredLinear``); deepseek's contract is a linear that queues
  its weight-gradient GEMM on ``dualpipe.WeightGradStore`` while the store is enabled (its example's
  ``LinearFunc``), written here against that API (``_QueuedLinear``).
- ``plain``: ``nn.Linear`` on both. deepseek's DualPipe then runs every backward whole (nothing reaches its
  store); ours still splits B from W where the program has room for it (its generic split), which the
  measurement includes.

Rounds alternate ours and theirs; a step's time is the slowest rank's, the table gives medians and
ours / theirs, and the CPU time of all ranks together per step (ours / theirs): with more ranks than cores a
rank's idle time goes to another rank's process, so the CPU a step costs decides its time more than the
order does.

    python benchmarks/vs_deepseek_dualpipe.py --deepseek ../DualPipe [--ranks 4] [--chunks 8] [--hidden 128]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
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
from runtime_overhead import Block, mse  # noqa: E402  (the same pre-norm MLP block and loss)


class _QueuedLinearFn(torch.autograd.Function):
    """y = x W^T + b whose weight gradient goes to deepseek's ``WeightGradStore`` while it is enabled."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, (weight, bias)  # the leaves the queued GEMMs add to
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        params = ctx.params

        def weight_grads() -> None:
            for p, g in zip(params, (dy2.t() @ x2, dy2.sum(0))):
                p.grad = g if p.grad is None else p.grad + g

        if ctx.store.enabled:
            ctx.store.put(weight_grads)
            return dx, None, None, None
        return dx, dy2.t() @ x2, dy2.sum(0), None


class _QueuedLinear(nn.Linear):
    store = None  # deepseek's WeightGradStore, set once it is imported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QueuedLinearFn.apply(x, self.weight, self.bias, self.store)


def _queued(stage: nn.Module) -> nn.Module:
    """``stage`` with every ``nn.Linear`` a ``_QueuedLinear`` (same parameters)."""
    for name, child in stage.named_children():
        if type(child) is nn.Linear:
            q = _QueuedLinear(child.in_features, child.out_features)
            q.weight, q.bias = child.weight, child.bias
            setattr(stage, name, q)
        else:
            _queued(child)
    return stage


def _deepseek(path: str, rows: int, hidden: int):
    """deepseek's DualPipe and DualPipeV classes, made to run on CPU (module docstring)."""
    sys.path.insert(0, path)
    import dualpipe
    import dualpipe.comm as comm

    def cpu_buffers() -> list[torch.Tensor]:
        return [torch.empty(s, dtype=comm.TENSOR_DTYPE, requires_grad=True) for s in comm.TENSOR_SHAPES]

    comm.build_from_tensor_shapes = cpu_buffers
    torch.cuda.current_device = lambda: "cpu"  # its constructor compares the modules' device with this
    comm.set_p2p_tensor_shapes([(rows, hidden)])
    comm.set_p2p_tensor_dtype(torch.float32)
    _QueuedLinear.store = dualpipe.WeightGradStore
    return dualpipe.DualPipe, dualpipe.DualPipeV


def _inputs(name: str, rank: int, P: int, x: torch.Tensor, y: torch.Tensor):
    """(inputs, labels) of this rank, as both implementations take them: DualPipeV's on rank 0; DualPipe's
    first chain enters on rank 0 and ends on rank P-1, the second the other way round (half the batch each)."""
    if name == "dualpipev":
        return ((x,), (y,)) if rank == 0 else ((), ())
    xs, ys = x.chunk(2), y.chunk(2)
    if rank == 0:
        return (xs[0],), (ys[1],)
    if rank == P - 1:
        return (xs[1],), (ys[0],)
    return (), ()


def _stage_ids(name: str, rank: int, P: int) -> list[int]:
    return [rank, 2 * P - 1 - rank] if name == "dualpipev" else [rank, P - 1 - rank]


def _ours(name: str, rank: int, P: int, stages: list[nn.Module], M: int, x, y, linear: str):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime.deferred import defer_weight_grads
    from mt_dualpipe.schedules import build_schedule

    sched = build_schedule(name, P, M)
    mods = [copy.deepcopy(stages[s]) for _, s in sched.local_stages(rank)]
    if linear == "deferred":
        mods = [defer_weight_grads(m) for m in mods]
    pipe = Pipeline(mods, sched)
    inputs, labels = _inputs(name, rank, P, x, y)

    def step() -> None:
        pipe.step(*inputs, num_chunks=M, criterion=mse, labels=labels)
        for m in mods:
            m.zero_grad(set_to_none=True)

    return step


def _theirs(cls, name: str, rank: int, P: int, stages: list[nn.Module], M: int, x, y, linear: str):
    mods = nn.Sequential(*(copy.deepcopy(stages[s]) for s in _stage_ids(name, rank, P)))
    if linear == "deferred":
        mods = _queued(mods)
    pipe = cls(mods)
    inputs, labels = _inputs(name, rank, P, x, y)
    if not inputs:
        inputs = (None,)
        labels = (None,)

    def step() -> None:
        pipe.step(*inputs, num_chunks=M, criterion=mse, labels=labels, return_outputs=False)
        for m in mods:
            m.zero_grad(set_to_none=True)

    return step


def _timed(step, steps: int) -> list[tuple[float, float]]:
    """Per step: (the slowest rank's wall time, the CPU time of all ranks together)."""
    out = []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall = torch.tensor([time.perf_counter() - t0])
        cpu = torch.tensor([time.process_time() - c0])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        out.append((wall.item(), cpu.item()))
    return out


def worker(rank: int, P: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    dual, dual_v = _deepseek(args.deepseek, args.rows, args.hidden)
    torch.manual_seed(0)
    stages = [nn.Sequential(*(Block(args.hidden, expand=2) for _ in range(args.blocks))) for _ in range(2 * P)]
    x = torch.randn(args.chunks * args.rows, args.hidden)
    y = torch.randn(args.chunks * args.rows, args.hidden)
    rows = []
    for linear, (name, cls) in itertools.product(args.linear, (("dualpipe", dual), ("dualpipev", dual_v))):
        ours = _ours(name, rank, P, stages, args.chunks, x, y, linear)
        theirs = _theirs(cls, name, rank, P, stages, args.chunks, x, y, linear)
        for _ in range(2):  # warm-up: shapes learned, caches filled
            ours()
            theirs()
        mine, ref = [], []
        for _ in range(args.rounds):  # alternating rounds: both see the same machine load
            mine += _timed(ours, args.steps)
            ref += _timed(theirs, args.steps)
        ratios = [a[0] / b[0] for a, b in zip(mine, ref)]
        cpu = statistics.median(a[1] for a in mine) / statistics.median(b[1] for b in ref)
        rows.append((name, linear, statistics.median(a[0] for a in mine), statistics.median(b[0] for b in ref),
                     statistics.median(ratios), min(ratios), max(ratios), cpu))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepseek", default=os.environ.get("DEEPSEEK_DUALPIPE", ""),
                        help="a checkout of github.com/deepseek-ai/DualPipe (or $DEEPSEEK_DUALPIPE)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rows", type=int, default=64, help="rows (tokens) per micro-batch")
    parser.add_argument("--blocks", type=int, default=2, help="MLP blocks per stage")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--linear", nargs="+", choices=("deferred", "plain"), default=["deferred", "plain"],
                        help="how the linears split (module docstring)")
    args = parser.parse_args()
    if not args.deepseek or not os.path.isfile(os.path.join(args.deepseek, "dualpipe", "dualpipe.py")):
        parser.error("--deepseek must name a checkout of github.com/deepseek-ai/DualPipe "
                     f"(a folder holding dualpipe/dualpipe.py), got {args.deepseek!r}")
    from rich.console import Console
    from rich.table import Table

    rows = run_local(worker, args.ranks, (args,), timeout=1800)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(title=f"{args.ranks} gloo ranks, {args.chunks} micro-batches of {args.rows} x {args.hidden}, "
                        f"{args.blocks} blocks per stage; median of {args.rounds} x {args.steps} steps each, "
                        f"alternating; load {load:.2f}")
    for col in ("schedule", "linears", "ours ms", "deepseek ms", "ours / deepseek", "per-step ratio min..max",
                "CPU ours / deepseek"):
        table.add_column(col, justify="left" if col in ("schedule", "linears") else "right")
    for name, linear, mine, ref, ratio, lo, hi, cpu in rows:
        table.add_row(name, linear, f"{mine * 1e3:.1f}", f"{ref * 1e3:.1f}", f"{ratio:.3f}", f"{lo:.2f}..{hi:.2f}",
                      f"{cpu:.3f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
