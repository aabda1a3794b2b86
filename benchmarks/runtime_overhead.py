"""The runtime's own cost: mt_dualpipe and torch.distributed.pipelining beside plain autograd, one process.

A world of one rank holds every stage, so nothing is transferred and whatever a step costs beyond the
same model's plain forward and backward per micro-batch is the runtime's own work: its executor loop,
the B/W split, the step's bookkeeping. Two tables:

- **a block stack** (hidden 64 and 256): 8 pre-norm MLP blocks (LayerNorm -> Linear(h, 4h) -> GELU ->
  Linear(4h, h), residual; plain ``nn.Linear`` layers, so ZB-V's split is the generic one) cut by
  ``split_model``, 8 micro-batches of 2 x 128 tokens, MSE loss.
- **DeepSeek-V3 stages** (the ``tiny`` preset: dim 256, 4 layers, MoE, MTP; 8 micro-batches of 1 x 256
  tokens): ``stages_for_rank`` against the plain ``DeepSeekV3Model``. 1F1B runs fused BWs (stages with
  plain linears); ZB-V, DualPipeV and DualPipe get ``DeferredLinear`` stages (W deferred).

On one rank no B's gradient leaves the rank, so the runtime runs every B that its own W directly follows
as one BW (``schedules/fuse.py``): the default rows pay no split. Each schedule with W ops therefore gets a
second row, "every W split" (``Pipeline(..., fuse_backward=False)``), which keeps every W of the schedule:
the split's own cost, what a rank pays where its input gradient does leave (no torch column there).

Schedules: 1F1B, ZB-V, DualPipeV and DualPipe. DualPipe needs two ranks, so its one-rank program is
the two ranks' programs merged in the order the simulator starts their ops (both chains, all four
stages on one rank; the stack's chains share the layers, so the work is the plain model's). A rank
feeds one chain through ``Pipeline.step``, so that row drives the pipeline's executor directly
(``Pipeline.executor(...).run``, with the step-start row ``step`` would send). torch's rows run its
schedule of the same name on the same stage modules; it has no DualPipe ("—").

Per row: step time (median over rounds) and its ratio to plain, engine calls per step (every call
into autograd's engine: ``backward``, ``grad`` and the runtimes' own) and the runtime's time per
compute op, (ratio - 1) x plain / ops: on one process, what each F, B, W, BW or F&B half adds.

Rounds are interleaved: each round runs, per schedule, plain, ours and torch's one step each (order
reversed every other round), and a ratio is the median over rounds of the row's time over the plain
step measured beside it, so load that comes and goes on a shared machine moves both sides; a row
whose step is short gets more rounds (``ROUND_SECONDS``). On CPU the time is the process's CPU time
(one compute thread: others' load on a shared machine hardly moves it), on a GPU wall time after a
synchronize. The device is CUDA when one is available (``--device`` overrides).

    python benchmarks/runtime_overhead.py [--device auto|cpu|cuda] [--rounds 3] [--parts stack,deepseek]
                                          [--hidden 64,256] [--schedules 1f1b,zbv,dualpipev,dualpipe]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe import Pipeline, split_model  # noqa: E402
from mt_dualpipe.runtime.step_checks import BATCHED, StepCheck  # noqa: E402
from mt_dualpipe.schedules.ir import Schedule  # noqa: E402
from mt_dualpipe.schedules.registry import build_schedule  # noqa: E402
from mt_dualpipe.schedules.simulate import run_schedule  # noqa: E402

MB, ROWS, SEQ, BLOCKS = 8, 2, 128, 8
SCHEDULES = [("1f1b", "Schedule1F1B"), ("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV"),
             ("dualpipe", None)]


# ----- counting autograd engine calls ----------------------------------------------------------------
class _CountingEngine:
    """Stands in for autograd's engine while a step is counted: forwards every call, counts run_backward."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, 0

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@contextmanager
def counting_engine():
    """Every autograd engine call in the block (torch's and the runtime's all use ``Variable._execution_engine``)."""
    from torch.autograd.variable import Variable

    real = Variable._execution_engine
    counter = _CountingEngine(real)
    Variable._execution_engine = counter
    try:
        yield counter
    finally:
        Variable._execution_engine = real


def engine_calls(step: Callable[[], Any]) -> int:
    with counting_engine() as counter:
        step()
    return counter.calls


