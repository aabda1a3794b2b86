"""DeepSeek-V3 integration, single process: sizes, routing, balancing, MTP, stages, overlapped F&B."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from mt_dualpipe.layers.balance import sequence_balance_loss
from mt_dualpipe.layers.expert_parallel import DEFAULT_TIMEOUT
from mt_dualpipe.layers.moe_state import moe_layers, set_aux_loss_scale, set_timeout, update_expert_bias
from mt_dualpipe.models.deepseek_v3 import (
    DeepSeekV3Config,
    DeepSeekV3Model,
    build_stages,
    dualpipe_stage_ids,
    parse_layout,
    sync_replicas,
    v_stage_ids,
)
from mt_dualpipe.models.deepseek_v3.data import synthetic_batch
from mt_dualpipe.models.deepseek_v3.moe import moe_block, router
from mt_dualpipe.runtime.overlap import run_overlapped

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=3, vocab_size=128, inter_dim=128, moe_inter_dim=32, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


def make_batch(config: DeepSeekV3Config, batch: int = 4, seq: int = 16, seed: int = 0):
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


# ----- configuration and sizes ---------------------------------------------------------------------------
def test_671b_parameter_counts_on_meta_device():
    with torch.device("meta"):
        model = DeepSeekV3Model(DeepSeekV3Config.preset("671b"))
    main, mtp = model.num_parameters("main"), model.num_parameters("mtp")
    assert abs(main - 671e9) / 671e9 < 0.01, main
    assert abs(mtp - 11.6e9) / 11.6e9 < 0.01, mtp
    # 58 MoE layers of 256 routed + 1 shared SwiGLU experts of width 2048, 3 dense layers of width 18432
    layer = model.model.layers["3"]
    assert len(layer.mlp.experts) == 256 and layer.mlp.gate.weight.shape == (256, 7168)
    assert model.model.layers["2"].mlp.gate_proj.weight.shape == (18432, 7168)
    attn = layer.self_attn
    assert attn.q_b_proj.weight.shape == (128 * 192, 1536) and attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 7168)


def test_config_presets_and_errors():
    tiny = DeepSeekV3Config.preset("tiny")
    assert tiny.dim == 256 and tiny.n_dense_layers == 1 and tiny.n_routed_experts == 16
    assert DeepSeekV3Config.preset("671b").qk_head_dim == 192
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 preset 'big'; choose one of"):
        DeepSeekV3Config.preset("big")
    with pytest.raises(ValueError, match="unknown DeepSeekV3Config field"):
        DeepSeekV3Config.preset("tiny", dimm=3)
    with pytest.raises(ValueError, match="must be divisible by n_expert_groups"):
        DeepSeekV3Config.preset("tiny", n_expert_groups=3)


def test_mla_is_causal_with_one_rotary_key_for_all_heads():
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    attn = model.model.layers["0"].self_attn
    # the compressed KV latent plus a single rope key (not one per head)
    assert attn.kv_a_proj_with_mqa.weight.shape == (config.kv_lora_rank + config.qk_rope_head_dim, config.dim)
    assert attn.kv_b_proj.weight.shape == (config.n_heads * (config.qk_nope_head_dim + config.v_head_dim),
                                       config.kv_lora_rank)
    x, _ = make_batch(config)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[:, :10], b[:, :10])  # earlier positions never see a later token
    assert not torch.allclose(a[:, 10:], b[:, 10:])


# ----- routing and balancing -------------------------------------------------------------------------------
def test_gate_group_limited_topk_and_normalised_weights():
    config = small_config()
    torch.manual_seed(1)
    gate = router(config)
    torch.nn.init.normal_(gate.weight, 0, 0.5)
    x = torch.randn(32, config.dim)
    weights, indices, scores = gate(x)
    per_group = config.n_routed_experts // config.n_expert_groups
    groups = indices // per_group
    assert all(len(set(row.tolist())) <= config.n_limited_groups for row in groups)
    torch.testing.assert_close(weights.sum(-1), torch.full((32,), config.route_scale))
    torch.testing.assert_close(weights, scores.gather(1, indices) / scores.gather(1, indices).sum(-1, True) * 2.5)
    # a large bias on one expert makes every token select it, without changing the affinities used as weights
    gate.e_score_correction_bias[5] = 10.0
    weights2, indices2, scores2 = gate(x)
    assert (indices2 == 5).any(-1).all()
    torch.testing.assert_close(scores2, scores)


def test_bias_update_moves_against_the_load():
    model = DeepSeekV3Model(small_config())
    gate = model.model.layers["1"].mlp.gate
    gate.load.copy_(torch.arange(16.0))  # expert 0 idle ... expert 15 busiest; mean 7.5
    update_expert_bias(model, speed=0.01)
    assert (gate.e_score_correction_bias[:8] == 0.01).all() and (gate.e_score_correction_bias[8:] == -0.01).all()
    assert gate.load.sum() == 0
    # the counts come from training forwards (not no-grad evaluation): one per token and selected expert
    x, _ = make_batch(model.config)
    with torch.no_grad():
        model.hidden(x)
    assert gate.load.sum() == 0
    model.hidden(x)
    assert gate.load.sum() == x.numel() * model.config.n_activated_experts


def test_sequence_balance_loss_formula():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5], [0.2, 0.8, 0.5, 0.5]])
    indices = torch.tensor([[0], [1]])
    # one sequence of 2 tokens, top-1 of 4 experts: f = 4/(1*2)·hits, P = mean normalised affinities
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    expected = 2 * p[0] + 2 * p[1]
    torch.testing.assert_close(sequence_balance_loss(scores, indices, batch=1, topk=1), expected)
    # f is counted in the scores' dtype, not the default one: a float64 model's loss is float64 to the last bit
    # (here f = N/(K·T)·hits with N/(K·T) = 4/3, which float32 would round)
    scores64 = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    hits = torch.tensor([[0], [0], [2]])
    p64 = (scores64 / scores64.sum(-1, keepdim=True)).mean(0)
    exact = (4 / 3) * (2 * p64[0] + p64[2])
    got = sequence_balance_loss(scores64, hits, batch=1, topk=1)
    assert got.dtype == torch.float64 and abs(float(got) - float(exact)) < 4e-16


def test_balance_loss_gradient_reaches_the_gate():
    config = small_config(balance_loss_weight=0.5, mtp_depth=0)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    no_aux = copy.deepcopy(model)
    for m in no_aux.modules():
        if hasattr(m, "sequence_balance_coef"):
            m.sequence_balance_coef = 0.0
    x, y = make_batch(config)
    model(x, y).backward()
    no_aux(x, y).backward()
    g, g0 = model.model.layers["1"].mlp.gate.weight.grad, no_aux.model.layers["1"].mlp.gate.weight.grad
    assert not torch.allclose(g, g0)
    torch.testing.assert_close(model.lm_head.weight.grad, no_aux.lm_head.weight.grad)  # value of the loss unchanged


# ----- multi-token prediction ---------------------------------------------------------------------------------
def test_mtp_loss_weighting():
    config = small_config(mtp_depth=2, mtp_loss_weight=0.3)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    x, y = make_batch(config)
    parts = model.losses(model.hidden(x), y)
    assert len(parts.mtp) == 2
    torch.testing.assert_close(parts.total, parts.main + 0.3 / 2 * (parts.mtp[0] + parts.mtp[1]))
    assert math.isclose(float(parts.main.detach()), math.log(config.vocab_size), rel_tol=0.05)
    heavier = DeepSeekV3Model(config.replace(mtp_loss_weight=1.0))
    heavier.load_state_dict(model.state_dict())
    parts1 = heavier.losses(heavier.hidden(x), y)
    torch.testing.assert_close(parts1.total - parts1.main, (parts.total - parts.main) / 0.3)


def test_mtp_depth_one_uses_the_next_token_embedding():
    """Changing the last label changes only MTP (it is embedded for depth 1 and never a main input)."""
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    x, y = make_batch(config)
    y2 = y.clone()
    y2[:, -2] = (y2[:, -2] + 1) % config.vocab_size  # embedded by MTP at position T-2, a main target
    a, b = model.losses(model.hidden(x), y), model.losses(model.hidden(x), y2)
    assert not torch.equal(a.mtp[0], b.mtp[0]) and not torch.equal(a.main, b.main)


# ----- stages -----------------------------------------------------------------------------------------
def test_layouts():
    config = small_config(n_layers=4)
    assert parse_layout(config, 2) == [2, 2]
    assert parse_layout(config, 4) == [1, 1, 1, 1]
    assert parse_layout(config, 2, "Et*3|tmL") == [3, 1]
    assert parse_layout(config, 3, [2, 0, 2]) == [2, 0, 2]
    with pytest.raises(ValueError, match="'E' \\(embedding\\) may only appear in the first stage"):
        parse_layout(config, 2, "t*3|EtmL")
    with pytest.raises(ValueError, match="summing to n_layers = 4"):
        parse_layout(config, 2, [1, 1])
    assert dualpipe_stage_ids(1, 4) == (1, 2) and v_stage_ids(1, 4) == (1, 6)


@pytest.mark.parametrize("savers", ["", "all"], ids=["plain", "memory_savers"])
def test_stages_match_the_full_model(savers):
    config = small_config(memory_savers=savers)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    x, y = make_batch(config)
    ref = model(x, y)
    ref.backward()
    stages = build_stages(config, 3, [1, 1, 1], source=model)
    h, inputs = x, []
    for st in stages[:-1]:
        out = st(h)
        inputs.append(out)
        h = out.detach().requires_grad_()
        inputs.append(h)
    loss = stages[-1].criterion(stages[-1](h), y)
    assert torch.equal(loss, ref)
    loss.backward()
    for i in range(len(inputs) - 1, 0, -2):
        torch.autograd.backward(inputs[i - 1], inputs[i].grad)
    sync_replicas(stages)  # the MTP embedding copy in the last stage
    for st in stages:
        for name, p in st.named_parameters():
            torch.testing.assert_close(p.grad, model.get_parameter(name).grad, rtol=1e-6, atol=1e-7)


# ----- overlapped F&B ---------------------------------------------------------------------------------------
def _grads(modules):
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("savers", ["", "all"], ids=["plain", "memory_savers"])
@pytest.mark.parametrize("last", [True, False])
def test_overlapped_forward_backward_is_bit_identical(last, savers):
    config = small_config(memory_savers=savers)  # the combine saver's row weights cross the two sides
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    x0, y0 = make_batch(config, seed=1)
    x1, y1 = make_batch(config, seed=2)
    results = []
    for overlapped in (False, True):
        first, second = build_stages(config, 2, source=model)
        # micro-batch 1 has gone forward through both stages; its backward runs now on ``module1``
        h1 = first(x1)
        h1_in = h1.detach().requires_grad_()
        out1 = second(h1_in)
        if last:
            loss1, outputs1, grads1 = second.criterion(out1, y1), [], []
        else:
            loss1, outputs1, grads1 = None, [h1], [torch.randn(h1.shape, generator=torch.Generator().manual_seed(3))]
        if overlapped:
            backward = loss1.backward if last else functools.partial(torch.autograd.backward, outputs1, grads1)
            outputs0 = [run_overlapped(functools.partial(first, x0), backward)]
        else:
            outputs0 = [first(x0)]
            if last:
                loss1.backward()
            else:
                torch.autograd.backward(outputs1, grads1)
        extra = h1_in.grad.clone() if last else None
        load = first.model.layers["1"].mlp.gate.load.clone()
        results.append((outputs0[0].detach(), _grads([first, second]), extra, load))
    (o_a, g_a, e_a, l_a), (o_b, g_b, e_b, l_b) = results
    assert torch.equal(o_a, o_b)
    assert g_a.keys() == g_b.keys() and len(g_a) > 10
    for k in g_a:
        assert torch.equal(g_a[k], g_b[k]), k
    if last:
        assert torch.equal(e_a, e_b)
    assert torch.equal(l_a, l_b)


# ----- training -----------------------------------------------------------------------------------------------
def test_loss_falls_over_30_steps_of_the_synthetic_task():
    config = small_config(n_layers=2)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = synthetic_batch(config.vocab_size, 8, 16, gen)
        parts = model.losses(model.hidden(x), y)
        opt.zero_grad()
        parts.total.backward()
        opt.step()
        update_expert_bias(model)
        losses.append(float(parts.main.detach()))
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses  # chance level stays at ln(128)


# ----- routing variants (HF topk_method / scoring_func / norm_topk_prob) -------------------------------------
def test_routing_variants_select_as_their_definitions_say():
    config = small_config(n_routed_experts=8, n_expert_groups=4, n_limited_groups=1, n_activated_experts=2)
    torch.manual_seed(3)
    x = torch.randn(64, config.dim)
    greedy = router(config.replace(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False))
    torch.nn.init.normal_(greedy.weight, 0, 0.5)
    w, idx, scores = greedy(x)
    torch.testing.assert_close(scores, (x @ greedy.weight.T).softmax(-1))
    assert torch.equal(idx.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    torch.testing.assert_close(w, scores.gather(1, idx) * config.route_scale)  # not normalised
    limited = router(config.replace(topk_method="group_limited_greedy"))
    limited.weight.data.copy_(greedy.weight)
    limited.e_score_correction_bias.fill_(5.0)  # ignored: only noaux_tc routes with the correction bias
    _, idx, scores = limited(x)
    best_group = scores.view(64, 4, 2).amax(-1).argmax(-1)  # the group with the best single affinity
    assert torch.equal(idx // 2, best_group[:, None].expand(-1, 2))


# ----- instance state (no module-level switches) ----------------------------------------------------------
def test_aux_loss_scale_and_ep_timeout_are_per_model():
    config = small_config(balance_loss_weight=0.5, mtp_depth=0)
    torch.manual_seed(0)
    a, b = DeepSeekV3Model(config), DeepSeekV3Model(config)
    assert set_aux_loss_scale(a, 0.0) == len(moe_layers(a)) == 2
    assert all(m.aux_loss_scale == 1.0 for m in moe_layers(b))
    b.load_state_dict(a.state_dict())
    x, y = make_batch(config)
    grads = []
    for scale in (0.0, 0.5, 1.0):
        set_aux_loss_scale(a, scale)
        a.zero_grad()
        a(x, y).backward()
        grads.append(a.model.layers["1"].mlp.gate.weight.grad.clone())
    torch.testing.assert_close(grads[2] - grads[0], 2 * (grads[1] - grads[0]))  # linear in the scale
    assert not torch.allclose(grads[2], grads[0])
    assert set_timeout(build_stages(config, 2, source=a), 7.5) == 2
    assert set_timeout(a, 3) == 2 and {m.dispatcher.timeout for m in moe_layers(a)} == {3.0}
    assert {m.dispatcher.timeout for m in moe_layers(b)} == {DEFAULT_TIMEOUT}
    with pytest.raises(ValueError, match="the expert all-to-all timeout must be positive, got 0.0"):
        set_timeout(a, 0)


def test_a_gate_built_on_its_own_is_initialised():
    """moe_block(config) outside the model used to route on torch.empty memory (NaN after reuse)."""

    config = DeepSeekV3Config.preset("tiny")
    for _ in range(3):
        w = moe_block(config).gate.weight.detach()
        assert torch.isfinite(w).all() and w.std() > 0
        assert w.abs().max() <= 1 / config.dim ** 0.5  # nn.Linear's default bound


def test_mtp_shares_the_embedding_on_the_rank_that_holds_first_and_last_stage():
    """DualPipeV puts stage 0 (the embedding) and stage 2P-1 (MTP's embedding input) on rank 0: one
    ``nn.Embedding`` there, whose gradient is the sum of both uses (= the single model's); rank 1 holds
    none; with ``share_embedding=False`` the copies stay separate (tied by the runtime)."""
    from mt_dualpipe.models.deepseek_v3 import stages_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    config = small_config(balance_loss_weight=0.0)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    sched = build_schedule("dualpipev", 2, 4)
    rank0 = stages_for_rank(config, sched, 0, source=model)
    rank1 = stages_for_rank(config, sched, 1, source=model)
    assert [st.index for st in rank0] == [0, 3] and rank0[0].model.embed_tokens is rank0[1].model.embed_tokens
    assert sum(p.numel() for p in {id(p): p for st in rank0 for p in st.parameters()}.values()) < \
        sum(p.numel() for st in stages_for_rank(config, sched, 0, source=model, share_embedding=False)
            for p in st.parameters())
    by_index = {st.index: st for st in rank0 + rank1}
    x, y = make_batch(config, 2, 16)
    model(x, y).backward()
    uses = []  # (token ids, output) of each call of the one embedding: stage 0's lookup, then MTP's

    def keep(_module, args, out):
        out.retain_grad()
        uses.append((args[0], out))

    hook = rank0[0].model.embed_tokens.register_forward_hook(keep)
    h = x
    for i in range(4):
        h = by_index[i](h)
    by_index[3].criterion(h, y).backward()
    hook.remove()
    embed = rank0[0].model.embed_tokens.weight
    # both stages name it, as one Parameter object
    holders = [p is embed for st in rank0 for n, p in st.named_parameters() if n == "model.embed_tokens.weight"]
    assert holders == [True, True]
    torch.testing.assert_close(embed.grad, model.model.embed_tokens.weight.grad, rtol=1e-5, atol=1e-7)
    # the one gradient is the sum of both uses' scatter-adds, and each use contributes
    per_use = [torch.zeros_like(embed).index_add_(0, ids.flatten(), out.grad.flatten(0, 1)) for ids, out in uses]
    assert len(per_use) == 2 and all(g.abs().sum() > 0 for g in per_use)
    torch.testing.assert_close(embed.grad, per_use[0] + per_use[1], rtol=1e-6, atol=1e-8)
