"""The block-scaled scaled_mm path, driven through a stand-in kernel with cuBLAS' documented layouts.

This machine has no block-scaled FP8 kernel (torch 2.13 CPU), so the real one cannot run here. The
stand-in checks every layout rule cuBLAS states for 1x128 / 128x128 scaling (row-major A,
column-major B, K a multiple of 128, 1x128 scales column-major, 128x128 scales (ceil4(K/128),
N/128) K-major) and computes the block-scaled product; the padding, transposes and slicing of
``ScaledMMGemm`` and the probe-based selection must then reproduce the emulation exactly.
"""

import pytest
import torch
import torch.nn.functional as F

from mt_dualpipe.fp8 import (
    FP8Linear,
    backends,
    emulated_gemm,
    quantize_blocks,
    quantize_tiles,
    resolve_gemm,
)

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)


def _fake_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    st = F.ScalingType
    (m, k), (k2, n) = mat_a.shape, mat_b.shape
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert k == k2 and k % 128 == 0 and m % 4 == 0, (m, k, n)
    assert mat_a.is_contiguous() and mat_b.t().is_contiguous(), "A row-major, B column-major"
    blocks = k // 128
    assert recipe_a == st.BlockWise1x128 and scale_a.shape == (m, blocks) and scale_a.stride() == (1, m)
    if recipe_b == st.BlockWise1x128:
        assert n % 4 == 0 and scale_b.shape == (n, blocks) and scale_b.stride() == (1, n)
        sb = scale_b.repeat_interleave(128, 1)
    else:
        assert recipe_b == st.BlockWise128x128 and n % 128 == 0
        l4 = -(-blocks // 4) * 4
        assert scale_b.shape == (l4, n // 128) and scale_b.stride() == (1, l4), (scale_b.shape, scale_b.stride())
        sb = scale_b[:blocks].t().repeat_interleave(128, 0).repeat_interleave(128, 1)
    a = mat_a.float() * scale_a.repeat_interleave(128, 1)
    b = mat_b.t().float() * sb
    return (a @ b.t()).to(output_dtype)


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", _fake_scaled_mm)
    monkeypatch.setattr(backends, "_probe_cache", {})
    monkeypatch.setattr(backends, "_native_gemms", {})


@pytest.mark.parametrize("m,n,k", [(128, 256, 256), (7, 200, 300), (33, 128, 129), (1, 5, 64)])
@pytest.mark.parametrize("b_kind", ["block", "tile"])
def test_native_path_pads_and_slices_to_the_emulated_result(fake_kernel, m, n, k, b_kind):
    gen = torch.Generator().manual_seed(m + n + k)
    a = quantize_tiles(torch.randn(m, k, generator=gen))
    w = torch.randn(n, k, generator=gen)
    b = quantize_blocks(w) if b_kind == "block" else quantize_tiles(w)
    got = backends.ScaledMMGemm(torch.float32).native(a, b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, emulated_gemm(a, b), rtol=1e-5, atol=1e-4)


def test_native_path_handles_the_transposed_weight_of_the_input_gradient(fake_kernel):
    w = quantize_blocks(torch.randn(256, 384))  # (out, in): dgrad multiplies by its transpose
    dy = quantize_tiles(torch.randn(9, 256))
    got = backends.ScaledMMGemm(torch.float32).native(dy, w.t())
    torch.testing.assert_close(got, emulated_gemm(dy, w.t()), rtol=1e-5, atol=1e-4)


def test_probe_selects_scaled_mm_when_the_kernel_works_and_layers_agree_with_emulation(fake_kernel):
    name, gemm = resolve_gemm("cpu", "auto")
    assert name == "scaled_mm" and gemm.out_dtype == torch.float32
    assert "block-scaled scaled_mm on cpu" in backends.backend_summary("cpu")
    torch.manual_seed(0)
    native = FP8Linear(300, 200, backend="scaled_mm")
    emulated = FP8Linear(300, 200, backend="emulated")
    emulated.load_state_dict(native.state_dict())
    assert native.active_backend == "scaled_mm" and emulated.active_backend == "emulated"
    x = torch.randn(2, 17, 300)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = native(x1), emulated(x2)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-4)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(native.weight.grad, emulated.weight.grad, rtol=1e-5, atol=1e-3)
    assert gemm.fallbacks == 0


def test_native_path_keeps_the_non_finite_contract(fake_kernel):
    x = torch.randn(8, 256)
    x[3, 200] = float("inf")
    w = torch.randn(256, 256)
    w[10, 10] = float("nan")
    out = backends.ScaledMMGemm(torch.float32)(quantize_tiles(x), quantize_blocks(w))
    bad = torch.zeros(8, 256, dtype=torch.bool)
    bad[3] = True
    bad[:, :128] = True
    assert bool(torch.isnan(out[bad]).all()) and bool(torch.isfinite(out[~bad]).all())


def test_probe_rejects_a_kernel_that_disagrees(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: _fake_scaled_mm(*a, **k) * 1.5)
    monkeypatch.setattr(backends, "_probe_cache", {})
    monkeypatch.setattr(backends, "_native_gemms", {})
    assert resolve_gemm("cpu", "auto")[0] == "emulated"
    with pytest.raises(RuntimeError, match="disagrees with the emulation"):
        resolve_gemm("cpu", "scaled_mm")