# ----- schedules ------------------------------------------------------------------------------------
def one_rank(name: str) -> Schedule:
    """``name``'s schedule on one rank: itself, or (DualPipe, which needs an even number of ranks) its
    two-rank program merged in the order the simulator starts the ops, every stage placed on rank 0."""
    if name != "dualpipe":
        return build_schedule(name, 1, MB)
    two = build_schedule(name, 2, MB)
    starts: list[list[float]] = [[] for _ in two.ranks]
    run_schedule(two, record=False, starts_out=starts)
    merged = sorted((t, r, i, op) for r, ops in enumerate(two.ranks) for i, (t, op) in enumerate(zip(starts[r], ops)))
    return Schedule(f"{name} (2 ranks' ops on one)", 1, MB, tuple(tuple(0 for _ in c) for c in two.placement),
                    two.microbatch_chain, [[e[3] for e in merged]])


def compute_ops(schedule: Schedule) -> int:
    """F, B, W and BW ops of rank 0 (an F&B unit counts as its two halves)."""
    return sum(2 if hasattr(ins, "f") else 1 for ins in schedule.ranks[0])


# ----- measuring -------------------------------------------------------------------------------------
class Variant:
    """One runtime's step for one schedule, and what was measured of it."""

    clock: Callable[[], float] = time.perf_counter  # main() sets the process's CPU time on a CPU run

    def __init__(self, label: str, step: Callable[[], Any] | None, sync: Callable[[], None], error: str | None = None):
        self.label, self.step, self.sync, self.error = label, step, sync, error
        self.times: list[float] = []
        self.ratios: list[float] = []
        self.calls: int | None = None

    def warm(self) -> float:
        """Run a step twice (the second counts engine calls); returns the first one's time (0 when it failed)."""
        if self.error is not None:
            return 0.0
        try:
            clock = Variant.clock
            t0 = clock()
            self.step()
            self.sync()
            took = clock() - t0
            self.calls = engine_calls(self.step)
            self.sync()
            return took
        except Exception as exc:  # noqa: BLE001 - a side-by-side row that cannot run says why
            self.error = f"{type(exc).__name__}: {str(exc)[:70]}"
            return 0.0

    def once(self) -> float:
        """One step's time."""
        gc.collect()
        clock = Variant.clock
        t0 = clock()
        self.step()
        self.sync()
        t = clock() - t0
        self.times.append(t)
        return t


class Row:
    """A schedule: plain autograd beside ours and torch's, measured side by side."""

    def __init__(self, name: str, ops: int, plain: Variant, ours: Variant, torch_: Variant | None):
        self.name, self.ops, self.plain, self.ours, self.torch = name, ops, plain, ours, torch_
        self.rounds = 1  # rounds per ``--rounds`` round: cheap rows get more (``ROUND_SECONDS``)

    def variants(self) -> list[Variant]:
        return [v for v in (self.plain, self.ours, self.torch) if v is not None and v.error is None]

    def round(self, reverse: bool) -> None:
        got = {}
        for v in (reversed(self.variants()) if reverse else self.variants()):
            got[id(v)] = v.once()
        base = got[id(self.plain)]
        for v in self.variants():
            v.ratios.append(got[id(v)] / base)


ROUND_SECONDS = 0.25
"""A row whose plain step is shorter gets more rounds: ``--rounds`` x ROUND_SECONDS of plain steps per ``--rounds``."""


def interleaved(rows: list[Row], rounds: int) -> None:
    """Warm every variant up, then run the rounds: per row, one step of each variant (order reversed every other
    round); a cheap row runs as many more rounds as fit ``ROUND_SECONDS`` per round, interleaved with the others."""
    warm: dict[int, float] = {}
    for row in rows:
        for v in (row.plain, row.ours, row.torch):
            if v is not None and id(v) not in warm:
                warm[id(v)] = v.warm()
        row.rounds = max(1, round(ROUND_SECONDS / max(warm[id(row.plain)], 1e-6)))
    for r in range(rounds * max(row.rounds for row in rows)):
        for row in rows:
            if r < rounds * row.rounds:
                row.round(reverse=bool(r % 2))


