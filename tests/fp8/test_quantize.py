"""Block-wise E4M3 quantisation: per-tile / per-block error bounds, scales, zeros, inf and NaN."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mt_dualpipe.fp8 import (
    AMAX_FLOOR,
    E4M3,
    E4M3_MAX,
    QTensor,
    dequantize,
    emulated_gemm,
    quantize_blocks,
    quantize_tiles,
)

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)


def _tile_amax(x: torch.Tensor) -> torch.Tensor:
    """Reference per-1x128-tile max-abs, by explicit loops over the tiles."""
    rows, cols = x.shape
    out = torch.empty(rows, (cols + 127) // 128)
    for r in range(rows):
        for j in range(out.shape[1]):
            out[r, j] = x[r, j * 128:(j + 1) * 128].abs().max()
    return out


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    out = torch.empty((rows + 127) // 128, (cols + 127) // 128)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
    return out


def _expand(scale: torch.Tensor, shape: tuple[int, int], block_rows: int) -> torch.Tensor:
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def _assert_within_bound(x: torch.Tensor, q: QTensor, block_rows: int) -> None:
    scale = _expand(q.scale, tuple(x.shape), block_rows)
    err = (dequantize(q) - x).abs()
    bound = torch.maximum(x.abs() / 16, scale / 1024) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def test_tile_scales_are_current_amax_over_448_and_shapes_cover_partial_tiles():
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    q = quantize_tiles(x)
    assert q.data.dtype == E4M3 and q.data.shape == (5, 300) and q.scale.shape == (5, 3)
    torch.testing.assert_close(q.scale, _tile_amax(x) / E4M3_MAX, rtol=0, atol=0)
    # the largest element of every tile maps to the top of the E4M3 range
    top = q.data.float().abs()
    for j in range(3):
        assert bool((top[:, j * 128:(j + 1) * 128].amax(dim=1) == E4M3_MAX).all())


def test_block_scales_are_per_128x128_block():
    w = torch.randn(300, 260)
    w[:128, :128] *= 1000  # one loud block must not change the others' scales
    q = quantize_blocks(w)
    assert q.scale.shape == (3, 3) and q.data.shape == (300, 260)
    torch.testing.assert_close(q.scale, _block_amax(w) / E4M3_MAX, rtol=0, atol=0)
    _assert_within_bound(w, q, block_rows=128)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 400), log_mag=st.floats(-20, 20), seed=st.integers(0, 2**31 - 1))
def test_dequantised_error_within_e4m3_rounding_per_tile(rows, cols, log_mag, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, cols, generator=gen) * 2) * 2.0**log_mag
    _assert_within_bound(x, quantize_tiles(x), block_rows=1)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_dequantised_error_within_e4m3_rounding_per_block(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, cols, generator=gen))
    _assert_within_bound(w, quantize_blocks(w), block_rows=128)


def test_fine_grained_scales_protect_small_tiles_from_an_outlier():
    x = torch.randn(2, 256) * 1e-3
    x[0, 0] = 1e4  # outlier in tile (0, 0) only
    q = dequantize(quantize_tiles(x))
    rel = ((q - x).abs() / x.abs()).nan_to_num()
    assert rel[0, 128:].max() <= 1 / 16 + 1e-6 and rel[1].max() <= 1 / 16 + 1e-6


def test_all_zero_tiles_and_blocks_give_exact_zeros_and_floor_scale():
    x = torch.randn(3, 256)
    x[1] = 0.0
    x[2, 128:] = 0.0
    q = quantize_tiles(x)
    assert bool(torch.isfinite(q.scale).all())
    assert q.scale[1, 0].item() == pytest.approx(AMAX_FLOOR / E4M3_MAX) and q.scale[2, 1] == q.scale[1, 0]
    d = dequantize(q)
    assert bool((d[1] == 0).all()) and bool((d[2, 128:] == 0).all())
    zq = quantize_blocks(torch.zeros(130, 7))
    assert bool((dequantize(zq) == 0).all()) and bool(torch.isfinite(zq.scale).all())
    # a GEMM with an all-zero operand is exactly zero, not NaN
    assert bool((emulated_gemm(quantize_tiles(torch.zeros(4, 256)), quantize_blocks(torch.randn(8, 256))) == 0).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_tile_dequantises_to_nan_not_saturated(bad):
    x = torch.randn(3, 256)
    x[1, 130] = bad
    q = quantize_tiles(x)
    d = dequantize(q)
    assert bool(torch.isnan(d[1, 128:]).all()), "the whole tile holding a non-finite value must be NaN"
    assert bool(torch.isfinite(d[1, :128]).all()) and bool(torch.isfinite(d[[0, 2]]).all()), "other tiles untouched"
    assert torch.isnan(q.scale[1, 1]) and not bool(torch.isnan(q.scale[[0, 2]]).any())


def test_non_finite_block_dequantises_to_nan():
    w = torch.randn(256, 256)
    w[200, 3] = float("inf")
    d = dequantize(quantize_blocks(w))
    assert bool(torch.isnan(d[128:, :128]).all())
    assert bool(torch.isfinite(d[:128]).all()) and bool(torch.isfinite(d[128:, 128:]).all())


def test_block_transpose_is_the_quantisation_of_the_transpose():
    w = torch.randn(256, 384)
    q = quantize_blocks(w)
    torch.testing.assert_close(dequantize(q.t()), dequantize(quantize_blocks(w.t())), rtol=0, atol=0)
    with pytest.raises(ValueError, match="only 128x128 block-quantised"):
        quantize_tiles(w).t()


def test_bad_inputs_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="2-D tensor"):
        quantize_tiles(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_blocks(torch.ones(4, 4, dtype=torch.int64))


def test_emulated_gemm_equals_fp32_matmul_of_dequantised_operands():
    a, b = torch.randn(7, 300), torch.randn(11, 300)
    qa, qb = quantize_tiles(a), quantize_blocks(b)
    want = dequantize(qa).double() @ dequantize(qb).double().t()
    torch.testing.assert_close(emulated_gemm(qa, qb).double(), want, rtol=1e-5, atol=1e-5)


def _e4m3_step(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spacing of the E4M3 grid at |v| (in the tile's units, ``v / scale``), times the scale: 2^(e-3) for
    a normal quotient in [2^e, 2^(e+1)), 2^-9 below 2^-6 (the subnormals)."""
    e = torch.floor(torch.log2((v / scale).abs().clamp(min=2.0 ** -6)))
    return scale * torch.exp2(e - 3)


