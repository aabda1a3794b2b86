"""The shared model layer's pieces against transformers (float64) and their declarations."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.layers import Dispatcher, GQAttention, RopeSpec, SoftmaxTopKRouter, SwiGLUMLP, cos_sin
from mt_dualpipe.layers import inv_freq as our_inv_freq
from mt_dualpipe.models.recompute import DeclaresRecompute
from tests.helpers.hf_reference import float64_transformers, relative_error

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_frequencies_and_factor_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=128,
                                     rope_parameters=dict(ROPES[name]))
    spec = RopeSpec.from_hf(hf.to_dict())
    assert RopeSpec.from_hf({"rope_parameters": spec.to_hf()}) == spec
    with float64_transformers():
        kind = ROPES[name]["rope_type"]
        if kind == "default":
            want = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
            factor = 1.0
        else:
            want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    assert relative_error(our_inv_freq(16, spec), want.double()) < 1e-14
    assert spec.attention_factor() == pytest.approx(factor, rel=1e-14)
    cos, _ = cos_sin(5, 16, spec, torch.float64)
    assert cos[0, 0] == pytest.approx(factor, rel=1e-14)


def test_rope_refuses_unknown_kinds_and_missing_fields():
    with pytest.raises(ValueError, match="rope scaling type 'longrope' is not supported"):
        RopeSpec.from_hf({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="needs"):
        RopeSpec.from_hf({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}})


@torch.no_grad()
def test_dispatch_combine_equals_a_dense_loop_over_experts():
    torch.manual_seed(0)
    router = SoftmaxTopKRouter(8, 5, 2).double()
    torch.nn.init.normal_(router.weight)
    experts = [SwiGLUMLP(8, 6).double() for _ in range(5)]
    x = torch.randn(13, 8, dtype=torch.float64)
    routing = router(x)
    d = Dispatcher(5)
    rows, plan = d.dispatch(x, routing)
    assert sum(plan.expert_rows) == 26 and torch.equal(routing.indices.flatten()[plan.pair_of].sort().values,
                                                        routing.indices.flatten()[plan.pair_of])
    outs = torch.cat([e(c) for e, c in zip(experts, rows.split(plan.expert_rows))])
    got = d.combine(outs, routing, plan)
    want = torch.stack([sum(routing.weights[t, j] * experts[int(routing.indices[t, j])](x[t])
                            for j in range(2)) for t in range(13)])
    assert relative_error(got, want) < 1e-14


def test_layers_declare_recompute_regions():
    attn = GQAttention(16, 4, 2, 4, RopeSpec(), qk_norm=True)
    mlp = SwiGLUMLP(16, 8)
    assert isinstance(attn, DeclaresRecompute) and isinstance(mlp, DeclaresRecompute)
    assert [t for _, _, t in attn.recompute_regions("selective")] == ["core_attention"]
    assert [t for _, _, t in mlp.recompute_regions("selective")] == ["swiglu"]
    assert list(attn.recompute_regions("full")) == [] and list(mlp.recompute_regions("none")) == []
    assert attn.saved_per_token("none", 32)["probs"] == 4 * 32 and "probs" not in attn.saved_per_token("selective", 32)


def test_sync_replicas_sums_the_copies_of_a_name_on_this_rank():
    """The family-neutral ``sync_replicas``: a V schedule's first and last stage both hold the tied
    embedding; after it both gradients are the sum, other names untouched, a missing gradient counted as 0."""
    from torch import nn

    from mt_dualpipe.layers.replicas import sync_replicas

    first, last = nn.ModuleDict({"embed": nn.Embedding(4, 3)}), nn.ModuleDict({"embed": nn.Embedding(4, 3),
                                                                             "head": nn.Linear(3, 2)})
    first.embed.weight.grad = torch.ones(4, 3)
    last.embed.weight.grad = 2 * torch.ones(4, 3)
    sync_replicas([first, last])
    assert torch.equal(first.embed.weight.grad, 3 * torch.ones(4, 3))
    assert torch.equal(last.embed.weight.grad, 3 * torch.ones(4, 3))
    assert torch.equal(last.head.weight.grad, torch.zeros(2, 3))


def test_init_normal_gives_deferred_linears_zero_biases_and_normal_weights():
    """Under ``deferred_init`` nn.Linear skips its own init (its memory is whatever ``empty`` held):
    ``init_normal`` sets weights ~ N(0, std) and biases to zero, as transformers' ``_init_weights``."""
    from mt_dualpipe.layers import deferred_init, init_normal

    with deferred_init():
        lin = torch.nn.Linear(64, 512)
    lin.bias.data.fill_(float("nan"))  # what uninitialised memory may hold
    torch.manual_seed(0)
    init_normal(lin, 0.02)
    assert torch.equal(lin.bias, torch.zeros(512))
    assert abs(lin.weight.std().item() - 0.02) < 1e-3 and abs(lin.weight.mean().item()) < 1e-3


@pytest.mark.parametrize("fused", [False, True])
def test_recomputed_rms_norm_keeps_only_its_input_and_gives_the_same_gradients(fused):
    """bf16: ``recompute`` keeps the input alone and re-runs the same ``rms_norm`` in B (bit-equal gradients);
    ``fused`` is one ``F.rms_norm`` in bf16, the default transformers' order (float32 normalise, then weight)."""
    from mt_dualpipe.layers import RMSNorm
    from mt_dualpipe.models.recompute import SavedActivationMeter

    x0 = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        norm = RMSNorm(64, 1e-6, recompute, fused).bfloat16()
        torch.nn.init.normal_(norm.weight, 1.0, 0.1, generator=torch.Generator().manual_seed(1))
        x = x0.clone().requires_grad_()
        meter = SavedActivationMeter(exclude=[norm.weight])
        with meter.measure():
            y = norm(x)
        kept = meter.live
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad, norm.weight.grad, kept))
    (y0, gx0, gw0, kept0), (y1, gx1, gw1, kept1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert kept1 == x0.numel() * 2 and kept0 > kept1  # the bf16 input alone (the weight is a parameter)
    hf_order = (torch.nn.functional.rms_norm(x0.float(), (64,), None, 1e-6).bfloat16() * norm.weight.detach())
    assert torch.equal(y0, hf_order) is (not fused)


def test_mla_cores_agree_and_an_unknown_core_is_refused():
    """The shared MLA with the three core footprints: ``recomputed`` bit-equal to ``eager`` (outputs and
    gradients), ``flash`` equal to rounding (float64)."""
    from mt_dualpipe.layers.mla import MLAttention

    kw = dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
              rope=RopeSpec(10000.0), softmax_scale=12 ** -0.5)
    x0 = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = {}
    for core in ("eager", "recomputed", "flash"):
        torch.manual_seed(0)
        mla = MLAttention(32, 3, core=core, **kw).double()
        x = x0.clone().requires_grad_()
        y = mla(x)
        y.square().sum().backward()
        out[core] = [y.detach(), x.grad] + [p.grad for p in mla.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(out["eager"], out["recomputed"]))
    assert all(relative_error(a, b) < 1e-12 for a, b in zip(out["flash"], out["eager"]))
    with pytest.raises(ValueError, match="core attention must be one of eager, recomputed, flash, got 'sdpa'"):
        MLAttention(32, 3, core="sdpa", **kw)