def _zero(mods: list[nn.Module]) -> None:
    for m in mods:
        for p in m.parameters():
            if p.grad is not None:
                p.grad.zero_()


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def ours_step(pipe: Pipeline, mods: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
              crit: Callable) -> Callable[[], None]:
    """One training step of ``pipe``: ``Pipeline.step``, or where the one rank feeds two chains (DualPipe's
    merged program, which ``step`` refuses: a rank feeds at most one chain) its executor's ``run`` with every
    micro-batch of both chains and the step-start row ``step`` would send."""
    sched = pipe.executor(MB).program.schedule
    if sum(1 for chain in sched.placement if chain[0] == 0) == 1:
        def step() -> None:
            _zero(mods)
            pipe.step(x, num_chunks=MB, criterion=crit, labels=(y,))
        return step
    ex = pipe.executor(MB)
    inputs = {m: (xm,) for m, xm in enumerate(x.chunk(MB))}
    labels = {m: (ym,) for m, ym in enumerate(y.chunk(MB))}
    checks = StepCheck(MB, 1, x.shape[0], y.shape[0], 0, BATCHED, BATCHED).row()

    def step_both() -> None:
        _zero(mods)
        ex.run(inputs, labels, crit, False, False, False, checks)
    return step_both


def _torch_variant(name: str | None, mods: list[nn.Module], device: torch.device, x: torch.Tensor,
                   y: torch.Tensor, crit: Callable) -> Variant | None:
    """torch.distributed.pipelining's schedule ``name`` over ``mods`` on this one rank (None: it has none)."""
    from torch.distributed import pipelining as pp

    if name is None or not hasattr(pp, name):
        return None
    label = f"torch {name}"
    try:
        stages = [pp.PipelineStage(m, i, len(mods), device) for i, m in enumerate(mods)]
        sched = getattr(pp, name)(stages if len(stages) > 1 else stages[0], MB, loss_fn=crit, scale_grads=False)
    except Exception as exc:  # noqa: BLE001
        return Variant(label, None, _sync(device), f"{type(exc).__name__}: {str(exc)[:70]}")

    def step() -> None:
        _zero(mods)
        sched.step(x, target=y, losses=[])

    return Variant(label, step, _sync(device))


# ----- the block stack ---------------------------------------------------------------------------------
class Block(nn.Module):
    """A pre-norm MLP block with a residual (``expand``: the MLP's width over ``hidden``)."""

    def __init__(self, hidden: int, expand: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, expand * hidden)
        self.down = nn.Linear(expand * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def stack_rows(hidden: int, device: torch.device, schedules: list[tuple[str, str | None]]) -> list[Row]:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(hidden) for _ in range(BLOCKS)]).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MB * ROWS, SEQ, hidden, generator=g).to(device)
    y = torch.randn(MB * ROWS, SEQ, hidden, generator=g).to(device)
    model = copy.deepcopy(blocks)
    xs, ys = x.chunk(MB), y.chunk(MB)
    sync = _sync(device)

    def plain_step() -> None:
        _zero([model])
        for xm, ym in zip(xs, ys):
            mse(model(xm), ym).backward()

    plain = Variant("plain", plain_step, sync)
    rows = []
    for ours_name, torch_name in schedules:
        sched = one_rank(ours_name)
        mods = split_model(copy.deepcopy(blocks), sched, 0, 1)  # DualPipe's two chains share the layers
        step = ours_step(Pipeline(mods, sched, timeout=120), mods, x, y, mse)
        theirs = _torch_variant(torch_name, split_model(copy.deepcopy(blocks), sched, 0, 1), device, x, y, mse)
        rows.append(Row(ours_name, compute_ops(sched), plain, Variant(f"ours {ours_name}", step, sync), theirs))
        if sched.splits_backward:  # the same schedule with every W run as a W: what the split itself costs
            kept = split_model(copy.deepcopy(blocks), sched, 0, 1)
            step = ours_step(Pipeline(kept, sched, timeout=120, fuse_backward=False), kept, x, y, mse)
            rows.append(Row(f"{ours_name}, every W split", compute_ops(sched), plain,
                            Variant(f"ours {ours_name} split", step, sync), None))
    return rows


