"""MLA's flash-style core attention (``core_attention="flash"``): the eager core's results, the footprint the
planner calls ``fused`` attention (q, k, v, the output, one log-sum-exp per head)."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.layers import flash_core as fc
from mt_dualpipe.layers.attention_core import eager_core
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute
from mt_dualpipe.planner import ModelSpec

torch.set_num_threads(1)

TINY = DeepSeekV3Config.preset("tiny", dim=64, n_layers=2, vocab_size=64, inter_dim=128, moe_inter_dim=32,
                               max_seq_len=64, mtp_depth=1)


def _qkv(dtype, seq=20, heads=3, dqk=12, dv=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, seq, heads, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for d in (dqk, dqk, dv)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flash_core_equals_the_eager_core_across_query_blocks(monkeypatch, dtype):
    monkeypatch.setattr(fc, "QUERY_BLOCK", 8)  # 20 queries: blocks of 8, 8 and 4
    q, k, v = _qkv(dtype)
    grad = torch.randn(2, 20, 3 * 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    outs = []
    for core in (lambda *a: eager_core(*a, 0.3), lambda *a: fc.flash_core(*a, 0.3, cdt)):
        y = core(q, k, v)
        outs.append((y, *torch.autograd.grad(y, (q, k, v), grad)))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, **tol)


def test_flash_core_keeps_q_k_v_the_output_and_one_log_sum_exp_per_head():
    q, k, v = _qkv(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fc.flash_core(q, k, v[:, :, :, :8], 0.3, torch.float32)
    assert [tuple(t.shape) for t in saved] == [(2, 20, 3, 12), (2, 20, 3, 12), (2, 20, 3, 8), (2, 20, 3, 8),
                                               (2, 3, 20)]
    assert saved[3].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()  # the output itself
    assert saved[4].dtype == torch.float32


def _train(config: DeepSeekV3Config):
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).double()
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, config.vocab_size, (2, 16), generator=g) for _ in range(2))
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy_savers", ["", "all"])
def test_the_model_trains_the_same_with_the_flash_core(policy_savers):
    loss0, ref = _train(TINY)
    loss, got = _train(TINY.replace(core_attention="flash", memory_savers=policy_savers))
    torch.testing.assert_close(loss, loss0, rtol=1e-13, atol=0)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-13 * ref[name].abs().max(), msg=name)


def test_the_config_refuses_an_unknown_core():
    with pytest.raises(ValueError, match="core_attention 'sdpa' is not supported"):
        TINY.replace(core_attention="sdpa")


@pytest.mark.parametrize("policy", ["none", "selective"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_saved_bytes_are_the_planners_fused_attention_within_10_percent(kind, policy):
    """A float32 layer at sequence 32: what autograd keeps (the meter, parameters excluded) against
    ``ModelSpec.layer_item(..., attention="fused")``. Without recompute the eager core keeps more (its
    probabilities, by what the planner says); selective recomputes either core from MLA's latents."""
    seq = 32
    spec = ModelSpec.from_deepseek_config(TINY)
    layer_id = 0 if kind == "dense" else 1
    measured = {}
    for core in ("eager", "flash"):
        torch.manual_seed(0)
        block = DeepSeekV3Model(TINY.replace(core_attention=core)).model.layers[str(layer_id)]
        apply_recompute(block, policy)
        x = torch.randn(1, seq, TINY.dim, requires_grad=True)
        meter = SavedActivationMeter(exclude=list(block.parameters()) + list(block.buffers()))
        with meter.measure():
            block(x)
        measured[core] = meter.peak
    planned = {core: spec.layer_item(layer_id, seq, 4.0, policy, elem=4.0, attention=kind_).act_bytes * seq
               for core, kind_ in (("eager", "eager"), ("flash", "fused"))}
    assert measured["flash"] == pytest.approx(planned["flash"], rel=0.10)
    if policy == "none":
        assert measured["flash"] < measured["eager"]
        saved_by_flash = measured["eager"] - measured["flash"]
        assert saved_by_flash == pytest.approx(planned["eager"] - planned["flash"], rel=0.10)
