"""DeepSeek-V3's declared saved bytes (``Block.saved_per_token``: MLA, the shared ``MoEBlock``, the norms and
SwiGLUs) against what autograd keeps (``SavedActivationMeter``), per memory saver (each alone and all) and per
recompute policy, dense and MoE; and the planner reading them (``spec.planner_spec``)."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.layers import saved_elements_per_token
from mt_dualpipe.layers.savers import MEMORY_SAVERS
from mt_dualpipe.models.deepseek_v3 import Block, DeepSeekV3Config
from mt_dualpipe.models.deepseek_v3.spec import planner_spec
from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute

torch.set_num_threads(1)
B, S = 2, 64
TOLERANCE = 0.10


def config(savers: str) -> DeepSeekV3Config:
    return DeepSeekV3Config.preset("tiny", dim=64, n_heads=4, inter_dim=96, moe_inter_dim=32, q_lora_rank=32,
                                   kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                   n_layers=2, mtp_depth=0, memory_savers=savers)


def measured(cfg: DeepSeekV3Config, index: int, policy: str) -> tuple[float, int]:
    torch.manual_seed(0)
    block = Block(index, cfg)
    apply_recompute(block, policy)
    x = torch.randn(B, S, cfg.dim, requires_grad=True)
    meter = SavedActivationMeter(exclude=list(block.parameters()))
    with meter.measure():
        block(x)
    return saved_elements_per_token(block, policy, S) * B * S * 4, meter.peak


@pytest.mark.parametrize("savers", ["", *MEMORY_SAVERS, "all"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("moe", [False, True])
def test_declared_saved_bytes_are_within_10_percent_of_what_autograd_keeps(savers, policy, moe):
    declared, kept = measured(config(savers), 1 if moe else 0, policy)
    assert abs(declared / kept - 1) < TOLERANCE, (declared, kept)


def test_the_planner_counts_the_blocks_declarations():
    """The spec's saved bytes per layer are the block's declaration (float32, the plan's dtype) times 4 bytes."""
    cfg = config("all")
    spec = planner_spec(cfg)
    for index in (0, 1):
        for policy in ("none", "selective", "full"):
            declared, kept = measured(cfg, index, policy)
            planned = spec.layer_item(index, S, 4.0, policy, elem=4.0).act_bytes * B * S
            assert planned == pytest.approx(declared, rel=1e-9)
            assert abs(planned / kept - 1) < TOLERANCE, (index, policy, planned, kept)
