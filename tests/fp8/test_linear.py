"""FP8Linear against fp32 and against the recipe computed by hand; deferred W; convert_to_fp8."""

import pytest
import torch
from torch import nn

from mt_dualpipe.fp8 import (
    FP8Linear,
    backend_summary,
    convert_to_fp8,
    dequantize,
    quantize_blocks,
    quantize_tiles,
    resolve_gemm,
)
from mt_dualpipe.runtime.weight_grad import WeightGradStore

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)


def _pair(in_f=256, out_f=384, bias=True, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    fp8 = FP8Linear(in_f, out_f, bias=bias, backend="emulated")
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _hand_recipe(x2, w, dy2):
    """The recipe written out directly: quantise, dequantise, fp32 GEMMs (dW from the FP8-cached x)."""
    xd = dequantize(quantize_tiles(x2))
    wd = dequantize(quantize_blocks(w))
    y = xd @ wd.t()
    dx = dequantize(quantize_tiles(dy2)) @ wd
    dw = dequantize(quantize_tiles(dy2.t())) @ dequantize(quantize_tiles(xd.t())).t()
    return y, dx, dw


def test_drop_in_for_nn_linear():
    ref, fp8 = _pair(bias=True)
    assert isinstance(fp8, nn.Linear) and FP8Linear.supports_deferred_weight_grad
    assert list(fp8.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in fp8.named_parameters()] == ["weight", "bias"]
    shared = FP8Linear.from_linear(ref)
    assert shared.weight is ref.weight and shared.bias is ref.bias
    assert "backend=auto" in repr(shared)


@pytest.mark.parametrize("bias", [True, False])
def test_forward_backward_match_the_recipe_and_fp32_within_fp8_error(bias):
    ref, fp8 = _pair(bias=bias)
    x = torch.randn(3, 50, 256)
    x_ref, x_8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_8 = ref(x_ref), fp8(x_8)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y_8.backward(dy)

    y_h, dx_h, dw_h = _hand_recipe(x.reshape(-1, 256), ref.weight.detach(), dy.reshape(-1, 384))
    if bias:
        y_h = y_h + ref.bias.detach()
        torch.testing.assert_close(fp8.bias.grad, dy.reshape(-1, 384).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_8.reshape(-1, 384), y_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_8.grad.reshape(-1, 256), dx_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8.weight.grad, dw_h, rtol=1e-5, atol=1e-4)
    # E4M3 keeps 3 mantissa bits: ~2-4 % relative error per GEMM, and not zero (FP8 really ran)
    for got, want in [(y_8, y_ref), (x_8.grad, x_ref.grad), (fp8.weight.grad, ref.weight.grad)]:
        assert 1e-3 < _rel(got, want) < 0.06


def test_forward_error_within_the_elementwise_rounding_bound():
    """|y8 - y| <= sum_k |x||ew| + |ex||w| + |ex||ew|, with each operand's per-element E4M3 bound."""
    ref, fp8 = _pair(300, 200, bias=False)
    x = torch.randn(64, 300) * torch.exp(torch.randn(64, 300))
    w = ref.weight.detach()
    xq, wq = quantize_tiles(x), quantize_blocks(w)
    ex = torch.maximum(x.abs() / 16, xq.scale.repeat_interleave(128, 1)[:, :300] / 1024)
    ew = torch.maximum(w.abs() / 16, wq.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300] / 1024)
    bound = x.abs() @ ew.t() + ex @ w.abs().t() + ex @ ew.t()
    err = (fp8(x) - ref(x)).abs()
    assert bool((err <= bound * 1.001 + 1e-5).all())


