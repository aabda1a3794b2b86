"""Uneven micro-batches in simulation: pad-to-max, equal micro-batches, token-budget micro-batches and ``auto``.

A step's sequences have skewed lengths (log-normal, clipped to 64..4,096 tokens, a fixed seed). Each
micro-batch's cost per stage comes from its sequences' lengths (``schedules.tokens.TokenCost``: GEMMs
linear in tokens, causal attention quadratic in each sequence's length; constants of a Llama-3-8B-like
model cut into eight stages on one H100 each, at 400 TFLOP/s), and the project's simulator runs the
step on P = 8 ranks (linear placement, memory of ZB-H1: P micro-batches per rank). Rows:

* **pad-to-max**: equal micro-batches (the same number of sequences each, in arrival order), every
  sequence padded to 4,096: all micro-batches cost the same, most of it padding;
* **equal micro-batches, arrival order**: the same micro-batches, each padded to its longest
  sequence (what a default collator does), run in arrival order by ZB-H1;
* **token-budget micro-batches**: sequences packed in arrival order into micro-batches of at most
  (total tokens / M) tokens, no padding (attention per sequence), run in arrival order by ZB-H1;
* **auto, per-micro-batch costs**: those token-budget micro-batches, ``auto`` given their costs
  (``Costs.mb_scale``): it chooses which micro-batch runs in which slot and the op order;
* **auto, equal micro-batches**: the padded micro-batches of the second row, ordered by ``auto``.

Columns: tokens per second of the simulated step (real tokens, not padding), the bubble rate, the
padding fraction (padding / tokens computed); a measured column is for the real-run figures::

    python benchmarks/uneven_microbatches.py
    python benchmarks/uneven_microbatches.py --ranks 4 --sequences 256 --microbatches 16 --seed 1
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mt_dualpipe.schedules import build_schedule, simulate  # noqa: E402
from mt_dualpipe.schedules.tokens import TokenCost, microbatch_costs  # noqa: E402

MAX_LEN, MIN_LEN = 4096, 64
FLOPS = 400e12
"""Sustained bf16 FLOP/s of one H100 on these GEMMs and attention kernels."""
PARAMS, HIDDEN, LAYERS = 8.0e9, 4096, 32
"""A Llama-3-8B-like model: parameters, hidden size, layers (cut into equal stages)."""


def token_cost(stages: int) -> TokenCost:
    """Per stage: 2 FLOPs per parameter and token for the forward GEMMs, 4 * hidden per causal (query, key)
    pair and layer for attention (scores and values)."""
    per_token = 2 * PARAMS / stages / FLOPS
    per_pair = 4 * HIDDEN * (LAYERS / stages) / FLOPS
    return TokenCost(per_token=per_token, per_pair=per_pair)


def lengths(n: int, seed: int, median: float = 400.0, sigma: float = 1.1) -> list[int]:
    """``n`` sequence lengths drawn log-normal around ``median``, clipped to 64..4,096, in arrival order."""
    rng = random.Random(seed)
    return [min(MAX_LEN, max(MIN_LEN, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def equal_microbatches(seqs: list[int], M: int) -> list[list[int]]:
    """``M`` micro-batches of consecutive sequences, as even in count as they divide."""
    size, extra = divmod(len(seqs), M)
    out, i = [], 0
    for k in range(M):
        n = size + (k < extra)
        out.append(seqs[i:i + n])
        i += n
    return out


def token_budget_microbatches(seqs: list[int], M: int) -> list[list[int]]:
    """Sequences in arrival order packed into micro-batches of at most total / M tokens (a longer sequence
    alone in one); about ``M`` of them, no padding."""
    budget = max(max(seqs), math.ceil(sum(seqs) / M))
    out: list[list[int]] = [[]]
    for n in seqs:
        if out[-1] and sum(out[-1]) + n > budget:
            out.append([])
        out[-1].append(n)
    return out


def padded(mbs: list[list[int]], to: int | None = None) -> list[list[int]]:
    """Each micro-batch's sequences padded to ``to`` (or to its longest)."""
    return [[to or max(mb)] * len(mb) for mb in mbs]


def run(name: str, P: int, real: list[list[int]], computed: list[list[int]], cost: TokenCost, use_auto: bool,
        seed: int) -> list[str]:
    """Simulate one row: ZB-H1 in arrival order, or ``auto`` given the micro-batches' costs."""
    M = len(computed)
    costs = microbatch_costs(computed, cost)
    t0 = time.perf_counter()
    if use_auto:
        sched = build_schedule("auto", P, M, costs=costs, placement="linear", memory_limit=P, seed=seed)
    else:
        sched = build_schedule("zb-h1", P, M)
    seconds = time.perf_counter() - t0
    res = simulate(sched, costs)
    tokens, work = sum(map(sum, real)), sum(map(sum, computed))
    return [name, str(M), f"{tokens:,}", f"{1 - tokens / work:.1%}", f"{res.makespan * 1e3:.1f}",
            f"{tokens / res.makespan:,.0f}", f"{res.bubble_rate:.1%}", f"{max(res.peak_activations)}",
            "-" if not use_auto else f"{seconds:.1f}", "-"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths (and of auto)")
    args = ap.parse_args(argv)
    P, M = args.ranks, args.microbatches
    seqs = lengths(args.sequences, args.seed)
    cost = token_cost(P)
    equal = equal_microbatches(seqs, M)
    budget = token_budget_microbatches(seqs, M)
    rows = [
        run("pad-to-max", P, equal, padded(equal, MAX_LEN), cost, False, args.seed),
        run("equal micro-batches, arrival order", P, equal, padded(equal), cost, False, args.seed),
        run("token-budget micro-batches", P, budget, budget, cost, False, args.seed),
        run("auto, per-micro-batch costs (token budget)", P, budget, budget, cost, True, args.seed),
        run("auto, equal micro-batches", P, equal, padded(equal), cost, True, args.seed),
    ]
    table = Table(title=f"Uneven micro-batches, simulated: {args.sequences} sequences of {MIN_LEN}..{MAX_LEN} tokens "
                        f"(log-normal, seed {args.seed}, mean {sum(seqs) / len(seqs):.0f}, longest {max(seqs)}), "
                        f"P={P}, memory {P} micro-batches per rank")
    for col in ("micro-batches", "M", "tokens", "padding", "step ms", "tokens/s", "bubble", "peak", "auto s",
                "measured tokens/s"):
        table.add_column(col, justify="left" if col == "micro-batches" else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    costs = microbatch_costs(budget, cost)
    console.print(f"token-budget micro-batches cost {min(costs.mb_scale):.2f}..{max(costs.mb_scale):.2f} of their mean "
                  f"(F and B; attention is {cost.parts(seqs)[1] / sum(cost.parts(seqs)):.0%} of the forward work); "
                  "ZB-H1 rows run the micro-batches in arrival order, auto rows in the order it chose "
                  "(Schedule.microbatch_order)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
