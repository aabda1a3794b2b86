"""Block-wise E4M3 quantisation, DeepSeek-V3 style.

Why fine-grained scales: FP8 E4M3 has 3 mantissa bits and a range of ±448, so one scale per tensor
lets a single outlier push every other value into the subnormals. DeepSeek-V3 instead scales
activations and gradients per **1×128 tile** (one row, 128 consecutive elements of the GEMM's
contraction dimension) and weights per **128×128 block**; each scale is the tile's current max-abs
divided by 448 (no delayed amax history). A tensor is always quantised along the dimension the next
GEMM contracts over, so ``a @ b.T`` needs ``a`` and ``b`` both tiled along their last dimension.

Numbers this module guarantees (``scale = amax / 448`` of the tile or block):

* a finite element ``x`` dequantises to ``x'`` with ``|x' - x| <= max(|x| / 16, scale / 1024)``
  (round-to-nearest with 3 mantissa bits; ``scale / 1024`` is half the E4M3 subnormal step);
* the tile's max-abs element maps to ±448 and comes back within one rounding of the fp32 division;
* an **all-zero tile** gets a floor scale (``AMAX_FLOOR / 448``) instead of 0, so it dequantises to
  exact zeros, never NaN;
* a tile or block holding **inf or NaN** gets a NaN scale and dequantises to all-NaN. FP8 has no
  infinity and a plain cast would saturate inf to ±448: finite garbage. Turning the tile into NaN
  instead makes every GEMM output that touches it NaN, so a non-finite check (loss, grad norm,
  the resilience layer) fires rather than training silently on clipped values.

**The same kernels, compiled or not.** Rounding to E4M3 magnifies a one-ulp change of ``x / scale`` into a
whole E4M3 step (a 1/8 relative change) whenever the quotient lies on a rounding boundary, so the
quantiser must compute the max-abs, the division and the cast with the same kernels wherever it runs.
Inside a ``torch.compile``'d region (a compiled SwiGLU or MLA shares one FP8 copy of its input) it is
therefore traced as one opaque custom op, ``mt_dualpipe::quantize_tiles`` / ``quantize_blocks``, whose
implementation is the eager function itself: a compiler may fuse what surrounds it, never its arithmetic
(inductor would otherwise generate its own division, or a product with the reciprocal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128
AMAX_FLOOR = 1e-30  # a normal fp32 number; amax / 448 stays a normal fp32 scale


@dataclass(frozen=True)
class QTensor:
    """A 2-D E4M3 tensor with its fp32 dequantisation scales.

    ``kind == "tile"``: ``scale`` is ``(rows, ceil(cols / 128))``, one scale per 1×128 tile of a row.
    ``kind == "block"``: ``scale`` is ``(ceil(rows / 128), ceil(cols / 128))``, one per 128×128 block.
    ``dequantize(q)`` is ``data * scale`` broadcast over the tiles; edge tiles may be shorter than 128.
    """

    data: torch.Tensor
    scale: torch.Tensor
    kind: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> QTensor:
        """Transpose of a block-quantised tensor (128×128 blocks are symmetric, so this is free)."""
        if self.kind != "block":
            raise ValueError("only 128x128 block-quantised tensors can be transposed; re-quantise a tiled one instead")
        return QTensor(self.data.t(), self.scale.t(), "block")


def _check_2d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{what} expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what} expects a floating-point tensor, got {x.dtype}")


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 with the two documented special cases (zero tile -> floor, non-finite -> NaN)."""
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _pad_cols(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[1] % TILE
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiles``' arithmetic: (E4M3 data, contiguous; float32 scales)."""
    rows, cols = x.shape
    xp = _pad_cols(x.float()).view(rows, -1, TILE)
    scale = _scales(xp.abs().amax(dim=-1))
    data = (xp / scale.unsqueeze(-1)).to(E4M3).view(rows, -1)[:, :cols]
    return data.contiguous(), scale


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks``' arithmetic: (E4M3 data, contiguous; float32 scales)."""
    rows, cols = w.shape
    wp = _pad_cols(w.float())
    wp = torch.nn.functional.pad(wp, (0, 0, 0, -rows % TILE)).view(-1, TILE, wp.shape[1] // TILE, TILE)
    scale = _scales(wp.abs().amax(dim=(1, 3)))
    data = (wp / scale[:, None, :, None]).to(E4M3).view(wp.shape[0] * TILE, -1)[:rows, :cols]
    return data.contiguous(), scale


@torch.library.custom_op("mt_dualpipe::quantize_tiles", mutates_args=())
def _tiles_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _tiles(x)


@torch.library.custom_op("mt_dualpipe::quantize_blocks", mutates_args=())
def _blocks_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _blocks(w)


@_tiles_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=E4M3), x.new_empty((rows, -(-cols // TILE)), dtype=torch.float32)


@_blocks_op.register_fake
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    return (w.new_empty((rows, cols), dtype=E4M3),
            w.new_empty((-(-rows // TILE), -(-cols // TILE)), dtype=torch.float32))


def quantize_tiles(x: torch.Tensor) -> QTensor:
    """Quantise a 2-D tensor to E4M3 with one scale per 1×128 tile along the last dimension (no gradient
    flows through it: the FP8 layers quantise detached tensors)."""
    _check_2d(x, "quantize_tiles")
    data, scale = _tiles_op(x) if torch.compiler.is_compiling() else _tiles(x)
    return QTensor(data, scale, "tile")


def quantize_blocks(w: torch.Tensor) -> QTensor:
    """Quantise a 2-D tensor (a weight) to E4M3 with one scale per 128×128 block."""
    _check_2d(w, "quantize_blocks")
    data, scale = _blocks_op(w) if torch.compiler.is_compiling() else _blocks(w)
    return QTensor(data, scale, "block")


def dequantize(q: QTensor) -> torch.Tensor:
    """The fp32 tensor that ``q`` represents."""
    rows, cols = q.data.shape
    d = _pad_cols(q.data.float())
    if q.kind == "tile":
        return (d.view(rows, -1, TILE) * q.scale.unsqueeze(-1)).view(rows, -1)[:, :cols]
    if q.kind == "block":
        d = torch.nn.functional.pad(d, (0, 0, 0, -rows % TILE)).reshape(-1, TILE, d.shape[1] // TILE, TILE)
        return (d * q.scale[:, None, :, None]).view(d.shape[0] * TILE, -1)[:rows, :cols]
    raise ValueError(f"unknown QTensor kind {q.kind!r}; expected 'tile' or 'block'")
