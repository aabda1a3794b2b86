"""DeepSeek-V3's activation savers (``DeepSeekV3Config.memory_savers``), one at a time and all together.

One table, a row per saver (and none / all): saved bytes per token of a dense and a MoE layer as the
modules hand them to autograd (``SavedActivationMeter``, the "wide tiny" model whose dimensions are
multiples of 128, bf16, FP8 linears) next to the planner's count with the same savers
(``planner.activations.memory_savers``); the planner's figure at the 671B shapes (FP8, selective
recompute, fused attention: the plan command's defaults); the step time of a forward + backward of
the wide tiny model in bf16 (median of interleaved rounds, relative to no saver); and the loss after
``--steps`` AdamW steps on a bigram language (float32; FP8 rows: FP8 linears, against FP8 without
savers) relative to the run without savers.

    python benchmarks/activation_savers.py [--steps 50] [--rounds 5]
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
from mt_dualpipe.fp8 import convert_to_fp8  # noqa: E402
from mt_dualpipe.fp8.linear import FP8Linear  # noqa: E402
from mt_dualpipe.layers.savers import MEMORY_SAVERS  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages  # noqa: E402
from mt_dualpipe.models.recompute import SavedActivationMeter  # noqa: E402
from mt_dualpipe.planner import ModelSpec  # noqa: E402
from mt_dualpipe.planner.activations import FP8_LIN, memory_savers  # noqa: E402

SEQ = 64
WIDE = DeepSeekV3Config.preset("tiny", dim=128, n_layers=2, vocab_size=64, inter_dim=256, moe_inter_dim=128,
                               q_lora_rank=128, kv_lora_rank=128, max_seq_len=SEQ + 1, mtp_depth=0)
ROWS = ("none", *MEMORY_SAVERS, "all")


def measured(cfg: DeepSeekV3Config) -> list[float]:
    """Runtime: saved bytes per token of the dense and the MoE layer (bf16, FP8 linears, no recompute)."""
    torch.manual_seed(0)
    stage = build_stages(cfg, 1, source=DeepSeekV3Model(cfg), fp8=True)[0].to(torch.bfloat16)
    out = []
    for layer in stage.model.layers.values():
        weights = [t for m in layer.modules() if isinstance(m, FP8Linear)
                   for t in (m.quantized_weight().data, m.quantized_weight().scale)]
        meter = SavedActivationMeter(exclude=list(layer.parameters()) + weights)
        with meter.measure():
            layer(torch.randn(1, SEQ, cfg.dim, dtype=torch.bfloat16, requires_grad=True))
        out.append(meter.peak / SEQ)
    return out


def planned(spec: ModelSpec, savers: str, seq: int, recompute: str, attention: str) -> list[float]:
    """Planner: bytes per token of the first dense and the first MoE layer (FP8 linear inputs, bf16)."""
    with memory_savers(savers):
        items = spec.items(seq, act_unit=FP8_LIN, recompute=recompute, elem=2.0, attention=attention)
    dense = next(i for i in items[1:] if not i.moe)
    moe = next(i for i in items[1:] if i.moe)
    return [dense.act_bytes, moe.act_bytes]


def step_times(rounds: int) -> dict[str, float]:
    """Median forward + backward time of the wide tiny model in bf16 per saver, rounds interleaved."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, WIDE.vocab_size, (2, SEQ + 1), generator=g)
    models = {}
    for name in ROWS:
        torch.manual_seed(0)
        models[name] = DeepSeekV3Model(WIDE.replace(memory_savers="" if name == "none" else name)).to(torch.bfloat16)
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {name: statistics.median(ts[1:] if len(ts) > 1 else ts) for name, ts in times.items()}


def final_loss(savers: str, batches: list[torch.Tensor], fp8: bool = False, lr: float = 1e-3) -> float:
    torch.manual_seed(0)
    model = DeepSeekV3Model(WIDE.replace(memory_savers=savers, mtp_depth=1))
    if fp8:
        convert_to_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for tokens in batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="training steps of the loss comparison (default 50)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from rich.console import Console
    from rich.table import Table

    tiny, full = ModelSpec.from_deepseek_config(WIDE), ModelSpec.load("deepseek-v3")
    times = step_times(args.rounds)
    batches = bigram_batches(WIDE.vocab_size, 4, SEQ, args.steps)
    loss_off, loss_off_fp8 = final_loss("", batches), final_loss("", batches, fp8=True)
    table = Table(title=f"DeepSeek-V3 activation savers: saved bytes per token per layer (runtime / planner), "
                        f"step time, loss after {args.steps} steps")
    for col in ("saver", "tiny dense rt / plan", "tiny MoE rt / plan", "671B dense", "671B MoE",
                "step time", "loss Δ fp32", "loss Δ fp8"):
        table.add_column(col, justify="left" if col == "saver" else "right")
    base = None
    for name in ROWS:
        savers = "" if name == "none" else name
        rt = measured(WIDE.replace(memory_savers=savers))
        plan = planned(tiny, savers, SEQ, "none", "eager")
        big = planned(full, savers, 4096, "selective", "fused")
        base = base or big
        loss = final_loss(savers, batches)
        loss_fp8 = final_loss(savers, batches, fp8=True) if name in ("swiglu", "mla_input", "all") else None
        table.add_row(
            name, f"{rt[0]:.0f} / {plan[0]:.0f}", f"{rt[1]:.0f} / {plan[1]:.0f}",
            f"{big[0] / 1024:.1f} KiB ({100 * (big[0] / base[0] - 1):+.0f} %)",
            f"{big[1] / 1024:.1f} KiB ({100 * (big[1] / base[1] - 1):+.0f} %)",
            f"{1e3 * times[name]:.1f} ms ({100 * (times[name] / times['none'] - 1):+.0f} %)",
            f"{100 * (loss / loss_off - 1):+.3f} %",
            "" if loss_fp8 is None else f"{100 * (loss_fp8 / loss_off_fp8 - 1):+.3f} %")
    Console(width=170).print(table)
    print(f"loss without savers after {args.steps} steps: {loss_off:.4f} (fp32), {loss_off_fp8:.4f} (FP8 linears). "
          "Tiny: bf16, FP8 linears, no recompute, one sequence of "
          f"{SEQ} tokens; 671B: FP8, selective recompute, fused attention, 4096 tokens (the plan command's rules).")


if __name__ == "__main__":
    main()
