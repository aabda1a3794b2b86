"""The planner's saved bytes per token of a DeepSeek-V3 dense and MoE layer in a bf16 model, with FP8
linears (``fp8=True``: ``FP8Linear`` keeps an E4M3 copy of its input plus 1x128-tile scales) and without,
against what the runtime's modules hand autograd (``SavedActivationMeter``), for every recompute policy.

Dimensions are multiples of 128 (as DeepSeek-V3's are), so the FP8 tiles are whole. Parameters and each
``FP8Linear``'s cached FP8 weight (one per weight version, shared by all micro-batches: weight memory)
are excluded from the meter, as the planner excludes them from activations."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.fp8.linear import FP8Linear
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages
from mt_dualpipe.models.recompute import POLICIES, SavedActivationMeter
from mt_dualpipe.planner import ModelSpec
from mt_dualpipe.planner.activations import FP8_LIN

SEQ = 32
CFG = DeepSeekV3Config.preset("tiny", dim=128, n_layers=2, vocab_size=64, inter_dim=256, moe_inter_dim=128,
                              q_lora_rank=128, kv_lora_rank=128, max_seq_len=64, mtp_depth=0)


def _fp8_weight_copies(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in layer.modules() if isinstance(m, FP8Linear)
            for t in (m.quantized_weight().data, m.quantized_weight().scale)]


def _measured(policy: str, fp8: bool) -> list[float]:
    """Saved bytes per token of layer 0 (dense) and layer 1 (MoE), one sequence of SEQ tokens."""
    torch.manual_seed(0)
    stage = build_stages(CFG, 1, source=DeepSeekV3Model(CFG), fp8=fp8, recompute=policy)[0].to(torch.bfloat16)
    out = []
    for layer in stage.model.layers.values():
        x = torch.randn(1, SEQ, CFG.dim, dtype=torch.bfloat16, requires_grad=True)
        meter = SavedActivationMeter(exclude=list(layer.parameters()) + _fp8_weight_copies(layer))
        with meter.measure():
            layer(x)
        out.append(meter.peak / SEQ)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_planner_layer_bytes_match_the_runtime_with_and_without_fp8_caching(fp8):
    spec = ModelSpec.from_deepseek_config(CFG)
    for policy in POLICIES:
        items = spec.items(SEQ, act_unit=FP8_LIN if fp8 else 2.0, recompute=policy, elem=2.0, attention="eager")
        got = _measured(policy, fp8)
        for item, measured in zip(items[1:3], got):
            assert item.act_bytes == pytest.approx(measured, rel=0.01), (policy, item.name, item.act_bytes, measured)
    if fp8:  # FP8 caching saves what it claims: the MoE layer keeps fewer bytes than in bf16 (recompute none)
        assert _measured("none", True)[1] < _measured("none", False)[1]
