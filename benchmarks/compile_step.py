"""Eager against compiled stages (``build_stages(..., compile=...)``) of DeepSeek-V3 and Llama on CPU.

One whole-model stage per family runs zero-bubble steps on the runtime's own split (every forward,
then each micro-batch's B with the weight GEMMs queued, then each W), eager and compiled rounds
interleaved so load drifts hit both. Printed side by side per family: median step time [IQR], the
peak of the bytes autograd saves for backward during a step (``SavedActivationMeter``: activations,
not parameters; fusion saves fewer intermediates), the weight-gradient closures W ran per step (the
same in both: the deferral survives compilation) and the graphs compiled after the first step
(recompilations: 0 expected).

    python benchmarks/compile_step.py [--steps 10] [--rounds 3] [--backend inductor] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import build_stages as deepseek_stages  # noqa: E402
from mt_dualpipe.models.llama import LlamaConfig  # noqa: E402
from mt_dualpipe.models.llama.stages import build_stages as llama_stages  # noqa: E402
from mt_dualpipe.models.recompute import SavedActivationMeter  # noqa: E402
from mt_dualpipe.runtime.stage import Stage  # noqa: E402
from mt_dualpipe.runtime.weight_grad import WeightGradStore  # noqa: E402


def families() -> dict[str, tuple[object, Callable[..., list[nn.Module]]]]:
    """Each family's benchmark config (CPU-sized, wide enough that the elementwise work shows) and builder."""
    deepseek = DeepSeekV3Config.preset("tiny", dim=256, inter_dim=512, moe_inter_dim=128, vocab_size=256,
                                       n_layers=3, n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                                       qk_rope_head_dim=16, v_head_dim=32, mtp_depth=1, max_seq_len=256)
    llama = LlamaConfig.preset("tiny", num_hidden_layers=3, vocab_size=256, hidden_size=256,
                               intermediate_size=688, num_attention_heads=4, num_key_value_heads=2)
    return {"DeepSeek-V3": (deepseek, deepseek_stages), "Llama": (llama, llama_stages)}


class SplitStepper:
    """One whole-model stage on the runtime's Stage, stepped as a zero-bubble stage is: F, B, W."""

    def __init__(self, module: nn.Module, vocab: int, micro_batches: int, rows: int, seq: int) -> None:
        self.module = module
        self.stage = Stage(module, 0, 0, True, True, WeightGradStore())
        gen = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, vocab, (rows, seq + 1), generator=gen) for _ in range(micro_batches)]

    def step(self) -> tuple[float, int, int]:
        """(seconds, peak saved bytes, closures W ran) of one step."""
        meter = SavedActivationMeter(exclude=list(self.module.parameters()))
        before = self.stage.store.closures_run
        start = time.perf_counter()
        with meter.measure():
            for mb, t in enumerate(self.batches):
                self.stage.forward(mb, (t[:, :-1],), self.module.criterion, (t[:, 1:],), True, False)
            for mb in range(len(self.batches)):
                self.stage.backward(mb, None, split=True)
        for mb in range(len(self.batches)):
            self.stage.weight(mb)
        seconds = time.perf_counter() - start
        self.module.zero_grad(set_to_none=True)
        return seconds, meter.peak, self.stage.store.closures_run - before


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def measure(name: str, config, build, backend: str, args: argparse.Namespace) -> dict:
    """Median step time, peak saved bytes, W closures per step and recompilations, eager and compiled."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    out: dict[str, dict] = {}
    steppers = {}
    for label, compile in (("eager", False), ("compiled", backend)):
        torch.manual_seed(0)
        (module,) = build(config, 1, compile=compile, recompute=args.recompute)
        steppers[label] = SplitStepper(module, config.vocab_size, args.micro_batches, args.rows, args.seq)
        first = time.perf_counter()
        steppers[label].step()  # the compiled side compiles here
        out[label] = {"first": time.perf_counter() - first, "times": [], "peak": 0, "closures": 0,
                      "graphs": counters["stats"]["unique_graphs"]}
    for _ in range(args.rounds):
        for label, stepper in steppers.items():
            for _ in range(args.steps):
                seconds, peak, closures = stepper.step()
                out[label]["times"].append(seconds)
                out[label]["peak"] = max(out[label]["peak"], peak)
                out[label]["closures"] = closures
    graphs_now = counters["stats"]["unique_graphs"]
    out["compiled"]["recompiles"] = graphs_now - out["compiled"]["graphs"]
    out["eager"]["recompiles"] = 0
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and side")
    p.add_argument("--rounds", type=int, default=3, help="rounds, eager and compiled alternating")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--recompute", default="none", help="recompute policy of both sides")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Eager vs compiled ({args.backend}) stage step on CPU, {args.micro_batches} micro-batches "
                        f"of {args.rows}x{args.seq} tokens, recompute {args.recompute!r}, {args.threads} thread(s)")
    for col in ("model", "side", "step ms: median [IQR]", "vs eager", "peak saved MiB", "W closures / step",
                "first step s", "recompiles after step 1"):
        table.add_column(col)
    for name, (config, build) in families().items():
        res = measure(name, config, build, args.backend, args)
        eager_median = quartiles(res["eager"]["times"])[1]
        for label in ("eager", "compiled"):
            r = res[label]
            q1, med, q3 = quartiles(r["times"])
            table.add_row(name if label == "eager" else "", label,
                          f"{1e3 * med:.1f} [{1e3 * q1:.1f}, {1e3 * q3:.1f}]", f"{med / eager_median:.2f}x",
                          f"{r['peak'] / 2**20:.2f}", str(r["closures"]), f"{r['first']:.1f}", str(r["recompiles"]))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
