"""FP8 (DeepSeek-V3 block-wise recipe) vs BF16 GEMM throughput on the current device.

Prints the device and the FP8 backend that FP8Linear would use there, then one row per GEMM shape:
BF16 ``a @ b.T``, the recipe's FP8 GEMM on pre-quantised operands, and the same including the
activation quantisation (1×128 tiles; the weight's 128×128 blocks are cached by FP8Linear, so they
are quantised outside the timed loop). On CPU the FP8 path is the emulation (dequantise to fp32,
fp32 matmul): it is *slower* than BF16 and the table says so; it exists for numerics, not speed.
For context on CPU it also times torch's tensor-wise ``_scaled_mm`` CPU kernel (not the recipe).

    python benchmarks/fp8_gemm.py [--sizes 1024x1024x1024 4096x4096x4096] [--iters 10] [--device cuda]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from mt_dualpipe.fp8 import backend_summary, quantize_blocks, quantize_tiles, resolve_gemm


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "musa") and torch.musa.is_available():
        return "musa"
    return "cpu"


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _parse_size(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must be MxNxK, e.g. 1024x1024x1024") from None
    return m, n, k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=_parse_size, default=None, help="GEMM shapes MxNxK")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default=None, help="cpu, cuda, musa (default: the accelerator if any)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or _default_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sizes is None:
        args.sizes = [(512, 512, 512), (1024, 1024, 1024)] if device.type == "cpu" else \
            [(4096, 4096, 4096), (8192, 7168, 2048), (16384, 7168, 7168)]
    name, gemm = resolve_gemm(device)
    console = Console(width=120)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    console.print(f"device: {label}" + (f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""))
    console.print(backend_summary(device))

    table = Table(title=f"FP8 ({name}) vs BF16 GEMM, TFLOP/s (median of {args.iters})")
    for col in ("M x N x K", "bf16", f"fp8 {name}", "fp8 + act quant", "fp8 / bf16"):
        table.add_column(col, justify="right")
    if device.type == "cpu":
        table.add_column("_scaled_mm tensor-wise*", justify="right")
    gen = torch.Generator().manual_seed(0)
    for m, n, k in args.sizes:
        a = torch.randn(m, k, generator=gen).to(device)
        b = torch.randn(n, k, generator=gen).to(device)
        a16, b16 = a.bfloat16(), b.bfloat16()
        qa, qb = quantize_tiles(a), quantize_blocks(b)
        flops = 2 * m * n * k
        t_bf16 = _time(lambda: a16 @ b16.t(), device, args.iters)  # noqa: B023
        t_fp8 = _time(lambda: gemm(qa, qb), device, args.iters)  # noqa: B023
        t_e2e = _time(lambda: gemm(quantize_tiles(a16), qb), device, args.iters)  # noqa: B023
        row = [f"{m}x{n}x{k}", f"{flops / t_bf16 / 1e12:.3f}", f"{flops / t_fp8 / 1e12:.3f}",
               f"{flops / t_e2e / 1e12:.3f}", f"{t_bf16 / t_fp8:.2f}x"]
        if device.type == "cpu":
            one = torch.tensor(1.0)
            t_sm = _time(lambda: torch._scaled_mm(qa.data, qb.data.t(), scale_a=one, scale_b=one,  # noqa: B023
                                                  out_dtype=torch.float32), device, args.iters)
            row.append(f"{flops / t_sm / 1e12:.3f}")
        table.add_row(*row)
    console.print(table)
    if device.type == "cpu":
        console.print("* torch's CPU FP8 kernel with one scale per tensor: context only, not the block-wise recipe.")
    if name == "emulated":
        console.print("note: the emulated FP8 GEMM dequantises to fp32 and runs an fp32 matmul, so it costs more "
                      "than BF16 here; FP8 speed-ups need a device with block-scaled FP8 kernels (e.g. CUDA SM90).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
