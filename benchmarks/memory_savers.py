"""DeepSeek-V3's memory savers, each switched on alone and measured on the tiny model (single process).

* AdamW moments in BF16 (``mt_dualpipe.optim.AdamWBF16``) against FP32 moments: optimizer-state
  bytes per parameter, the loss over the same steps (max relative difference, final loss).
* Parameter EMA on the CPU updated by a background thread (``CpuEMA``): median step time with and
  without it, rounds interleaved so load drifts hit both; the spread is the interquartile range.
* FP8 dispatch (``fp8_dispatch=True``): bytes per dispatched row (this model and the 671B width)
  against BF16/FP32 rows, and the loss over the same steps.

    python benchmarks/memory_savers.py [--steps 30] [--ema-rounds 5]

The activation savers (``DeepSeekV3Config.memory_savers``) have their own table: ``activation_savers.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.balancing import bigram_batches  # noqa: E402
from mt_dualpipe.layers.expert_parallel import fp8_row_bytes  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model  # noqa: E402
from mt_dualpipe.optim import AdamWBF16, CpuEMA, optimizer_state_bytes  # noqa: E402


def bench_config(**kw) -> DeepSeekV3Config:
    return DeepSeekV3Config.preset("tiny", dim=128, inter_dim=256, moe_inter_dim=64, vocab_size=64, n_layers=3,
                                   n_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                   qk_rope_head_dim=8, v_head_dim=16, mtp_depth=1, **kw)


def run(config: DeepSeekV3Config, batches: list[torch.Tensor], lr: float, moments: torch.dtype = torch.float32,
        ema: bool = False) -> dict:
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).train()
    opt = AdamWBF16(model.parameters(), lr=lr, moment_dtype=moments)
    averager = CpuEMA(model, decay=0.99, optimizer=opt) if ema else None
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if averager is not None:
            averager.update()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    if averager is not None:
        averager.close()
    params = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "times": times, "state_bytes_per_param": optimizer_state_bytes(opt) / params}


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ema-rounds", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from rich.console import Console
    from rich.table import Table

    config = bench_config()
    batches = bigram_batches(config.vocab_size, 4, 64, args.steps)
    table = Table(title=f"Memory savers, tiny DeepSeek-V3 (dim {config.dim}), {args.steps} steps")
    for col in ("saver", "measure", "off", "on", "effect"):
        table.add_column(col)

    fp32, bf16 = run(config, batches, args.lr), run(config, batches, args.lr, torch.bfloat16)
    rel = max(abs(a - b) / a for a, b in zip(fp32["losses"], bf16["losses"]))
    table.add_row("AdamW BF16 moments", "optimizer bytes / param", f"{fp32['state_bytes_per_param']:.3f}",
                  f"{bf16['state_bytes_per_param']:.3f}", "moments 8 -> 4 B")
    table.add_row("", "final loss", f"{fp32['losses'][-1]:.4f}", f"{bf16['losses'][-1]:.4f}",
                  f"max rel. diff over steps {100 * rel:.4f} %")

    off, on = [], []
    for _ in range(args.ema_rounds):
        off += run(config, batches, args.lr)["times"][2:]
        on += run(config, batches, args.lr, ema=True)["times"][2:]
    (o1, om, o3), (e1, em, e3) = quartiles(off), quartiles(on)
    table.add_row("CPU EMA (async)", "step ms: median [IQR]", f"{1e3 * om:.1f} [{1e3 * o1:.1f}, {1e3 * o3:.1f}]",
                  f"{1e3 * em:.1f} [{1e3 * e1:.1f}, {1e3 * e3:.1f}]",
                  f"{100 * (em / om - 1):+.1f} % (IQR {100 * (o3 - o1) / om:.1f} %)")

    fp8 = run(config.replace(fp8_dispatch=True), batches, args.lr)
    for dim in (config.dim, 7168):
        table.add_row("FP8 dispatch" if dim == config.dim else "", f"bytes / row, dim {dim}",
                      f"{2 * dim} (bf16) / {4 * dim} (fp32)", f"{fp8_row_bytes(dim)}",
                      f"{fp8_row_bytes(dim) / (2 * dim):.3f} x bf16")
    rel8 = abs(fp8["losses"][-1] - fp32["losses"][-1]) / fp32["losses"][-1]
    table.add_row("", "final loss", f"{fp32['losses'][-1]:.4f}", f"{fp8['losses'][-1]:.4f}",
                  f"{100 * rel8:.3f} % rel.")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
