"""DeepSeek-V3 fits where DeepSeek trained it (issue 31): 671B at PP16 DualPipe x EP64 x ZeRO-1 on 2,048 x 80 GB
H800, FP8, selective recompute and the report's activation savers.

The breakdown is checked term by term against formulas stated here from the released config's shapes,
and the stage cut the planner assumes against what ``stages_for_rank`` builds (on the meta device)."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, stage_layer_ids, stages_for_rank
from mt_dualpipe.planner import ModelSpec
from mt_dualpipe.planner.activations import FP8_LIN, memory_savers
from mt_dualpipe.planner.estimate import stage_items
from mt_dualpipe.planner.report import print_plan
from mt_dualpipe.planner.search import plan
from mt_dualpipe.planner.system import load_system
from mt_dualpipe.schedules import build_schedule

PUBLISHED = dict(pp=[16], ep=[64], schedules=("dualpipe",), dtype="fp8", recompute="selective", zero=1)
P, EP, DP, SEQ, M = 16, 64, 128, 4096, 120
# the released 671B shapes
H, V, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, VDIM = 7168, 129280, 128, 1536, 512, 128, 64, 128
DENSE_FFN, MOE_FFN, EXPERTS = 18432, 2048, 256


@pytest.fixture(scope="module")
def published():
    model = ModelSpec.load("deepseek-v3")
    with memory_savers("all"):
        result = plan(model, load_system("h800"), 2048, **PUBLISHED)
        moe_bytes = model.layer_item(10, SEQ, FP8_LIN, "selective", attention="fused").act_bytes
    return model, result, moe_bytes


def test_the_published_layout_fits_and_is_runnable(published):
    _, result, _ = published
    cap = result.system.gpu_memory_gb * result.system.mem_factor  # 80 GB x 0.94 usable
    assert len(result.ranked) == 1 and result.reference is result.ranked[0] and result.reference_rank == 1
    est = result.reference
    assert est.fits and est.runnable and est.total_memory_gb <= cap < 80.0
    assert max(est.per_rank_gb) == est.total_memory_gb
    out = io.StringIO()
    print_plan(result, console=Console(file=out, width=400))
    text = out.getvalue()
    assert "rank 1 of 16 is the fullest" in text and "rank 0 (the embedding's): weights 12.94" in text
    assert "FP8Linear's cached E4M3 weight" in text and "sharded by zero1" in text
    assert "DeepSeek-V3's activation savers attention, combine, loss, mla_input, norm, router, swiglu" in text
    # the miniature's command runs what was counted: the flash-style core and every saver
    from mt_dualpipe.planner.runnable import demo_command

    entry = result.to_dict()["configurations"][0]
    assert entry["launch"]["core_attention"] == "flash"
    assert entry["launch"]["memory_savers"] == "attention,combine,loss,mla_input,norm,router,swiglu"
    assert demo_command(entry["launch"]).endswith(
        "--core-attention flash --memory-savers attention,combine,loss,mla_input,norm,router,swiglu")


def _attention() -> int:
    """MLA: q down + its norm + q up, kv down (latent + rotary key) + its norm + kv up, output, the block's
    input norm (the planner's ``attention_params``)."""
    return (H * Q_LORA + Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + H * (KV_LORA + ROPE) + KV_LORA
            + KV_LORA * HEADS * (NOPE + VDIM) + HEADS * VDIM * H + H)


def _linears_of_attention() -> int:
    return _attention() - (H + Q_LORA + KV_LORA)  # without the three norms


def test_the_breakdown_follows_the_formulas(published):
    """Rank 1 (stages 1 and 14, four MoE blocks each) is the fullest; rank 0 (stages 0 and 15: the embedding,
    three dense blocks and block 3, block 60, the head and the MTP module) holds one embedding for both uses."""
    _, result, moe_bytes = published
    est = result.reference
    assert est.blocks_per_stage == [4] * 15 + [1]
    gb = 1e9
    mlp = lambda ffn: 3 * H * ffn  # noqa: E731  SwiGLU: gate, up, down
    moe_dense = _attention() + mlp(MOE_FFN) + H * EXPERTS + H  # + shared expert, router, post-attention norm
    moe_experts = EXPERTS * mlp(MOE_FFN) / EP
    moe_fp8 = _linears_of_attention() + mlp(MOE_FFN) + moe_experts  # what FP8Linear converts
    dense_block = _attention() + mlp(DENSE_FFN) + H
    dense_fp8 = _linears_of_attention() + mlp(DENSE_FFN)

    def expect(dense, experts, fp8):
        return {"weights": (2 * (dense + experts) + fp8) / gb,    # BF16 + the FP8 copies
                "gradients": 4 * (dense + experts) / gb,          # FP32
                "optimizer": (8 * dense / DP + 8 * experts / (DP // EP)) / gb}  # master + 2 BF16 moments, ZeRO-1

    mem = est.memory_gb
    assert est.memory_rank == 1
    for part, value in expect(8 * moe_dense, 8 * moe_experts, 8 * moe_fp8).items():
        assert mem[part] == pytest.approx(value, rel=1e-9), part
    # DualPipe holds P + 1 micro-batches of a stage at the fullest rank's peak (both stages: 4 MoE blocks)
    assert mem["activations"] == pytest.approx((P + 1) * 4 * moe_bytes * SEQ / gb, rel=1e-9)
    assert mem["total"] == pytest.approx(74.21, abs=0.01)

    mtp = 2 * H * H + 3 * H + moe_dense  # eh_proj, enorm/hnorm/shared_head.norm, the MTP block
    dense0 = V * H + 3 * dense_block + moe_dense + moe_dense + (V * H + H) + mtp  # one embedding, head + final norm
    rank0 = est.rank_memory[0]
    fp8_0 = 3 * dense_fp8 + 3 * moe_fp8 + 2 * H * H  # blocks 0-3, 60 and MTP's, eh_proj (not embedding, head)
    for part, value in expect(dense0, 3 * moe_experts, fp8_0).items():
        assert rank0[part] == pytest.approx(value, rel=1e-9), part
    assert rank0["total"] < mem["total"]


def test_the_planner_cut_is_what_stages_for_rank_builds(published):
    """The planner's blocks per stage equal the runtime's default layout at the run's sequence length, and
    rank 0's modules (on the meta device) hold exactly the parameters the planner counts for it: one
    embedding for the first stage and MTP, the head once."""
    model, result, _ = published
    est = result.reference
    config = DeepSeekV3Config.preset("671b")
    sched = build_schedule("dualpipe", P, M)
    ids = stage_layer_ids(config, P, est.blocks_per_stage)
    with torch.device("meta"):
        mods = stages_for_rank(config, sched, 0, seq_len=SEQ)
    assert [(m.index, [int(i) for i in m.model.layers]) for m in mods] == [(0, ids[0]), (15, ids[15])]
    assert mods[0].model.embed_tokens is mods[1].model.embed_tokens
    held = sum(p.numel() for p in {id(p): p for m in mods for p in m.parameters()}.values())
    stages = stage_items(model, est.strategy, result.system)
    assert held == sum(i.params + i.expert_params for s in (0, 15) for i in stages[s])
