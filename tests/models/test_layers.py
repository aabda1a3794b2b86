"""The shared model layer's pieces against transformers (float64) and their declarations."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.integrations.recompute import DeclaresRecompute
from mt_dualpipe.layers import GQAttention, LocalDispatch, RopeSpec, SoftmaxTopKRouter, SwiGLUMLP, cos_sin
from mt_dualpipe.layers import inv_freq as our_inv_freq
from tests.helpers.hf_reference import float64_transformers, relative_error

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
    d = LocalDispatch(5)
    rows, plan = d.dispatch(x, routing)
    assert sum(plan.expert_rows) == 26 and torch.equal(routing.indices.flatten()[plan.pair_of].sort().values,
                                                        routing.indices.flatten()[plan.pair_of])
    outs = torch.cat([e(c) for e, c in zip(experts, rows.split(plan.expert_rows))])
    got = d.combine(outs, routing, plan, 13)
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