def test_input_dtype_is_kept_and_bad_shapes_rejected():
    _, fp8 = _pair()
    y = fp8(torch.randn(4, 256, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (4, 384)
    with pytest.raises(ValueError, match="last dimension 256"):
        fp8(torch.randn(4, 255))
    with pytest.raises(ValueError, match="unknown FP8 backend 'fp4'"):
        FP8Linear(4, 4, backend="fp4")


def test_scaled_mm_backend_on_cpu_says_why_it_is_unavailable():
    assert resolve_gemm("cpu", "auto")[0] == "emulated"
    with pytest.raises(RuntimeError, match="'scaled_mm' is not available: .*block-scaled"):
        resolve_gemm("cpu", "scaled_mm")
    line = backend_summary("cpu")
    assert "emulated" in line and "torchao" in line and "transformer_engine" in line


def test_weight_cache_follows_in_place_updates():
    ref, fp8 = _pair()
    x = torch.randn(8, 256)
    fp8(x).sum().backward()
    torch.optim.SGD(fp8.parameters(), lr=0.5).step()  # in-place: bumps the weight's version
    fresh = FP8Linear(256, 384, backend="emulated")
    fresh.load_state_dict(fp8.state_dict())
    torch.testing.assert_close(fp8(x), fresh(x), rtol=0, atol=0)
    assert not torch.equal(fp8(x), ref(x))


def test_non_finite_input_propagates_nan_to_the_rows_it_touches():
    _, fp8 = _pair()
    x = torch.randn(4, 256, requires_grad=True)
    with torch.no_grad():
        x[2, 7] = float("inf")
    y = fp8(x)
    assert bool(torch.isnan(y[2]).all()) and bool(torch.isfinite(y[[0, 1, 3]]).all())
    dy = torch.ones_like(y)
    dy[1, 5] = float("nan")
    y.backward(dy)
    assert bool(torch.isnan(x.grad[1]).all()) and bool(torch.isfinite(x.grad[[0, 2, 3]]).all())
    assert bool(torch.isnan(fp8.weight.grad).any()), "a NaN gradient must reach dW, not be clipped away"


def _split_vs_unsplit(n_microbatches):
    torch.manual_seed(1)
    model_a = nn.Sequential(FP8Linear(256, 128, backend="emulated"), nn.GELU(), FP8Linear(128, 256, backend="emulated"))
    model_b = nn.Sequential(FP8Linear(256, 128, backend="emulated"), nn.GELU(), FP8Linear(128, 256, backend="emulated"))
    model_b.load_state_dict(model_a.state_dict())
    xs = [torch.randn(16, 256) for _ in range(n_microbatches)]
    store = WeightGradStore()
    grads_in = []
    for i, x in enumerate(xs):
        xa = x.clone().requires_grad_()
        with store.deferring(("mb", i)):
            model_a(xa).pow(2).sum().backward()
        grads_in.append(xa.grad)
        assert all(p.grad is None for p in model_a.parameters()), "B must leave the weight gradients to W"
    assert len(store) == n_microbatches
    for i in range(n_microbatches):
        assert store.run_oldest(("mb", i)) == 2  # one closure per FP8Linear
    for i, x in enumerate(xs):
        xb = x.clone().requires_grad_()
        model_b(xb).pow(2).sum().backward()
        torch.testing.assert_close(grads_in[i], xb.grad, rtol=0, atol=0)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_deferred_weight_grad_equals_unsplit_backward():
    _split_vs_unsplit(1)


def test_deferred_weight_grads_of_several_microbatches_accumulate():
    _split_vs_unsplit(3)


def test_frozen_weight_defers_only_the_bias_gradient():
    ref, fp8 = _pair()
    fp8.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    x = torch.randn(6, 256)
    store = WeightGradStore()
    with store.deferring("b"):
        fp8(x).sum().backward()
    assert fp8.weight.grad is None and fp8.bias.grad is None
    assert store.run_oldest("b") == 1 and fp8.weight.grad is None
    ref(x).sum().backward()
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-5)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(128)
        self.wq, self.wkv, self.wo = nn.Linear(128, 128), nn.Linear(128, 256), nn.Linear(128, 128)
        self.attn = nn.MultiheadAttention(128, 4)  # its out_proj is a Linear subclass: left alone
        self.gate = nn.Linear(128, 4, bias=False)  # MoE gate: kept
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(128, 256), nn.Linear(128, 256), nn.Linear(256, 128)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 128)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 100, bias=False)


