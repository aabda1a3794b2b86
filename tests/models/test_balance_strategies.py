"""Expert-balancing strategies: each formula on a hand-computed example, the routing limits and the
capacity dropping on exact cases, and the MoE layer wired to them (single process and 2 EP ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.layers.balance import (
    STRATEGIES,
    batch_balance_loss,
    bias_update,
    capacity_keep,
    device_limited_mask,
    expert_capacity,
    sequence_balance_loss,
    strategy_overrides,
)
from mt_dualpipe.layers.moe_state import dropped_fraction, update_expert_bias
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3.moe import moe_block
from tests.helpers.dist import run_ranks

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=32, n_layers=2, vocab_size=64, inter_dim=64, moe_inter_dim=16, max_seq_len=32, mtp_depth=0)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


# ----- formulas ---------------------------------------------------------------------------------------------
def test_bias_update_moves_by_gamma_towards_the_mean():
    bias = torch.zeros(4)
    bias_update(bias, torch.tensor([3.0, 1.0, 2.0, 2.0]), 0.1)  # mean 2: sign(2 - load) = (-1, 1, 0, 0)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])


def test_update_expert_bias_uses_the_configured_gamma_and_zero_disables_it():
    for gamma, expected in ((0.5, [-0.5, 0.5]), (0.0, [0.0, 0.0])):
        moe = moe_block(small_config(n_routed_experts=2, n_expert_groups=1, n_limited_groups=1, n_activated_experts=1,
                               bias_update_speed=gamma))
        moe.gate.load.copy_(torch.tensor([5.0, 1.0]))
        update_expert_bias(moe)
        assert moe.gate.e_score_correction_bias.tolist() == expected
        assert moe.gate.load.tolist() == [0.0, 0.0]


def test_sequence_balance_loss_per_sequence():
    # Two sequences of 2 tokens, 2 experts, k=1. Seq 0: s'=[[.75,.25],[.5,.5]] -> P=[.625,.375], both pick
    # expert 0 -> f=[2,0] -> 1.25. Seq 1: s'=[[.5,.5],[.5,.5]], picks (0,1) -> f=[1,1] -> 1.0. Mean 1.125.
    scores = torch.tensor([[0.6, 0.2], [0.3, 0.3], [0.4, 0.4], [0.1, 0.1]])
    indices = torch.tensor([[0], [0], [0], [1]])
    assert float(sequence_balance_loss(scores, indices, batch=2, topk=1)) == pytest.approx(1.125)


def test_batch_balance_loss_single_rank():
    # Whole batch: s' mean P = [(.75+.5+.5+.5)/4, (.25+.5+.5+.5)/4] = [.5625, .4375]; loads (3, 1) with
    # T=4, K=1, N=2 -> f = 2/4·(3, 1) = (1.5, 0.5) -> 1.5·.5625 + .5·.4375 = 1.0625.
    scores = torch.tensor([[0.6, 0.2], [0.3, 0.3], [0.4, 0.4], [0.1, 0.1]])
    indices = torch.tensor([[0], [0], [0], [1]])
    assert float(batch_balance_loss(scores, indices, topk=1)) == pytest.approx(1.0625)


def test_device_limited_mask_hand_example():
    # 8 experts on 4 devices, k=4, M=2: a device scores the sum of its ceil(4/2)=2 best -> (1.0, .9, 1.1, .4);
    # devices 2 and 0 win. The plain top-4 (experts 0, 4, 2, 3) would span three devices.
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.4, 0.8, 0.3, 0.2, 0.2]])
    mask = device_limited_mask(choice, n_devices=4, limit=2, topk=4)
    assert mask.tolist() == [[True, True, False, False, True, True, False, False]]


def test_device_limited_routing_never_exceeds_m_devices():
    config = small_config(n_routed_experts=16, n_expert_groups=4, n_limited_groups=2, n_activated_experts=6,
                          device_groups=4, device_limit=2)
    moe = moe_block(config)
    torch.nn.init.normal_(moe.gate.weight, 0, 1.0)
    moe.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(512, config.dim, generator=torch.Generator().manual_seed(0))
    _, indices, _ = moe.gate(x)
    devices = indices // (config.n_routed_experts // config.device_groups)
    per_token = torch.tensor([len(set(row)) for row in devices.tolist()])
    assert int(per_token.max()) == 2 and int(per_token.min()) >= 1
    assert indices.unique(dim=1).size(1) == 6  # still k distinct experts per token
    free = moe_block(config.replace(device_limit=0, n_expert_groups=1, n_limited_groups=1))
    free.load_state_dict(moe.state_dict())
    free_devices = free.gate(x)[1] // 4
    assert max(len(set(row)) for row in free_devices.tolist()) > 2  # the limit is what confines them


def test_capacity_keeps_exactly_the_first_pairs_in_position_priority():
    # T=4, K=2, N=2, cf=.5 -> C = ceil(.5·4·2/2) = 2. k-major order: (0,0)e0 (1,0)e0 (2,0)e0 (3,0)e1
    # (0,1)e1 (1,1)e1 (2,1)e1 (3,1)e0. Expert 0 keeps (0,0),(1,0); expert 1 keeps (3,0),(0,1).
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    weights = torch.ones(4, 2)
    assert expert_capacity(4, 2, 2, 0.5) == 2
    keep = capacity_keep(indices, weights, 2, 0.5, "position")
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert capacity_keep(indices, weights, 2, 0.0).all()


def test_capacity_score_priority_serves_the_heaviest_gate_weights():
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    weights = torch.tensor([[0.1, 0.2], [0.9, 0.3], [0.5, 0.8], [0.4, 0.7]])
    # Expert 0 pairs: (0,0).1 (1,0).9 (2,0).5 (3,1).7 -> keeps .9, .7; expert 1: (0,1).2 (1,1).3 (2,1).8
    # (3,0).4 -> keeps .8, .4.
    keep = capacity_keep(indices, weights, 2, 0.5, "score")
    assert keep.tolist() == [[False, False], [True, False], [False, True], [True, True]]
    with pytest.raises(ValueError, match="capacity priority 'first' is not supported; choose one of"):
        capacity_keep(indices, weights, 2, 0.5, "first")


def test_moe_with_dropping_zeroes_exactly_the_dropped_pairs_and_counts_them():
    config = small_config(capacity_factor=0.5)
    torch.manual_seed(0)
    moe = moe_block(config).train()
    x = torch.randn(2, 8, config.dim, generator=torch.Generator().manual_seed(3))
    y = moe(x)
    flat = x.flatten(0, 1)
    with torch.no_grad():
        weights, indices, _ = moe.eval().gate(flat)
        keep = capacity_keep(indices, weights, config.n_routed_experts, 0.5)
        expected = moe.shared_experts(flat)
        for t in range(flat.size(0)):
            for j in range(config.n_activated_experts):
                if keep[t, j]:
                    expert = moe.experts[str(int(indices[t, j]))]
                    expected[t] = expected[t] + weights[t, j] * expert(flat[t:t + 1])[0]
    torch.testing.assert_close(y.flatten(0, 1), expected, rtol=1e-5, atol=1e-6)
    dropped, routed = dropped_fraction(moe)
    assert (dropped, routed) == (int((~keep).sum()), keep.numel()) and dropped > 0
    assert dropped_fraction(moe) == (0, 0)  # reset
    y.sum().backward()  # the dropped pairs' rows never reach an expert, the graph still backpropagates
    assert moe.gate.weight.grad is not None


def test_strategies_are_valid_configs_and_unknown_names_are_refused():
    base = DeepSeekV3Config.preset("tiny")
    for name in STRATEGIES:
        assert base.with_balance(name).bias_update_speed == strategy_overrides(name)["bias_update_speed"]
    with pytest.raises(ValueError, match="unknown expert-balancing strategy 'lossless'; choose one of"):
        base.with_balance("lossless")
    with pytest.raises(ValueError, match=r"device_limit must be in 0..device_groups \(4\), got 5"):
        base.replace(device_groups=4, device_limit=5)
    with pytest.raises(ValueError, match="capacity_factor must be >= 0"):
        base.replace(capacity_factor=-1.0)


def test_every_strategy_trains_the_model_one_step():
    for name in STRATEGIES:
        config = small_config().with_balance(name)
        torch.manual_seed(0)
        model = DeepSeekV3Model(config)
        tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert torch.isfinite(loss) and model.model.layers["1"].mlp.gate.weight.grad.abs().sum() > 0, name


# ----- 2 EP ranks -------------------------------------------------------------------------------------------
def _ep_worker(rank, world):
    # batch-wise loss over both ranks: rank 0 routes its 2 tokens to expert 0, rank 1 to expert 1, so the
    # global f = (1, 1) and each rank's loss is Σ P = 1 (a rank-local f = (2, 0) would give 2·P_0 != 1).
    scores = torch.tensor([[0.6, 0.2], [0.3, 0.3]]) if rank == 0 else torch.tensor([[0.2, 0.6], [0.1, 0.3]])
    indices = torch.full((2, 1), rank)
    glob = float(batch_balance_loss(scores, indices, topk=1, group=dist.group.WORLD))
    local = float(batch_balance_loss(scores, indices, topk=1))
    # Device-limited routing with the devices = the EP ranks and M = 1: every token's rows go to one rank.
    config = small_config(device_groups=2, device_limit=1, capacity_factor=0.75)
    torch.manual_seed(0)
    full = moe_block(config)
    torch.nn.init.normal_(full.gate.weight, 0, 1.0)
    shard = moe_block(config, ep_group=dist.group.WORLD)
    shard.load_state_dict({k: v for k, v in full.state_dict().items() if k in shard.state_dict()})
    x = torch.randn(2 * world, 8, config.dim, generator=torch.Generator().manual_seed(1))
    rows = slice(2 * rank, 2 * rank + 2)
    indices = shard.gate(x[rows].flatten(0, 1)).indices
    ranks_per_token = max(len(set((row // (config.n_routed_experts // world)).tolist())) for row in indices)
    y = shard(x[rows])
    dropped, routed = dropped_fraction(shard)
    y_ref = torch.cat([full(x[slice(2 * r, 2 * r + 2)]) for r in range(world)])  # capacity is per rank's batch
    torch.testing.assert_close(y, y_ref[rows], rtol=1e-5, atol=1e-6)  # experts batch both ranks: GEMM order
    return glob, local, ranks_per_token, routed - dropped


def test_batch_loss_is_global_and_device_limit_holds_over_two_ep_ranks():
    results = run_ranks(_ep_worker, 2, timeout=180)
    for glob, local, ranks_per_token, _ in results:
        assert glob == pytest.approx(1.0) and local != pytest.approx(1.0)
        assert ranks_per_token == 1
    assert all(sent < 16 * 4 for *_, sent in results)  # capacity .75 dropped some pairs before the dispatch