def test_a_one_ulp_change_moves_an_element_by_at_most_one_e4m3_step_and_can_move_it_by_a_whole_one():
    """Why a two-path comparison of FP8 results cannot be given a float-rounding tolerance, and the bound one
    can give instead.

    Round-to-nearest puts each element within half a grid step of its value: |Q(a) - a| <= step(a) / 2. For
    two inputs a and b that differ by float rounding (two kernels, two summation orders), the triangle
    inequality gives |Q(a) - Q(b)| <= |a - b| + step(a) / 2 + step(b) / 2: at most one E4M3 step at the
    element's tile scale, plus the difference itself. Through a GEMM y = Q(a) Wᵀ this becomes
    |Δy| <= (|a - b| + step(a) / 2 + step(b) / 2) |W|ᵀ: a 1/8 relative change of any element whose quotient
    lay on a rounding boundary, however small |a - b| was. Such a value is easy to meet: every midpoint
    between two E4M3 values is a float32 number. So the library makes its two paths run the same kernels
    (``test_compile.py``), and this test checks both the bound and that it is reached."""
    scale_unit = torch.tensor(2.0) ** -4
    # a tile with its max at 448 units (scale = 2^-4 exactly) and elements on midpoints of the E4M3 grid, where
    # ties go to the even mantissa: 1.0625 between 1.0 and 1.125 (to 1.0), 17 between 16 and 18 (to 16), and
    # 5/1024 between the subnormals 2/512 and 3/512 (to 2/512)
    units = torch.tensor([448.0, 1.0625, 17.0, 5 / 1024, -1.0625] + [0.5] * 123)
    a = (units * scale_unit).reshape(1, 128)
    b = torch.nextafter(a, torch.full_like(a, float("inf")))  # one float32 ulp up: the other path's rounding
    b[0, 0] = a[0, 0]  # the same max-abs, so the same scale: the move comes from the rounding alone
    qa, qb = dequantize(quantize_tiles(a)), dequantize(quantize_tiles(b))
    sa, sb = quantize_tiles(a).scale, quantize_tiles(b).scale
    bound = (b - a).abs() + _e4m3_step(a, sa) / 2 + _e4m3_step(b, sb) / 2
    assert bool(((qa - qb).abs() <= bound).all())
    # each midpoint moved by a whole step of its binade (1.0 -> 1.125, 16 -> 18, 2/512 -> 3/512 units)
    moved = ((qb - qa) / _e4m3_step(a, sa))[0, 1:4]
    assert moved.tolist() == [1.0, 1.0, 1.0]
    # and a random tile under a one-ulp change: within the bound everywhere
    x = torch.randn(64, 384, generator=torch.Generator().manual_seed(0)) * 3
    y = torch.nextafter(x, torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.5,
                                       torch.full_like(x, float("inf")), torch.full_like(x, -float("inf"))))
    qx, qy = quantize_tiles(x), quantize_tiles(y)
    sx, sy = qx.scale.repeat_interleave(128, 1), qy.scale.repeat_interleave(128, 1)
    bound = (y - x).abs() + _e4m3_step(x, sx) / 2 + _e4m3_step(y, sy) / 2
    assert bool(((dequantize(qx) - dequantize(qy)).abs() <= bound).all())
