"""A user's own stack (per-block activation checkpointing, per-block ``torch.compile``) under the split
schedules: mt_dualpipe beside ``torch.distributed.pipelining``, same model, same data, one run.

The model is plain PyTorch: 8 residual blocks (RMSNorm -> Linear(h, 4h) -> GELU -> Linear(4h, h)),
cut into 4 stages of 2 blocks for the two-stages-per-rank schedules (ours ``zbv``, ``dualpipev``;
torch's ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, ``ScheduleInterleavedZeroBubble``) and into
2 stages of 4 blocks for the one-stage-per-rank ones (ours ``1f1b``, ``zb-h1``; torch's
``Schedule1F1B``). 2 gloo ranks on CPU, one thread each, 6 micro-batches. Per row:

- **forwards per block per step** with ``checkpoint_wrapper`` (non-reentrant) on every block: each
  block's forward calls (F and every recompute) counted by a forward pre-hook, per step; the ideal
  is 2 x 6 = 12 (once in F, once in B's recompute);
- **eager and compiled step time** (median over the timed steps of the slowest rank's step, after
  warm-up steps that include the compile), and their ratio: every block ``block.compile()``'d
  (inductor), as torchtitan does. Torch's V/interleaved zero-bubble schedules crash on compiled
  blocks with AOTAutograd's default buffer donation (checked at the end of the run, see the crash
  column), so torch's compiled rows run with ``torch._functorch.config.donated_buffer = False``;
  ours run with the defaults (the library turns donation off itself);
- **compiled backward runs per compiled forward**: the same compile with a counting ``aot_eager``
  backend (AOTAutograd, whose compiled backward counts its calls); 1.0 means each block's compiled
  backward ran once per micro-batch, 2.0 that W ran it again;
- **peak allocated bytes during a step** (eager, with and without AC): every CPU allocation and free
  of two steps, from ``torch.profiler`` with ``profile_memory=True``, summed in time order; the peak
  of that running sum during the second step, max over the ranks. Parameters and their gradients
  exist before (gradients zeroed in place), so this is activations, recomputed tensors, the
  runtime's buffers and temporaries, counted the same way for both runtimes (a saved-tensor-hooks
  count would miss what a non-reentrant checkpoint keeps under its own hooks);
- **gradients** of every step measured (AC, eager, compiled) against the same model on one process:
  the largest cosine difference over all parameters.

The results go to ``benchmarks/results/user_stack.md`` (``--append`` adds a run, ``--out ''`` writes none).
About 2 minutes on 2 cores with inductor's cache warm (the first compile of a fresh machine adds more).

    python benchmarks/user_stack.py [--quick] [--micro-batches 6] [--rows 32] [--hidden 256] [--steps 2]
                                    [--block plain|written-out] [--rounds 6] [--only zbv,dualpipe]
                                    [--no-crash-check] [--append]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from local_ranks import run_local  # noqa: E402  (benchmarks/, the script's own folder)

P = 2
BLOCKS = 8
# (side, schedule) rows, ours and torch's paired by kind
ROWS = [("mt_dualpipe", "1f1b"), ("torch", "Schedule1F1B"),
        ("mt_dualpipe", "zb-h1"), ("torch", "ScheduleInterleavedZeroBubble"),
        ("mt_dualpipe", "zbv"), ("torch", "ScheduleZBVZeroBubble"),
        ("mt_dualpipe", "dualpipev"), ("torch", "ScheduleDualPipeV")]
CRASH_CHECK = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class Block(nn.Module):
    """A residual MLP block: x + Linear(GELU(Linear(RMSNorm(x))))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class WrittenOutBlock(nn.Module):
    """The same block with its memory-bound ops written out as Hugging Face models write them: RMSNorm as
    ``x * rsqrt(mean(x^2) + eps) * w`` (``LlamaRMSNorm``) and the tanh-approximated GELU as
    ``0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))`` (``NewGELUActivation``). Eager runs each as a
    chain of elementwise kernels over the 4h-wide tensor; inductor fuses each chain into one, so this is
    the model on which compiling pays even on a CPU (``--block written-out``)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        u = self.up(n)
        g = 0.5 * u * (1.0 + torch.tanh(0.7978845608028654 * (u + 0.044715 * u.pow(3))))
        return x + self.down(g)


BLOCK_KINDS = {"plain": Block, "written-out": WrittenOutBlock}


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / max((x * x + y * y).sum().item(), 1e-300)


def counting_backend() -> tuple:
    """aot_eager whose compiled forward and backward count their calls."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls = {"forward": 0, "backward": 0}

    def fw(gm, example_inputs):
        def run(*args):
            calls["forward"] += 1
            return gm.forward(*args)
        return make_boxed_func(run)

    def bw(gm, example_inputs):
        def run(*args):
            calls["backward"] += 1
            return gm.forward(*args)
        return make_boxed_func(run)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw), calls


