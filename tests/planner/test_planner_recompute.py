"""Recompute in the planner: saved bytes per policy against what the tiny models really save (measured with
``SavedActivationMeter``), and the recomputed forward charged through ``Costs.recompute``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy, estimate
from mt_dualpipe.planner.estimate import (
    EAGER_CORE_WORK,
    FLASH_BACKWARD,
    mm_seconds,
    overlaps_communication,
    stage_costs,
    stage_items,
)
from mt_dualpipe.schedules import build_schedule
from mt_dualpipe.schedules.errors import ScheduleError
from mt_dualpipe.schedules.simulate import run_schedule

H100 = PRESETS["h100"]


@pytest.mark.parametrize("kind", ["deepseek", "llama"])
def test_saved_bytes_estimate_within_10_percent_per_layer_and_stage(kind):
    torch = pytest.importorskip("torch")
    from tests.helpers.saved_bytes import table

    torch.set_num_threads(1)
    rows = table((kind,))
    pieces = {piece for _, _, piece, *_ in rows}
    assert pieces == ({"stage0", "stage1", "dense", "moe"} if kind == "deepseek" else {"stage0", "stage1", "layer"})
    acts = {}
    for _, policy, piece, peak, params, planned in rows:
        got = peak - params  # weights autograd references (norm weights, a plain head) are not activations
        assert params < 0.3 * peak, (policy, piece, peak, params)
        assert planned == pytest.approx(got, rel=0.10), (policy, piece, got, planned)
        acts[policy, piece] = got
    for piece in pieces:  # each policy really saves less
        assert acts["full", piece] <= acts["selective", piece] < acts["none", piece]


def _items(model, **kw):
    return model.items(4096, 1.0, elem=2.0, **kw)


def test_attention_kind_and_microbatch_change_only_the_core_terms():
    v3 = ModelSpec.load("deepseek-v3")
    h, n, s = v3.hidden_size, v3.head_num, 4096
    eager, fused = _items(v3, recompute="none"), _items(v3, recompute="none", attention="fused")
    # MLA, one sequence: eager keeps S probabilities per head in fp32 and bf16, the bool mask and the
    # whole k_nope|v buffer; fused keeps v alone and one fp32 log-sum-exp per head
    k_nope = n * v3.qk_head_dim * 2
    assert eager[1].act_bytes - fused[1].act_bytes == n * s * (4 + 2) + s + k_nope - n * 4
    two = _items(v3, recompute="none", micro_batch_size=2)
    # mask and RoPE's cos/sin per sequence; v copied out
    assert eager[1].act_bytes - two[1].act_bytes == s / 2 + k_nope + v3.qk_pos_emb_head_dim * 4 / 2
    # selective recomputes q, k, v from the latents: the attention keeps its norm (input, normalised, 1/rms),
    # the down-projections' input, the latents and wo's input in place of q, k, v and the core's tensors; a
    # fused core keeps its log-sum-exp too (and is not re-run), an eager one is re-run whole
    sel_eager, sel = _items(v3, recompute="selective"), _items(v3, recompute="selective", attention="fused")
    assert sel[1].act_bytes - sel_eager[1].act_bytes == n * 4
    assert (sel_eager[1].recompute_attn_flops, sel[1].recompute_attn_flops) == (sel[1].attn_flops, 0.0)
    lin, ql, kvl, rd = 1, v3.q_lora_rank, v3.kv_lora_rank, v3.qk_pos_emb_head_dim  # FP8-cached linear inputs
    wo_input = n * v3.v_head_dim * lin
    # a bf16 model's norms keep a float32 copy of their input, the normalised input (float32) and 1/rms; the
    # FP8 q and kv down-projections each keep their own FP8 copy of the attention norm's output
    kept = 2 * h * 4 + 4 + 2 * h * lin + (ql + kvl + rd) * 2 + wo_input + n * 4
    dqk = v3.qk_head_dim + rd
    projections = (2 * h * 4 + 4 + 2 * h * lin) + (2 * ql * 4 + 4 + ql * lin) + (2 * kvl * 4 + 4 + kvl * lin) \
        + rd * 4  # norms, linear inputs, the kv latent's norm, cos and sin
    core = n * 2 * dqk * 2 + n * v3.v_head_dim * 2 + n * 4  # fused: q, k, v, one log-sum-exp per head
    assert fused[1].act_bytes - sel[1].act_bytes == projections + core + wo_input - kept
    full = _items(v3, recompute="full")
    assert full[1].act_bytes == h * 2  # a dense layer keeps its input only
    with pytest.raises(ScheduleError, match="attention must be one of eager, fused, got 'flash'"):
        _items(v3, recompute="none", attention="flash")


def _costs(model, strategy):
    return stage_costs(model, strategy, H100, stage_items(model, strategy, H100))


def _rates(strategy, model):
    """(matmul, attention) FLOP/s of the strategy's compute: DualPipe with an all-to-all to overlap runs on
    the SMs its communication leaves (``estimate.overlaps_communication``)."""
    share = H100.overlap_share() if overlaps_communication(model, strategy) else 1.0
    mm = H100.mm_rate(strategy.dtype) * share
    attn = H100.tflops_bf16 * 1e12 * H100.attn_efficiency * share
    return mm, attn


@pytest.mark.parametrize("model_name", ["deepseek-v3", "llama"])
def test_recompute_none_keeps_the_time_model_and_others_charge_costs_recompute(model_name):
    if model_name == "llama":
        model = ModelSpec(name="llama", hidden_size=1024, head_num=16, layer_num=8, vocab_size=32000,
                          intermediate_size=2816, kv_head_num=4)
        st = Strategy(4, "zb-h1", 8, seq_len=2048, zero=0, layers_per_stage=(2, 2, 2, 2))
    else:
        model = ModelSpec.load("deepseek-v3")
        st = Strategy(8, "dualpipev", 16, ep=8, dp=8, dtype="fp8")
    mm_rate, attn_rate = _rates(st, model)
    tokens = st.seq_len * st.micro_batch_size
    none = _costs(model, replace(st, recompute="none"))
    stages = stage_items(model, replace(st, recompute="none"), H100)
    # recompute none: F, B, W straight from the FLOPs, nothing recomputed (the figures of before recompute)
    assert none.recompute == 0.0
    share = mm_rate / H100.mm_rate(st.dtype)
    for s, group in enumerate(stages):
        mm = sum(mm_seconds(i, H100, st.dtype) for i in group) * tokens / share  # the head stays BF16 with FP8
        at = sum(i.attn_flops for i in group) * tokens / attn_rate
        mem = sum(i.hbm_bytes for i in group) * tokens / H100.hbm_rate()  # memory-bound, twice in B
        # the strategy's default core is the flash-style one: its backward is FLASH_BACKWARD x its forward
        assert st.attention == "fused"
        assert (none.f[s], none.b[s], none.w[s]) == pytest.approx(
            (mm + at + mem, mm + FLASH_BACKWARD * at + 2 * mem, mm), rel=1e-12)
    # an eager core runs the full S×S products (EAGER_CORE_WORK x the causal FLOPs), twice that in B, and its
    # softmax passes over the scores are memory-bound work (in the eager items' hbm_bytes)
    eager_st = replace(st, recompute="none", attention="eager")
    eager = _costs(model, eager_st)
    for s, group in enumerate(stage_items(model, eager_st, H100)):
        mm = sum(mm_seconds(i, H100, st.dtype) for i in group) * tokens / share
        at = sum(i.attn_flops for i in group) * tokens / attn_rate
        mem = sum(i.hbm_bytes for i in group) * tokens / H100.hbm_rate()
        assert (eager.f[s], eager.b[s]) == pytest.approx(
            (mm + EAGER_CORE_WORK * at + mem, mm + 2 * EAGER_CORE_WORK * at + 2 * mem), rel=1e-12)
    for policy in ("selective", "full"):
        costs = _costs(model, replace(st, recompute=policy))
        assert (costs.f, costs.b, costs.w) == (none.f, none.b, none.w)  # the recompute is not folded into B
        for s, group in enumerate(stages):
            layers = [i for i in group if i.name.startswith("layer")]
            if group[-1].name.startswith("head"):  # the MTP blocks recompute like layers
                layers += [model.layer_item(model.layer_num + d, st.seq_len, 1.0, policy)
                           for d in range(model.mtp_depth)]
            at = sum(i.attn_flops for i in layers) * tokens / attn_rate
            if policy == "full":  # every layer's forward but the router
                router = sum(2 * model.hidden_size * model.expert_num for i in layers if i.moe)
                want = (sum(i.mm_flops for i in layers) - router) * tokens / mm_rate + at
            elif model.attention_type == "mla":  # MLA's up-projections (the fused core is not re-run)
                want = len(layers) * model.selective_mm_flops() * tokens / mm_rate
            else:  # Megatron's selective: the core attention
                want = at
            assert costs.recompute[s] == pytest.approx(want, rel=1e-12), (policy, s)
            assert costs.recompute[s] > 0 or not layers
        sched = build_schedule(st.schedule, st.pp, st.num_microbatches)
        slower = run_schedule(sched, costs, record=False).makespan
        assert slower > run_schedule(sched, none, record=False).makespan


def test_estimate_step_time_grows_by_the_recomputed_forward_only():
    v3 = ModelSpec.load("deepseek-v3")
    big = H100.replace(gpu_memory_gb=1000)
    st = Strategy(8, "dualpipev", 16, ep=8, dp=8, dtype="fp8")
    times = {p: estimate(v3, big, replace(st, recompute=p)).pipeline_time for p in ("none", "selective", "full")}
    assert times["none"] < times["selective"] < times["full"]
    mem = {p: estimate(v3, big, replace(st, recompute=p)).memory_gb["activations"] for p in ("none", "selective",
                                                                                             "full")}
    assert mem["full"] < mem["selective"] < mem["none"]
