"""DeepSeek-V3's memory savers (``DeepSeekV3Config.memory_savers``) change what backward keeps, not what
training computes: the loss and the gradients with each saver on against the same model with it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mt_dualpipe.fp8 import convert_to_fp8
from mt_dualpipe.layers.savers import MEMORY_SAVERS, parse_memory_savers
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3.mla import RMSNorm

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)

TINY = DeepSeekV3Config.preset("tiny", n_layers=3, vocab_size=64, max_seq_len=64, mtp_depth=1)
# dimensions multiples of 128: whole FP8 tiles
WIDE = DeepSeekV3Config.preset("tiny", dim=128, n_layers=2, vocab_size=64, inter_dim=256, moe_inter_dim=128,
                               q_lora_rank=128, kv_lora_rank=128, max_seq_len=64, mtp_depth=0)
BIT_EQUAL = {"swiglu", "router", "attention"}  # the same ops re-run in B; the others reorder float sums


def _run(cfg: DeepSeekV3Config, savers: str, dtype: torch.dtype, fp8: bool = False):
    torch.manual_seed(0)
    model = DeepSeekV3Model(cfg.replace(memory_savers=savers)).to(dtype)
    if fp8:
        convert_to_fp8(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_config_names_the_savers():
    assert TINY.memory_savers == frozenset()
    assert TINY.replace(memory_savers="all").memory_savers == frozenset(MEMORY_SAVERS)
    assert parse_memory_savers("norm, swiglu") == {"norm", "swiglu"} and parse_memory_savers("none") == frozenset()
    with pytest.raises(ValueError, match="unknown memory saver 'rmsnorm'"):
        TINY.replace(memory_savers=["rmsnorm"])


@pytest.mark.parametrize("saver", [*MEMORY_SAVERS, "all"])
def test_each_saver_keeps_the_loss_and_gradients(saver):
    loss0, ref = _run(TINY, "", torch.float64)
    loss, got = _run(TINY, saver, torch.float64)
    assert torch.equal(loss, loss0)
    assert got.keys() == ref.keys() and len(ref) > 100
    for name in ref:
        if saver in BIT_EQUAL:
            assert torch.equal(got[name], ref[name]), (saver, name)
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-14 * ref[name].abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_recomputed_rms_norm_is_bit_equal_to_eager(dtype):
    torch.manual_seed(0)
    plain, saver = RMSNorm(64), RMSNorm(64, recompute=True)
    for norm in (plain, saver):
        norm.to(dtype).weight.data.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 64, dtype=dtype)
    outs = []
    for norm in (plain, saver):
        y = norm(x)
        gx, gw = torch.autograd.grad(y, (x, norm.weight), grad)
        outs.append((y, gx, gw))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saver(x)
    assert [t.shape for t in saved] == [x.shape, (64,)]  # the input and the weight, nothing in float32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_cached_swiglu_inputs_stay_within_the_fp8_recipes_error():
    """With FP8 linears the SwiGLU keeps gate and up in E4M3 + 1x128 scales: its gradients move from the
    saver-off FP8 run by less than FP8 itself moves them from BF16."""
    loss_bf16, bf16 = _run(WIDE, "", torch.bfloat16)
    loss_fp8, fp8 = _run(WIDE, "", torch.bfloat16, fp8=True)
    loss, got = _run(WIDE, "swiglu", torch.bfloat16, fp8=True)
    assert torch.equal(loss, loss_fp8)  # the forward uses the exact inputs
    swiglu_params = [n for n in fp8 if ".gate_proj." in n or ".up_proj." in n]
    assert len(swiglu_params) > 10
    worst = 0.0
    for name in fp8:
        recipe = _rel(fp8[name], bf16[name])
        err = _rel(got[name], fp8[name])
        worst = max(worst, err)
        assert err <= max(recipe, 0.02), (name, err, recipe)
    assert worst > 0  # the inputs really were quantised


@pytest.mark.parametrize("saver", ["norm", "swiglu", "combine", "router"])
def test_the_savers_survive_bfloat16_training_math(saver):
    """bf16 (the production dtype): gradients bit-equal, or within bf16 rounding where sums are reordered (the
    combine also rounds w·W2(p) as W2(w·p) in the forward)."""
    loss0, ref = _run(WIDE, "", torch.bfloat16)
    loss, got = _run(WIDE, saver, torch.bfloat16)
    assert torch.equal(loss, loss0) if saver != "combine" else abs(float(loss / loss0) - 1) < 1e-2
    for name in ref:
        if saver in BIT_EQUAL:
            assert torch.equal(got[name], ref[name]), (saver, name)
        else:
            assert _rel(got[name], ref[name]) < 2e-2, (saver, name, _rel(got[name], ref[name]))


def test_savers_are_off_without_grad():
    """Evaluation (no graph) runs the plain ops: no custom function is recorded."""
    cfg = TINY.replace(memory_savers="all")
    torch.manual_seed(0)
    model = DeepSeekV3Model(cfg).double().eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        a = model(tokens)
    torch.manual_seed(0)
    plain = DeepSeekV3Model(TINY).double().eval()
    with torch.no_grad():
        b = plain(tokens)
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert F.cross_entropy(a[0], tokens[0]).isfinite()


def test_fp8_swiglu_down_defers_its_weight_gradient_to_w():
    """With FP8 linears the SwiGLU saver keeps neither the product nor w2's input: B rebuilds the product, and
    w2's weight-gradient GEMM, queued for W, holds its FP8 copy. B then W gives the unsplit gradients exactly."""
    from mt_dualpipe.fp8.linear import FP8Linear
    from mt_dualpipe.layers.mlp import SwiGLUMLP
    from mt_dualpipe.runtime.weight_grad import WeightGradStore

    torch.manual_seed(0)
    mlp = convert_to_fp8(SwiGLUMLP(128, 256, recompute_product=True), backend="emulated")
    assert isinstance(mlp.down_proj, FP8Linear)
    x = torch.randn(2, 8, 128, requires_grad=True)
    row_w = torch.rand(2, 8, 1, requires_grad=True)
    dy = torch.randn(2, 8, 128)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mlp(x, row_w)
    assert not any(t.shape[-1] == 256 and t.dtype == torch.float32 for t in saved)  # no product, no gate/up
    y.backward(dy)
    unsplit = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone(), row_w.grad.clone()]
    for p in (*mlp.parameters(), x, row_w):
        p.grad = None
    store = WeightGradStore()
    with store.deferring("mb0"):
        mlp(x, row_w).backward(dy)
    assert all(p.grad is None for p in mlp.parameters()) and x.grad is not None and row_w.grad is not None
    assert store.run("mb0") == 3  # w1, w3 and the fused w2
    for a, b in zip([p.grad for p in mlp.parameters()] + [x.grad, row_w.grad], unsplit):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_all_savers_under_each_recompute_policy_in_the_stages(policy):
    """The stages' piecewise forward (the pipeline's path) with every saver on, under each recompute policy:
    the loss and the gradients of the savers-off stages."""
    from mt_dualpipe.models.deepseek_v3 import build_stages, sync_replicas

    cfg = DeepSeekV3Config.preset("tiny", dim=64, n_layers=3, vocab_size=128, inter_dim=128, moe_inter_dim=32,
                                  max_seq_len=64)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    runs = []
    for savers in ("", "all"):
        torch.manual_seed(0)
        model = DeepSeekV3Model(cfg.replace(memory_savers=savers)).double()
        first, last = (s.double() for s in build_stages(model.config, 2, source=model, recompute=policy))
        h = first(tokens)
        h_in = h.detach().requires_grad_()
        loss = last.criterion(last(h_in), labels)
        loss.backward()
        h.backward(h_in.grad)
        sync_replicas([first, last])
        runs.append((loss.detach(), {f"{i}.{n}": p.grad for i, s in enumerate((first, last))
                                     for n, p in s.named_parameters() if p.grad is not None}))
    (loss0, ref), (loss, got) = runs
    assert torch.equal(loss, loss0) and got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-14 * ref[name].abs().max())