def reference(blocks: list[Block], x: torch.Tensor, y: torch.Tensor, m: int) -> list[list[torch.Tensor]]:
    """Each block's parameter gradients of the summed per-micro-batch losses, on one process."""
    blocks = copy.deepcopy(blocks)
    for xm, ym in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        h = xm
        for b in blocks:
            h = b(h)
        loss_fn(h, ym).backward()
    return [[p.grad for p in b.parameters()] for b in blocks]


class Runner:
    """One schedule of one runtime on this rank: the local blocks (as the user transformed them) and a step."""

    def __init__(self, side: str, name: str, rank: int, blocks: list[Block], x, y, m: int,
                 variant: str, backend=None, group=None) -> None:
        self.m = m
        self.variant = variant
        self.calls: dict[int, int] = {}
        n_stages = 2 * P if name not in ("1f1b", "zb-h1", "Schedule1F1B") else P
        per_stage = BLOCKS // n_stages
        if side == "mt_dualpipe":
            from mt_dualpipe.schedules import build_schedule

            sched = build_schedule(name, P, m)
            assert len(sched.placement[0]) == n_stages, (name, sched.placement)
            stage_ids = [s for _, s in sched.local_stages(rank)]
        elif name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
            stage_ids = [rank, 2 * P - 1 - rank]
        elif name == "ScheduleInterleavedZeroBubble":
            stage_ids = [rank, rank + P]
        else:
            stage_ids = [rank]
        self.local: dict[int, Block] = {}  # global block index -> this rank's copy
        mods = []
        for s in stage_ids:
            seq = []
            for j in range(per_stage):
                i = s * per_stage + j
                b = copy.deepcopy(blocks[i])
                self.local[i] = b
                if variant == "ac":
                    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                        CheckpointImpl,
                        checkpoint_wrapper,
                    )

                    self.calls[i] = 0
                    b.register_forward_pre_hook(functools.partial(self._count, i))
                    seq.append(checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
                else:
                    if variant == "compiled":
                        b.compile(backend=backend)
                    seq.append(b)
            mods.append(nn.Sequential(*seq))
        self.params = {i: list(b.parameters()) for i, b in self.local.items()}
        if side == "mt_dualpipe":
            from mt_dualpipe import Pipeline

            pipe = Pipeline(mods, sched, timeout=120)
            self.pipe = pipe
            first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
            last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
            assert len(sched.placement) == 1  # one chain: the whole batch enters at its first rank
            inp, lab = ((x,) if first else ()), ((y,) if last else ())
            self._run = lambda: pipe.step(*inp, num_chunks=m, criterion=loss_fn, labels=lab)
        else:
            from torch.distributed import pipelining as pp

            stages = [pp.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=group)
                      for mod, s in zip(mods, stage_ids)]
            cls = getattr(pp, name)
            sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn, scale_grads=False)
            first, last = 0 in stage_ids, n_stages - 1 in stage_ids

            def run():
                kwargs = {"target": y, "losses": []} if last else {}
                sched.step(*((x,) if first else ()), **kwargs)
            self._run = run

    def _count(self, i: int, module, args) -> None:
        self.calls[i] += 1

    def step(self) -> None:
        """One training step from zeroed gradients (zeroed in place once they exist: no allocation)."""
        for ps in self.params.values():
            for p in ps:
                if p.grad is not None:
                    p.grad.zero_()
        self._run()

    def grads(self) -> dict[int, list[torch.Tensor | None]]:
        return {i: [None if p.grad is None else p.grad.clone() for p in ps] for i, ps in self.params.items()}