def test_convert_keeps_the_high_precision_parts_and_the_state_dict(capsys):
    model = _Model()
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    convert_to_fp8(model, backend="emulated", verbose=True)
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear))
    assert converted == sorted(f"layers.{i}.{n}" for i in range(2)
                               for n in ("wq", "wkv", "wo", "gate_proj", "up_proj", "down_proj"))
    assert type(model.head) is nn.Linear and type(model.layers[0].gate) is nn.Linear
    assert isinstance(model.embed, nn.Embedding) and not isinstance(model.layers[0].attn.out_proj, FP8Linear)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    out = capsys.readouterr().out
    assert "emulated" in out and "12 linears converted, 3 kept" in out


def test_convert_skip_options_and_errors():
    model = _Model()
    convert_to_fp8(model, skip=lambda name, m: not name.endswith("down_proj"))
    assert sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear)) == [
        "layers.0.down_proj", "layers.1.down_proj"]
    model = _Model()
    convert_to_fp8(model, skip=None)
    assert isinstance(model.head, FP8Linear) and isinstance(model.layers[1].gate, FP8Linear)
    with pytest.raises(TypeError, match="not the string 'head'"):
        convert_to_fp8(_Model(), skip="head")
    with pytest.raises(ValueError, match="unknown FP8 backend 'int8'"):
        convert_to_fp8(_Model(), backend="int8")
    with pytest.raises(TypeError, match="FP8Linear.from_linear"):
        convert_to_fp8(nn.Linear(4, 4))


@pytest.mark.parametrize("engine", ["torchao", "transformer_engine"])
def test_optional_engines_are_detected_not_required(engine):
    from mt_dualpipe.fp8.backends import has_module

    if has_module(engine):
        pytest.skip(f"{engine} is installed here; the missing-engine message cannot be checked")
    with pytest.raises(RuntimeError, match=f"needs the optional package '{engine}', which is not installed"):
        convert_to_fp8(_Model(), backend=engine)


def test_scaled_mm_gemm_falls_back_to_the_emulation_with_one_warning():
    from mt_dualpipe.fp8 import emulated_gemm
    from mt_dualpipe.fp8.backends import ScaledMMGemm

    gemm = ScaledMMGemm(torch.float32)
    a, b = quantize_tiles(torch.randn(4, 256)), quantize_blocks(torch.randn(128, 256))
    with pytest.warns(UserWarning, match="run in the emulation"):
        out = gemm(a, b)  # CPU torch has no block-scaled kernel: rejected, emulated
    torch.testing.assert_close(out, emulated_gemm(a, b), rtol=0, atol=0)
    assert gemm.fallbacks == 1


def test_torchao_adapter_hands_torchao_the_same_selection(monkeypatch):
    """With torchao importable, convert_to_fp8 defers to convert_to_float8_training with our skip rule."""
    import importlib.machinery
    import sys
    import types

    seen = {}

    def convert_to_float8_training(module, *, module_filter_fn=None, config=None):
        seen["config"] = config
        seen["names"] = sorted(n for n, m in module.named_modules() if module_filter_fn(m, n))
        return module

    fake = types.ModuleType("torchao")
    fake.__spec__ = importlib.machinery.ModuleSpec("torchao", None)
    float8 = types.ModuleType("torchao.float8")
    float8.convert_to_float8_training = convert_to_float8_training
    float8.Float8LinearConfig = types.SimpleNamespace(from_recipe_name=lambda name: f"recipe:{name}")
    monkeypatch.setitem(sys.modules, "torchao", fake)
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    convert_to_fp8(_Model(), backend="torchao")
    assert seen["config"] == "recipe:rowwise"
    assert seen["names"] == sorted(f"layers.{i}.{n}" for i in range(2)
                                   for n in ("wq", "wkv", "wo", "gate_proj", "up_proj", "down_proj"))


def test_benchmark_reports_device_and_backend(capsys):
    from pathlib import Path

    from tests.helpers.scripts import load_script

    bench = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_gemm.py", "fp8_gemm_bench")
    assert bench.main(["--device", "cpu", "--sizes", "128x256x128", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu" in out and "fp8 backend on cpu: emulated" in out and "128x256x128" in out
