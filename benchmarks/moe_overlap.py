"""How much of the MoE all-to-all DualPipe's F&B units hide, for every MoE family, measured from outside.

4 local gloo ranks, pp 2 x ep 2, DualPipeV and DualPipe, 8 micro-batches; three models: DeepSeek-V3's and
Qwen3-MoE's tiny presets and a model composed here from ``mt_dualpipe.layers`` (RMSNorm, GQA attention,
``MoEBlock`` with an EP group) with no overlap code of its own. Every ``all_to_all_single`` gets an injected
latency L: a synchronous call sleeps L after it returns; an asynchronous one's ``wait`` ends no earlier than
L after the post, like a slow network that the caller may overlap.

    exposed fraction = (step time at L - step time at 0) / (all-to-alls per step x L)

1.0 means no all-to-all time is hidden, 0 all of it. Each row is measured with the F&B units overlapped (the
runtime's default) and run F then B (``runtime.overlap.sequential_units``): each step with latency (slowest
rank) right after one without, the added time the median of ``--rounds`` such pairs; "bit-identical" compares
every gradient of the overlapped step with the F-then-B one.

Four processes on two cores: while one rank sleeps through an injected latency another rank's process computes,
so even F then B hides part of it (below 1.0), and a rank's own overlap has less idle CPU to fill than on a
machine with a core per rank. The figures move by about ±0.15 from run to run here; run it several times.

    python benchmarks/moe_overlap.py [--latency 4 8] [--rounds 5] [--families deepseek qwen3 layers]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe.layers import GQAttention, MoEBlock, RMSNorm, RopeSpec, SoftmaxTopKRouter, init_normal  # noqa: E402
from mt_dualpipe.parallel import init_parallel  # noqa: E402
from mt_dualpipe.runtime import Pipeline  # noqa: E402
from mt_dualpipe.runtime.overlap import sequential_units  # noqa: E402
from mt_dualpipe.schedules import build_schedule  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402

MICROBATCHES = 8
SEQ = 32
VOCAB = 64


class LatencyInjector:
    """Wraps ``dist.all_to_all_single``: counts calls and delays them by ``latency`` seconds."""

    def __init__(self) -> None:
        self.latency, self.calls = 0.0, 0
        self.real = dist.all_to_all_single
        dist.all_to_all_single = self._call

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        posted = time.perf_counter()
        work = self.real(*args, **kwargs)
        if not kwargs.get("async_op"):
            time.sleep(self.latency)
            return work
        return _LateWork(work, posted + self.latency)


class _LateWork:
    def __init__(self, work: Any, due: float) -> None:
        self.work, self.due = work, due

    def wait(self, *args: Any) -> Any:
        done = self.work.wait(*args)
        delay = self.due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return done


# ----- a model composed from the shared layer, with no overlap code of its own --------------------------------
class ComposedBlock(nn.Module):
    def __init__(self, hidden: int, ep_group: Any) -> None:
        super().__init__()
        self.attn_norm, self.moe_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = GQAttention(hidden, 4, 2, hidden // 4, RopeSpec(10000.0))
        self.moe = MoEBlock(hidden, 2 * hidden, SoftmaxTopKRouter(hidden, 8, 2), ep_group=ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class ComposedStage(nn.Module):
    def __init__(self, hidden: int, blocks: int, first: bool, last: bool, ep_group: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden) if first else None
        self.blocks = nn.ModuleList(ComposedBlock(hidden, ep_group) for _ in range(blocks))
        self.head = nn.Linear(hidden, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def _composed(sched: Any, pp: int, ep_group: Any) -> tuple[list[nn.Module], Any]:
    torch.manual_seed(0)
    n = sched.num_stages()
    mods = [ComposedStage(64, 2, s == 0, s == n - 1, ep_group) for _, s in sched.local_stages(pp)]
    for m in mods:
        init_normal(m, 0.02)
        for block in m.blocks:
            nn.init.normal_(block.moe.gate.weight, 0.0, 0.02)  # a router's weight is the family's to initialise
    last = any(s == n - 1 for _, s in sched.local_stages(pp))
    return mods, (lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())) if last else None


def _family(name: str, sched: Any, pp: int, ep_group: Any) -> tuple[list[nn.Module], Any]:
    if name == "layers":
        return _composed(sched, pp, ep_group)
    torch.manual_seed(0)
    if name == "deepseek":
        from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, criterion_for, stages_for_rank

        config = DeepSeekV3Config.preset("tiny", vocab_size=VOCAB, max_seq_len=SEQ)
    else:
        from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, criterion_for, stages_for_rank

        config = Qwen3MoeConfig.preset("tiny", vocab_size=VOCAB)
    mods = stages_for_rank(config, sched, pp, ep_group=ep_group)
    return mods, criterion_for(mods)


def _step(pipe: Pipeline, sched: Any, pp: int, criterion: Any, tokens: torch.Tensor) -> None:
    first = [c for c, ch in enumerate(sched.placement) if ch[0] == pp]
    last = [c for c, ch in enumerate(sched.placement) if ch[-1] == pp]
    half = tokens.chunk(len(sched.placement))
    x = [h[:, :-1] for h in half]
    y = [h[:, 1:] for h in half]
    pipe.step(*((x[first[0]],) if first else ()), num_chunks=MICROBATCHES, criterion=criterion,
              labels=(y[last[0]],) if last else ())


def _measure(rank: int, world: int, family: str, schedule: str, latencies: list[float], rounds: int) -> dict:
    torch.set_num_threads(1)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp, ep_group = dims.coord("pp"), dims.group("ep")
    sched = build_schedule(schedule, 2, MICROBATCHES)
    mods, criterion = _family(family, sched, pp, ep_group)
    pipe = Pipeline(mods, sched, mesh=dims, dp_batch="local", timeout=120)
    inject = LatencyInjector()
    g = torch.Generator().manual_seed(1 + dims.coord("ep"))
    tokens = torch.randint(0, VOCAB, (MICROBATCHES * len(sched.placement), SEQ + 1), generator=g)

    def once(mode: str) -> tuple[float, dict[str, torch.Tensor]]:
        for m in mods:
            m.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with sequential_units() if mode == "sequential" else contextlib.nullcontext():
            _step(pipe, sched, pp, criterion, tokens)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
                 if p.grad is not None}
        return took.item(), grads

    once("overlapped")  # warm-up: shapes learned, caches filled
    inject.calls = 0
    once("overlapped")
    calls = inject.calls
    added: dict[tuple[float, str], list[float]] = {}
    same = True
    for _ in range(rounds):
        for mode in ("overlapped", "sequential"):
            inject.latency = 0.0
            base, plain = once(mode)
            for latency in latencies:  # each latency's step right after its own step without: paired differences
                inject.latency = latency
                took, got = once(mode)
                added.setdefault((latency, mode), []).append(took - base)
                inject.latency = 0.0
                base, _ = once(mode)
            if mode == "overlapped":
                reference = plain
            else:
                same &= reference.keys() == plain.keys() and all(torch.equal(reference[k], plain[k]) for k in plain)
    return {"calls": calls, "added": {k: statistics.median(v) for k, v in added.items()}, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, nargs="+", default=[4.0, 8.0], help="injected latency, ms")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--families", nargs="+", default=["deepseek", "qwen3", "layers"])
    parser.add_argument("--schedules", nargs="+", default=["dualpipev", "dualpipe"])
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    names = {"deepseek": "DeepSeek-V3 (tiny)", "qwen3": "Qwen3-MoE (tiny)", "layers": "composed from layers"}
    table = Table(title="Exposed fraction of the injected all-to-all latency (pp 2 x ep 2, 8 micro-batches)")
    for col in ("model", "schedule", "L (ms)", "all-to-alls / step", "overlapped", "F then B", "bit-identical"):
        table.add_column(col, justify="left" if col in ("model", "schedule") else "right")
    latencies = [v / 1000 for v in args.latency]
    for family in args.families:
        for schedule in args.schedules:
            res = run_ranks(_measure, 4, family, schedule, latencies, args.rounds, timeout=1800)
            calls = max(r["calls"] for r in res)
            added = res[0]["added"]  # the slowest rank's step: the same on every rank
            for latency in latencies:
                exposed = {mode: added[latency, mode] / (calls * latency) for mode in ("overlapped", "sequential")}
                table.add_row(names[family], schedule, f"{latency * 1000:g}", str(calls),
                              f"{exposed['overlapped']:.2f}", f"{exposed['sequential']:.2f}",
                              "yes" if all(r["same"] for r in res) else "NO")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
