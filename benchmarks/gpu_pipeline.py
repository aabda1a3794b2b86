"""One-GPU pipeline smoke run and runtime overhead: DeepSeek-V3 stages under the runtime vs the plain model.

A world of one rank (NCCL on CUDA, gloo on CPU) runs every stage of a schedule on one device, so no
point-to-point transfer happens and what remains is the runtime's own cost: the executor loop, the
B/W split (W deferred to its slot) and the comm-stream events. Beside it, in the same run, the plain
model's forward and backward over the same micro-batches (the floor), and torch.distributed.pipelining's
ScheduleZBVZeroBubble on the same stage cut where it accepts one rank. Each row: median step time,
its ratio to the plain model, the peak device memory above the weights (CUDA only), and the loss of
the first step (all rows start from the same weights and data, so they agree).

    python benchmarks/gpu_pipeline.py [--dim 2048] [--layers 4] [--seq 2048] [--chunks 8] [--fp8] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe import Pipeline  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import (  # noqa: E402
    DeepSeekV3Config,
    DeepSeekV3Model,
    criterion_for,
    stages_for_rank,
)
from mt_dualpipe.schedules.registry import build_schedule  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(step: Callable[[], torch.Tensor], device: torch.device, steps: int,
             base_bytes: int) -> tuple[float, float | None, float]:
    """(median seconds per step, peak GiB above ``base_bytes`` or None on cpu, first step's summed loss)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first = float(step().sum())
    _sync(device)
    peak = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30 if device.type == "cuda" else None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak, first


def _config(args: argparse.Namespace) -> DeepSeekV3Config:
    return DeepSeekV3Config.preset(
        "tiny", dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128, inter_dim=4 * args.dim,
        moe_inter_dim=args.dim // 2, vocab_size=args.vocab, max_seq_len=args.seq, q_lora_rank=args.dim // 4,
        kv_lora_rank=args.dim // 8, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


def _torch_zbv(stages: list[torch.nn.Module], crit: Callable, device: torch.device, chunks: int):
    """torch.distributed.pipelining's ZB-V over the same two stages on this one rank."""
    from torch.distributed import pipelining as pp

    pstages = [pp.PipelineStage(st, i, 2, device) for i, st in enumerate(stages)]
    return pp.ScheduleZBVZeroBubble(pstages, chunks, loss_fn=crit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=8, help="micro-batches of one sequence each")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fp8", action="store_true", help="FP8 linears (block-scaled scaled_mm where the GPU has it)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    config = _config(args)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.chunks, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    console = Console(width=160)
    table = Table(title=f"one {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: "
                        f"DeepSeek-V3 dim {args.dim}, {args.layers} layers, {args.chunks} micro-batches x "
                        f"{args.seq} tokens, {'fp8' if args.fp8 else 'fp32 (tf32 matmuls)'}")
    for col in ("run", "step (ms)", "vs plain", "peak above weights (GiB)", "first loss sum"):
        table.add_column(col, justify="right" if col != "run" else "left")
    add_row = table.add_row

    def row(*cells: str) -> None:  # also printed at once: a run cut short by a time limit still reports
        console.print(" | ".join(cells))
        add_row(*cells)

    table.add_row = row  # type: ignore[method-assign]

    plain = copy.deepcopy(model)
    if args.fp8:
        from mt_dualpipe.fp8 import convert_to_fp8

        convert_to_fp8(plain)
    plain.to(device)

    def plain_step() -> torch.Tensor:
        losses = []
        for m in range(args.chunks):
            loss = plain(x[m:m + 1], y[m:m + 1])
            loss.backward()
            losses.append(loss.detach())
        plain.zero_grad(set_to_none=False)
        return torch.stack(losses)

    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    floor, peak, loss0 = _measure(plain_step, device, args.steps, base)
    table.add_row("plain model (autograd, no pipeline)", f"{floor * 1e3:.1f}", "1.00", _gib(peak), f"{loss0:.4f}")
    plain.cpu()


    for schedule, defer in (("dualpipev", True), ("zbv", True), ("1f1b", False)):
        sched = build_schedule(schedule, 1, args.chunks)
        mods = [m.to(device) for m in stages_for_rank(config, sched, 0, source=model, defer_weight_grads=defer,
                                                       fp8=args.fp8)]
        pipe = Pipeline(mods, sched, timeout=120)
        crit = criterion_for(mods)

        def pipe_step(pipe=pipe, crit=crit) -> torch.Tensor:
            loss, _ = pipe.step(x, num_chunks=args.chunks, criterion=crit, labels=(y,))
            pipe.zero_grad(set_to_none=False)
            return loss

        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        t, peak, loss0 = _measure(pipe_step, device, args.steps, base)
        label = f"mt_dualpipe {schedule} ({len(mods)} stage{'s' * (len(mods) > 1)}, " \
                f"{'W deferred' if defer else 'BW fused'})"
        table.add_row(label, f"{t * 1e3:.1f}", f"{t / floor:.2f}", _gib(peak), f"{loss0:.4f}")
        if schedule == "zbv" and not args.fp8:
            try:
                torch_mods = [copy.deepcopy(m) for m in mods]
                torch_sched = _torch_zbv(torch_mods, crit, device, args.chunks)

                def torch_step(s=torch_sched, mods=torch_mods) -> torch.Tensor:
                    losses: list[torch.Tensor] = []
                    s.step(x, target=y, losses=losses)
                    for m in mods:
                        m.zero_grad(set_to_none=False)
                    return torch.stack([loss.detach() for loss in losses])

                t, peak, loss0 = _measure(torch_step, device, args.steps, base)
                table.add_row("torch.distributed.pipelining ScheduleZBVZeroBubble", f"{t * 1e3:.1f}",
                              f"{t / floor:.2f}", _gib(peak), f"{loss0:.4f}")
            except Exception as exc:  # a side-by-side row, not the smoke run itself
                table.add_row("torch.distributed.pipelining ScheduleZBVZeroBubble", "n/a", "", "",
                              f"{type(exc).__name__}: {str(exc)[:60]}")
        for m in mods:
            m.cpu()
        del pipe, mods
    console.print(table)
    dist.destroy_process_group()
    return 0


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