def peak_allocated(step) -> int:
    """The peak during a step of the bytes allocated and not yet freed since the start of the step before it.

    ``torch.profiler`` (``profile_memory=True``) around two steps: every CPU allocation and free, summed in
    time order from the start of the first; the peak of that sum while the second runs. Whatever the first
    step leaves alive into the second (a runtime that frees a step's activations late) is counted;
    what existed before the first step (the model, its gradients) is not."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("measured_step"):
            step()
    events = list(prof.profiler.kineto_results.events())
    start = min(e.start_ns() for e in events if e.name() == "measured_step")
    end = max(e.end_ns() for e in events if e.name() == "measured_step")
    live = peak = 0
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += n
        if start <= t <= end:
            peak = max(peak, live)
    return peak


def timed(step, steps: int) -> list[float]:
    """Per step: the slowest rank's wall time."""
    out = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(t.item())
    return out


def gathered(obj):
    got = [None] * P
    dist.all_gather_object(got, obj)
    return got


def grad_error(per_rank: list[dict], ref: list[list[torch.Tensor]]) -> float:
    """Largest cosine difference of any parameter gradient against the one-process reference
    (inf when a gradient is missing)."""
    worst = 0.0
    summed: dict[int, list] = {}
    for d in per_rank:
        for i, gs in d.items():
            summed[i] = gs if i not in summed else [a if b is None else (b if a is None else a + b)
                                                    for a, b in zip(summed[i], gs)]
    if sorted(summed) != list(range(BLOCKS)):
        return float("inf")
    for i, gs in summed.items():
        for g, r in zip(gs, ref[i]):
            worst = max(worst, float("inf") if g is None else cos_diff(g, r))
    return worst


def measure(side: str, name: str, rank: int, blocks, x, y, ref, args) -> dict:
    import torch._dynamo
    import torch._functorch.config as fconfig

    m, row = args.micro_batches, {"side": side, "schedule": name}
    # 1. per-block activation checkpointing, eager: forwards per block per step, peak bytes, gradients
    r = Runner(side, name, rank, blocks, x, y, m, "ac")
    r.step()  # warm-up: gradients exist from here on
    row["ac_peak"] = max(gathered(peak_allocated(r.step)))
    r.calls = dict.fromkeys(r.calls, 0)
    r.step()  # the counted step
    calls = {}
    for c in gathered(r.calls):
        calls.update(c)
    row["ac_forwards"] = [calls[i] for i in sorted(calls)]  # per block, in model order
    row["ac_grad_err"] = grad_error(gathered(r.grads()), ref)
    del r
    # 2. eager, no AC: peak bytes, gradients, step time
    r = Runner(side, name, rank, blocks, x, y, m, "eager")
    r.step()
    row["eager_peak"] = max(gathered(peak_allocated(r.step)))
    row["eager_grad_err"] = grad_error(gathered(r.grads()), ref)
    if side == "mt_dualpipe":  # the library's own recorder (saved tensors) and in-flight micro-batches, eager
        r.pipe.record_activation_bytes = True
        r.step()
        r.pipe.record_activation_bytes = False
        got = gathered((r.pipe.peak_activation_bytes, r.pipe.peak_activations))
        row["mt_recorded"] = (max(g[0] for g in got), [g[1] for g in got])
    eager_step = r.step
    # 3. compiled blocks (inductor): step time (warm-ups compile), gradients
    torch._dynamo.reset()
    donation = fconfig.donated_buffer
    if side == "torch":
        fconfig.donated_buffer = False  # torch's own pipelining needs it (crash check below)
    try:
        c = Runner(side, name, rank, blocks, x, y, m, "compiled", backend=args.backend)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            c.step()
        row["compile_s"] = time.perf_counter() - t0
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(args.warmup - 1):
            eager_step()
        eager_times, compiled_times = [], []
        for _ in range(args.rounds):  # interleaved: both see the same machine load
            eager_times += timed(eager_step, args.steps)
            compiled_times += timed(c.step, args.steps)
        row["eager_ms"] = 1e3 * statistics.median(eager_times)
        row["compiled_ms"] = 1e3 * statistics.median(compiled_times)
        row["recompiles"] = max(gathered(torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs))
        row["compiled_grad_err"] = grad_error(gathered(c.grads()), ref)
        del c
        # 4. the same compile with a counting aot_eager backend: compiled backward runs per forward run
        torch._dynamo.reset()
        backend, counts = counting_backend()
        c = Runner(side, name, rank, blocks, x, y, m, "compiled", backend=backend)
        c.step()
        f0, b0 = counts["forward"], counts["backward"]
        c.step()
        fw, bw = gathered((counts["forward"] - f0, counts["backward"] - b0)), None
        bw = sum(b for _, b in fw)
        fw = sum(f for f, _ in fw)
        row["compiled_fw"], row["compiled_bw"] = fw, bw
        row["count_grad_err"] = grad_error(gathered(c.grads()), ref)
        del c
    finally:
        fconfig.donated_buffer = donation
        torch._dynamo.reset()
    return row


