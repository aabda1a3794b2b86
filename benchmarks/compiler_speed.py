"""Schedule compiler speed: mt_dualpipe's build + lower + validate + simulate against
torch.distributed.pipelining's schedule constructor (which generates and lowers) for the same shapes.

    python3 benchmarks/compiler_speed.py [--repeat 3]

torch's constructors want pipeline stages; they read only a few attributes of them while building
the order, so light stand-ins (no process group, no model) are enough. Each figure is the best of
``--repeat`` runs. Prints a rich table; the targets are >= 10x faster than torch at 32 ranks x 256
micro-batches, and dualpipe at 64 x 1024 in under 2 s.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mt_dualpipe.schedules import build_schedule, lower, simulate, validate_program  # noqa: E402


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def ours(name: str, P: int, M: int, **opts):
    """The whole pipeline: build, lower (checks the schedule, reference run), re-validate the program, simulate."""
    def run():
        s = build_schedule(name, P, M, **opts)
        p = lower(s)
        validate_program(p)
        return simulate(p)
    return run


def ours_build_lower(name: str, P: int, M: int, **opts):
    """What torch's constructor does: generate the orders and lower them (our lower also checks the schedule)."""
    def run():
        return lower(build_schedule(name, P, M, **opts))
    return run


def torch_ctor(cls_name: str, P: int, M: int, v: int):
    """Build torch's schedule for rank 0 (torch computes every rank's order and lowers them all)."""
    import torch.nn as nn
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, cls_name)
    n_stages = v * P
    local = [0, 2 * P - 1] if cls_name in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble") else [0, P]

    def stand_in(idx: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(group_size=P, group_rank=0, num_stages=n_stages, stage_index=idx,
                                     is_first=idx == 0, is_last=idx == n_stages - 1, submod=nn.Identity(),
                                     stage_index_to_group_rank={})

    def run():
        return cls([stand_in(i) for i in local], M, loss_fn=lambda out, target: out)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    table = Table(title=f"schedule compiler: build + lower + validate + simulate (best of {args.repeat})")
    for col in ("schedule", "P x M", "mt: build+lower+validate+simulate (s)", "mt: build+lower (s)",
                "torch constructor (s)", "speed-up (all / build+lower)"):
        table.add_column(col, justify="right" if col != "schedule" else "left")
    cases = [("dualpipev", "ScheduleDualPipeV", {}), ("zbv", "ScheduleZBVZeroBubble", {}),
             ("interleaved-1f1b", "ScheduleInterleaved1F1B", {"virtual_stages": 2})]
    P, M = 32, 256
    for name, torch_name, opts in cases:
        t_ours, res = best_of(ours(name, P, M, **opts), args.repeat)
        t_bl, _ = best_of(ours_build_lower(name, P, M, **opts), args.repeat)
        try:
            t_torch, _ = best_of(torch_ctor(torch_name, P, M, 2), args.repeat)
            torch_cell, ratio = f"{t_torch:.3f}", f"{t_torch / t_ours:.1f}x / {t_torch / t_bl:.1f}x"
        except Exception as exc:  # torch missing or its API changed: say so, keep our figure
            torch_cell, ratio = f"n/a ({type(exc).__name__})", "-"
        table.add_row(name, f"{P} x {M}", f"{t_ours:.3f}", f"{t_bl:.3f}", torch_cell, ratio)
    t_big, res = best_of(ours("dualpipe", 64, 1024), args.repeat)
    t_big_bl, _ = best_of(ours_build_lower("dualpipe", 64, 1024), args.repeat)
    table.add_row("dualpipe", "64 x 1024", f"{t_big:.3f}", f"{t_big_bl:.3f}", "-", "target: all < 2 s")
    console.print(table)
    console.print(f"dualpipe 64 x 1024: makespan {res.makespan:g}, bubble rate {100 * res.bubble_rate:.2f} %")


if __name__ == "__main__":
    main()