# ----- DeepSeek-V3 stages ------------------------------------------------------------------------------
def deepseek_rows(device: torch.device, schedules: list[tuple[str, str | None]]) -> list[Row]:
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, criterion_for, stages_for_rank

    config = DeepSeekV3Config.preset("tiny")
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (MB, config.max_seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    plain_model = copy.deepcopy(model).to(device)
    sync = _sync(device)

    def plain_step() -> None:
        _zero([plain_model])
        for m in range(MB):
            plain_model(x[m:m + 1], y[m:m + 1]).backward()

    plain = Variant("plain model", plain_step, sync)
    rows = []
    for name, torch_name in schedules:
        sched = one_rank(name)
        fused = not sched.splits_backward
        mods = [m.to(device) for m in stages_for_rank(config, sched, 0, source=model, defer_weight_grads=not fused)]
        step = ours_step(Pipeline(mods, sched, timeout=120), mods, x, y, criterion_for(mods))
        tmods = [m.to(device) for m in stages_for_rank(config, sched, 0, source=model, defer_weight_grads=False)]
        theirs = _torch_variant(torch_name, tmods, device, x, y, criterion_for(tmods))
        label = f"{name} ({'BW fused' if fused else 'W deferred'})"
        rows.append(Row(label, compute_ops(sched), plain, Variant(f"ours {name}", step, sync), theirs))
        if not fused:  # every W of the schedule run as a W (one rank fuses them all): the split's own cost
            kept = [m.to(device) for m in stages_for_rank(config, sched, 0, source=model)]
            step = ours_step(Pipeline(kept, sched, timeout=120, fuse_backward=False), kept, x, y, criterion_for(kept))
            rows.append(Row(f"{name} (every W split)", compute_ops(sched), plain,
                            Variant(f"ours {name} split", step, sync), None))
    return rows


# ----- output --------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cells(v: Variant | None, row: Row) -> tuple[str, str, str, str]:
    """ms, ratio to plain, engine calls, runtime µs per op ((ratio - 1) x plain / ops) of one variant."""
    if v is None:
        return "—", "—", "—", "—"
    if v.error is not None:
        return "n/a", v.error, "", ""
    ratio = _median(v.ratios)
    per_op = (ratio - 1) * _median(row.plain.times) / row.ops * 1e6
    return f"{_median(v.times) * 1e3:.1f}", f"{ratio:.3f}", str(v.calls), f"{per_op:.0f}"


def table(title: str, rows: list[Row], ref: str) -> Table:
    t = Table(title=title)
    cols = ("schedule", "ops", "ours ms", f"ours / {ref}", "torch ms", f"torch / {ref}", "engine calls ours | torch",
            "µs / op ours | torch")
    for col in cols:
        t.add_column(col, justify="left" if col == "schedule" else "right")
    plain = rows[0].plain
    t.add_row(f"{ref} autograd", "", f"{_median(plain.times) * 1e3:.1f}", "1.000", "", "", str(plain.calls), "")
    for row in rows:
        ours, theirs = _cells(row.ours, row), _cells(row.torch, row)
        t.add_row(row.name, str(row.ops), ours[0], ours[1], theirs[0], theirs[1], f"{ours[2]} | {theirs[2]}",
                  f"{ours[3]} | {theirs[3]}")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:i]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--parts", default="stack,deepseek")
    ap.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                    help="auto: the process's CPU time on CPU (others' load on a shared machine hardly moves it; the "
                         "process computes on one thread), wall time on a GPU")
    ap.add_argument("--hidden", default="64,256", help="the block stack's hidden sizes")
    ap.add_argument("--schedules", default=",".join(name for name, _ in SCHEDULES), help="the rows to run")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    wanted = args.schedules.split(",")
    schedules = [(name, theirs) for name, theirs in SCHEDULES if name in wanted]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    console = Console(width=160)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock = args.clock if args.clock != "auto" else ("cpu" if device.type == "cpu" else "wall")
    Variant.clock = time.process_time if clock == "cpu" else time.perf_counter
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"torch {torch.__version__}, {device} ({where}), {os.cpu_count()} core(s), load {load:.2f}; "
                  f"{args.rounds} rounds, rows interleaved, {clock} time; ratios are medians of per-round ratios")
    _init_one(device)
    try:
        if "stack" in parts:
            for hidden in (int(h) for h in args.hidden.split(",")):
                rows = stack_rows(hidden, device, schedules)
                interleaved(rows, args.rounds)
                console.print(table(f"{BLOCKS} pre-norm MLP blocks, hidden {hidden}, {MB} micro-batches of {ROWS} x "
                                    f"{SEQ} tokens, one process", rows, "plain"))
        if "deepseek" in parts:
            rows = deepseek_rows(device, schedules)
            interleaved(rows, args.rounds)
            console.print(table(f"DeepSeek-V3 stages (tiny preset), {MB} micro-batches of 1 x 256 tokens, one process",
                                rows, "plain"))
    finally:
        dist.destroy_process_group()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"load at the end {load:.2f}")
    return 0


def _init_one(device: torch.device) -> None:
    """A world of one rank on ``device`` (nccl on CUDA, gloo on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


if __name__ == "__main__":
    raise SystemExit(main())
