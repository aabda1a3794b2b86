"""Which kernel runs an FP8 GEMM, and how to tell.

Every FP8 GEMM of the recipe has the same shape: ``a @ b.T`` with ``a`` quantised in 1×128 tiles
along its last dimension and ``b`` in 1×128 tiles (weight-gradient GEMM) or 128×128 blocks
(forward and input-gradient GEMMs), accumulated in FP32. Two implementations:

* ``scaled_mm`` — torch's block-scaled ``scaled_mm`` (``ScalingType.BlockWise1x128`` /
  ``BlockWise128x128``; in torch 2.13 a CUDA SM90 kernel). Used only where a tiny probe call on the
  device succeeds *and* matches the emulation; shapes it rejects fall back to the emulation per call.
* ``emulated`` — dequantise both operands to FP32 and multiply in FP32. Same numerics as the kernel
  up to the order of the FP32 accumulation; this is what runs on CPU (torch 2.13's CPU
  ``_scaled_mm`` only knows tensor-wise and row-wise scales).

``torchao`` and ``transformer_engine`` are separate engines with their own modules (see
``convert.py``); here they are only detected, never imported at module load.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import torch

from .quantize import TILE, QTensor, dequantize, quantize_blocks, quantize_tiles

BACKENDS = ("auto", "scaled_mm", "emulated")

Gemm = Callable[[QTensor, QTensor], torch.Tensor]


def emulated_gemm(a: QTensor, b: QTensor) -> torch.Tensor:
    """``a @ b.T`` in FP32 from the dequantised operands (the reference numerics)."""
    return dequantize(a) @ dequantize(b).t()


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """Same values, column-major storage: the layout the block-scaled kernels read 1x128 scales in."""
    out = torch.empty_strided(scale.shape, (1, scale.shape[0]), dtype=scale.dtype, device=scale.device)
    return out.copy_(scale)  # explicit strides: .t().contiguous().t() would normalise a 1-wide matrix


def _pad_data(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad an E4M3 matrix to (rows, cols); zero bytes are +0.0, so padded products add nothing."""
    r, c = data.shape
    if (r, c) == (rows, cols):
        return data.contiguous()
    raw = torch.nn.functional.pad(data.contiguous().view(torch.uint8), (0, cols - c, 0, rows - r))
    return raw.view(data.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class ScaledMMGemm:
    """Block-scaled ``torch.nn.functional.scaled_mm``; falls back to the emulation per call.

    Operands are zero-padded to what cuBLAS' block-scaled FP8 GEMM asks for: contraction length a
    multiple of 128; the left operand's rows a multiple of 4, so its column-major scales are 16-byte
    aligned; the right operand's rows a multiple of 128 when 128x128-scaled, of 16 when 1x128-scaled
    (both of its dimensions must divide by 16); 128x128 scales padded to a multiple of 4 along K.
    Zero padding is exact, and the result is cut back to the true shape.
    """

    def __init__(self, out_dtype: torch.dtype) -> None:
        self.out_dtype = out_dtype
        self.fallbacks = 0  # GEMMs the kernel rejected and the emulation ran

    def native(self, a: QTensor, b: QTensor) -> torch.Tensor:
        # lazy: only newer torch has these; probe_scaled_mm checks before this backend is chosen
        from torch.nn.functional import ScalingType, scaled_mm

        if a.kind != "tile":
            raise ValueError("the left operand must be 1x128-tile quantised")
        (m, k), n = a.shape, b.shape[0]
        kp, mp = _round_up(k, TILE), _round_up(m, 4)
        a_scale = torch.nn.functional.pad(a.scale, (0, 0, 0, mp - m), value=1.0)
        if b.kind == "block":
            n_pad = _round_up(n, TILE)
            blocks = b.scale.contiguous()
            b_scale = torch.nn.functional.pad(blocks, (0, -blocks.shape[1] % 4)).t()  # (L4, N/128), K-major
            recipe_b = ScalingType.BlockWise128x128
        else:
            n_pad = _round_up(n, 16)  # the FP8 GEMM wants both of mat2's dimensions a multiple of 16
            b_scale = _outer_major(torch.nn.functional.pad(b.scale, (0, 0, 0, n_pad - n), value=1.0))
            recipe_b = ScalingType.BlockWise1x128
        out = scaled_mm(_pad_data(a.data, mp, kp), _pad_data(b.data, n_pad, kp).t(), _outer_major(a_scale),
                        ScalingType.BlockWise1x128, b_scale, recipe_b, output_dtype=self.out_dtype)
        return out[:m, :n].float()

    def __call__(self, a: QTensor, b: QTensor) -> torch.Tensor:
        try:
            out = self.native(a, b)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            if not self.fallbacks:
                warnings.warn(f"fp8 scaled_mm rejected a {tuple(a.shape)} x {tuple(b.shape)}^T GEMM ({err}); "
                              "such GEMMs run in the emulation", stacklevel=2)
            self.fallbacks += 1
            return emulated_gemm(a, b)
        # the documented non-finite contract (a NaN-scaled tile poisons what it touches), without a host sync
        rows_bad = torch.isnan(a.scale).any(dim=1)
        cols_bad = torch.isnan(b.scale).any(dim=1)
        if b.kind == "block":
            cols_bad = cols_bad.repeat_interleave(TILE)[: b.shape[0]]
        return out.masked_fill(rows_bad[:, None] | cols_bad[None, :], float("nan"))


_probe_cache: dict[tuple[str, int | None], tuple[torch.dtype | None, str]] = {}
_native_gemms: dict[tuple[str, int | None], ScaledMMGemm] = {}


def _device_key(device: torch.device | str) -> tuple[str, int | None]:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None and hasattr(torch, device.type):
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    return device.type, device.index


def probe_scaled_mm(device: torch.device | str) -> tuple[torch.dtype | None, str]:
    """Try the block-scaled kernel once on ``device`` (cached): (output dtype or None, reason)."""
    key = _device_key(device)
    if key in _probe_cache:
        return _probe_cache[key]
    result: tuple[torch.dtype | None, str] = (None, "torch has no torch.nn.functional.scaled_mm")
    if key[0] == "meta":
        result = (None, "meta tensors have no values to multiply")
    elif hasattr(torch.nn.functional, "ScalingType"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(128, 256, generator=gen).to(torch.device(key[0]) if key[1] is None else torch.device(*key))
        w = torch.randn(256, 256, generator=gen).to(x.device)
        a, b_block, b_tile = quantize_tiles(x), quantize_blocks(w), quantize_tiles(w)
        result = (None, f"torch {torch.__version__} has no block-scaled (1x128 / 128x128) scaled_mm on {x.device}")
        for out_dtype in (torch.float32, torch.bfloat16):
            gemm, tol = ScaledMMGemm(out_dtype), 1e-3 if out_dtype == torch.float32 else 1e-2
            try:
                pairs = [(gemm.native(a, b), emulated_gemm(a, b)) for b in (b_block, b_tile)]
                agree = all(torch.allclose(g, r, rtol=tol, atol=tol * r.abs().max().item()) for g, r in pairs)
            except Exception:  # any failure means "not supported here"; the emulation covers it
                continue
            if agree:
                result = (out_dtype, f"block-scaled scaled_mm on {x.device}, {str(out_dtype)[6:]} output")
                break
            result = (None, f"block-scaled scaled_mm on {x.device} disagrees with the emulation; not used")
    _probe_cache[key] = result
    return result


def resolve_gemm(device: torch.device | str, backend: str = "auto") -> tuple[str, Gemm]:
    """The (name, gemm) that FP8 layers use on ``device`` for ``backend`` in ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP8 backend {backend!r}; choose one of {', '.join(BACKENDS)} "
                         "(torchao / transformer_engine are chosen in convert_to_fp8)")
    if backend == "emulated":
        return "emulated", emulated_gemm
    out_dtype, reason = probe_scaled_mm(device)
    if out_dtype is not None:
        key = _device_key(device)
        if key not in _native_gemms:
            _native_gemms[key] = ScaledMMGemm(out_dtype)
        return "scaled_mm", _native_gemms[key]
    if backend == "scaled_mm":
        raise RuntimeError(f"FP8 backend 'scaled_mm' is not available: {reason}; use 'auto' or 'emulated'")
    return "emulated", emulated_gemm


def has_module(name: str) -> bool:
    """Whether an optional engine is importable (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def backend_summary(device: torch.device | str = "cpu", backend: str = "auto") -> str:
    """One line saying which FP8 GEMM ``backend`` runs on ``device`` and which optional engines are present."""
    name, _ = resolve_gemm(device, backend)
    reason = "requested" if backend == "emulated" else probe_scaled_mm(device)[1]
    detail = reason if name == "scaled_mm" else f"quantise -> dequantise to fp32 -> fp32 matmul ({reason})"
    engines = ", ".join(f"{m}: {'installed' if has_module(m) else 'not installed'}"
                        for m in ("torchao", "transformer_engine"))
    return f"fp8 backend on {torch.device(device)}: {name} — {detail}; {engines}"