def crash_check(name: str, rank: int, blocks, x, y, args) -> str:
    """Torch's ``name`` on compiled blocks with AOTAutograd's default buffer donation: '' or the error."""
    import torch._dynamo
    import torch._functorch.config as fconfig

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.crash_timeout))
    torch._dynamo.reset()
    assert fconfig.donated_buffer, "the default is expected to donate"
    try:
        backend = counting_backend()[0] if args.crash_backend == "aot_eager" else args.crash_backend
        c = Runner("torch", name, rank, blocks, x, y, args.micro_batches, "compiled", backend=backend, group=group)
        c.step()
        return ""
    except Exception as e:  # noqa: BLE001  (what the user sees is the point)
        chain, err = [], e
        while err is not None and len(chain) < 8:
            chain.append(err)
            err = err.__cause__ or err.__context__
        root = next((c for c in chain if "donated" in str(c)), chain[0])  # AOTAutograd's own message
        return f"{type(root).__name__}: {' '.join(str(root).split())[:400]}"
    finally:
        torch._dynamo.reset()


def single_process(blocks: list[Block], x, y, args) -> dict:
    """What compile gives this model on one process: the same steps (every micro-batch's forward and
    backward through all blocks) eager, each block compiled whole, and each block compiled with its
    linears split out of the graph's backward (what mt_dualpipe does to a compiled block of a stage that
    has W ops; with no store active each weight gradient is accumulated at once). Medians in ms."""
    import torch._dynamo

    from mt_dualpipe.runtime.compiled import split_products

    mods = {}
    for kind in ("eager", "compiled", "linears eager"):
        if kind == "compiled":
            torch._dynamo.reset()
        bs = copy.deepcopy(blocks)
        if kind != "eager":
            for b in bs:
                b.compile(backend=args.backend)
        mods[kind] = nn.Sequential(*bs)
        if kind == "linears eager":
            split_products(mods[kind])
    parts = list(zip(torch.tensor_split(x, args.micro_batches), torch.tensor_split(y, args.micro_batches)))

    def step(m):
        for xm, ym in parts:
            loss_fn(m(xm), ym).backward()

    times: dict[str, list[float]] = {k: [] for k in mods}
    for m in mods.values():
        for _ in range(args.warmup):
            step(m)
    for _ in range(args.rounds):
        for k, m in mods.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(m)
                times[k].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def worker(rank, ranks, port, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    blocks = [BLOCK_KINDS[args.block](args.hidden) for _ in range(BLOCKS)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.micro_batches * args.rows, args.hidden, generator=g)
    y = torch.randn(args.micro_batches * args.rows, args.hidden, generator=g)
    ref = reference(blocks, x, y, args.micro_batches)
    rows, single = [], {}
    if rank == 0 and not args.crash_only:
        single = single_process(blocks, x, y, args)
    dist.barrier()
    for side, name in ([] if args.crash_only else ROWS):
        if args.only and not any(o.lower() in name.lower() for o in args.only.split(",")):
            continue
        rows.append(measure(side, name, rank, blocks, x, y, ref, args))
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {side} {name}: done", flush=True)
    crashes = {}
    if not args.no_crash_check:
        for name in CRASH_CHECK:
            if args.only and not any(o.lower() in name.lower() for o in args.only.split(",")):
                continue
            errs = [e for e in gathered(crash_check(name, rank, blocks, x, y, args)) if e]
            crashes[name] = sorted(errs, key=lambda e: "donated" not in e)  # the root cause first
    if rank == 0:
        out.put({"rows": rows, "crashes": crashes, "single": single})
    dist.barrier()
    dist.destroy_process_group()


def forwards(per_block: list[int]) -> str:
    """Forwards per block per step, e.g. '12' (every block) or '12 x2, 30 x6' (blocks per count)."""
    counts = sorted(set(per_block))
    if len(counts) == 1:
        return str(counts[0])
    return ", ".join(f"{c} x{per_block.count(c)}" for c in counts)


def cells(r: dict) -> list[str]:
    errs = max(r[k] for k in ("ac_grad_err", "eager_grad_err", "compiled_grad_err", "count_grad_err"))
    return [r["side"], r["schedule"], forwards(r["ac_forwards"]),
            f"{statistics.mean(r['ac_forwards']):.1f}",
            f"{r['eager_ms']:.1f}", f"{r['compiled_ms']:.1f}", f"{r['compiled_ms'] / r['eager_ms']:.2f}",
            f"{r['compiled_bw'] / max(r['compiled_fw'], 1):.2f} ({r['compiled_bw']}/{r['compiled_fw']})",
            f"{r['eager_peak'] / 2**20:.2f}", f"{r['ac_peak'] / 2**20:.2f}", f"{r['ac_peak'] / r['eager_peak']:.2f}",
            f"{errs:.0e}", str(r["recompiles"])]


COLUMNS = ("runtime", "schedule", "forwards/block/step with AC", "mean", "eager ms", "compiled ms",
           "compiled/eager", "compiled bwd runs / fwd runs", "peak MiB eager", "peak MiB AC", "AC/eager peak",
           "worst grad cos diff", "graphs compiled while timed")


def title(args: argparse.Namespace) -> str:
    kind = "" if args.block == "plain" else ", RMSNorm and tanh-GELU written out as HF does"
    return (f"{P} gloo ranks on CPU, 1 thread each, {BLOCKS} residual blocks (RMSNorm-Linear-GELU-Linear{kind}, hidden "
            f"{args.hidden}, 4x), {args.micro_batches} micro-batches of {args.rows} rows (ideal forwards/block/step "
            f"with AC: {2 * args.micro_batches}); step ms: median of {args.rounds}x{args.steps} steps (slowest rank)")


def single_line(single: dict) -> str:
    e = single["eager"]
    return ("The same model on one process, no pipeline (same micro-batches, median ms per step): eager "
            f"{e:.1f}, every block compiled {single['compiled']:.1f} ({single['compiled'] / e:.2f}x), every block "
            f"compiled with its linears split (mt_dualpipe's way in a split stage) {single['linears eager']:.1f} "
            f"({single['linears eager'] / e:.2f}x).")


def render(res: dict, args: argparse.Namespace):
    from rich.table import Table

    t = Table(title="A user's stack under split schedules: " + title(args))
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(*cells(r))
    return t


METHOD = """
How each figure is taken (`benchmarks/user_stack.py`, both runtimes treated identically):

- **forwards/block/step with AC**: every block wrapped in `checkpoint_wrapper(..., CheckpointImpl.NO_REENTRANT)`,
  a forward pre-hook on the inner block counts its calls (F and each recompute) during one step after a
  warm-up step. `12 x2, 30 x6` means two blocks ran 12 forwards and six ran 30. The ideal is 2 x micro-batches
  (once in F, once in B's recompute).
- **eager / compiled ms**: every block `block.compile()`d (inductor) as torchtitan does, nothing else changed;
  median over the timed steps of the slowest rank's step (barrier before each), eager and compiled rounds
  interleaved, after warm-up steps that include the compile. Torch's compiled rows run with
  `torch._functorch.config.donated_buffer = False` (they crash with the default, below); mt_dualpipe's run with
  torch's defaults (the library turns donation off itself, and in a stage with W ops traces each block's linears
  as `mt_dualpipe::linear`, whose backward leaves the weight-gradient GEMM to W: a block stays one graph).
- **compiled bwd runs / fwd runs**: the same per-block compile with a counting `aot_eager` backend (AOTAutograd
  whose compiled forward and backward count their calls), one step after a first one, both ranks summed.
  1.00 = each compiled backward ran once per compiled forward; above 1, W re-ran compiled backwards that B had
  already run.
- **peak MiB**: `torch.profiler` with `profile_memory=True` around two steps (eager; without and with AC): every
  CPU allocation and free, summed in time order from the start of the first step; the peak of that running sum
  during the second step, max over the ranks (what the first step leaves alive into the second counts).
  Gradients exist before (zeroed in place), so the figure is what the steps allocate on top of the model:
  activations and what autograd saves, checkpoint recomputes, the runtime's receive buffers and temporaries.
  This is used rather than a `saved_tensors_hooks` count (mt_dualpipe's own `record_activation_bytes`) because
  such hooks do not see what a non-reentrant checkpoint saves and recomputes under its own hooks, and torch's
  pipelining has no recorder of its own; allocator events see both runtimes the same way, including the
  recomputed tensors W keeps alive. It includes transient temporaries, so it is an upper bound on activation
  bytes.
- **worst grad cos diff**: every block's parameter gradients after each measured step (AC, eager, inductor,
  counting aot_eager), summed over ranks, against the same 8 blocks run on one process (sum of the
  micro-batches' MSE losses): the largest `1 - cos` over all parameters.
"""


def markdown(res: dict, args: argparse.Namespace, argv: list[str], wall: float, header: bool = True) -> str:
    lines = []
    if header:
        lines += ["# A user's stack under the split schedules: mt_dualpipe beside torch.distributed.pipelining", "",
                  "Issue 32's side-by-side: per-block activation checkpointing and per-block `torch.compile` on the "
                  "same plain PyTorch model, mt_dualpipe's schedules and `torch.distributed.pipelining`'s, one run.",
                  METHOD]
    lines += [
        f"## Run: {args.micro_batches} micro-batches of {args.rows} rows", "",
        f"- command: `{' '.join(['python benchmarks/user_stack.py', *argv])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time {wall:.0f} s",
        f"- machine: {platform.machine()}, nproc {os.cpu_count()} (shared with other jobs), Python "
        f"{platform.python_version()}, torch {torch.__version__}, compile backend {args.backend}",
        f"- setup: {title(args)}; 4 stages x 2 blocks for the V/interleaved schedules, 2 x 4 for "
        f"1f1b/zb-h1/Schedule1F1B; fp32; eager and compiled rounds interleaved, {args.warmup} warm-up steps", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in res["rows"]:
        lines.append("| " + " | ".join(cells(r)) + " |")
    recorded = [(r["schedule"], *r["mt_recorded"]) for r in res["rows"] if "mt_recorded" in r]
    if recorded:
        lines += ["", "mt_dualpipe's own recorder (`record_activation_bytes`: saved tensors only, eager, max over "
                      "ranks) and its peak in-flight activations per rank (`peak_activations`): "
                  + "; ".join(f"{n} {b / 2**20:.2f} MiB, {a}" for n, b, a in recorded) + "."]
    if res["single"]:
        lines += ["", single_line(res["single"])]
    if res["crashes"]:
        lines += ["", f"Torch's schedules on compiled blocks ({args.crash_backend}) with AOTAutograd's default buffer "
                      "donation:", ""]
        for name, errs in res["crashes"].items():
            lines.append(f"- `{name}`: " + ("runs" if not errs else "crashes: `" + errs[0] + "`"))
    return "\n".join(lines) + "\n\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer timed steps (a smoke run)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--block", choices=sorted(BLOCK_KINDS), default="plain",
                   help="'written-out': RMSNorm and GELU as HF writes them (chains inductor fuses)")
    p.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--micro-batches", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and variant")
    p.add_argument("--rounds", type=int, default=6, help="rounds, eager and compiled alternating")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor", help="the timed compile's backend")
    p.add_argument("--crash-backend", default="inductor", help="backend of the donation crash check")
    p.add_argument("--crash-timeout", type=float, default=10, help="seconds a rank waits on a crashed peer")
    p.add_argument("--no-crash-check", action="store_true")
    p.add_argument("--crash-only", action="store_true", help="only the donation crash check")
    p.add_argument("--only", default="", help="comma-separated substrings of schedule names to run")
    p.add_argument("--append", action="store_true", help="add this run to the results file (no header)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "user_stack.md"), help="results file ('' for none)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 1, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rich.console import Console

    t0 = time.perf_counter()
    res = run_local(worker, P, (args,), 1800)
    wall = time.perf_counter() - t0
    console = Console(width=240)
    if res["rows"]:
        console.print(render(res, args))
    if res["single"]:
        console.print(single_line(res["single"]))
    for name, errs in res["crashes"].items():
        console.print(f"torch {name} on compiled blocks, default buffer donation: "
                      + ("runs" if not errs else "crashes: " + errs[0]), markup=False)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(markdown(res, args, argv, wall, header=not args.append))
        console.print(f"written: {args.out}")


if __name__ == "__main__":
    main()
