"""Megatron-LM's GPT layer as the planner counts it (``planner/megatron_layer.py``), the GeLU MLP and the eager
core's costs, and the Zero Bubble runs asked as the paper's code ran them (issue 31)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy
from mt_dualpipe.planner.activations import Dtypes, dense_ffn_saved, eager_score_bytes, gelu, rms_norm, swiglu
from mt_dualpipe.planner.calibration import calibrate, load_runs, run_model, run_strategy
from mt_dualpipe.planner.estimate import EAGER_CORE_WORK, FLASH_BACKWARD, core_work, item_time
from mt_dualpipe.planner.megatron_layer import SCORE_BYTES, megatron_gpt, saved_bytes_per_token, with_implementation
from mt_dualpipe.planner.model import memory_bound_bytes
from mt_dualpipe.schedules.errors import ScheduleError

DOC = load_runs()
ZB_MODELS = [name for name in DOC["models"] if name.startswith("zb-")]


@pytest.fixture
def gpt() -> ModelSpec:
    return ModelSpec(name="gpt", hidden_size=2304, head_num=24, layer_num=22, vocab_size=32000,
                     intermediate_size=4 * 2304, use_swiglu=False)


@pytest.mark.parametrize("name", ZB_MODELS)
def test_megatron_layer_keeps_korthikanti_34sbh_plus_5as2b(name):
    """Korthikanti et al. 2022, section 4.1: 34 s b h + 5 a s^2 b bytes per layer; selective keeps 34 s b h,
    full the layer's input 2 s b h."""
    spec = run_model(name, DOC["models"])
    h, a, s = spec.hidden_size, spec.head_num, 1024
    assert spec.intermediate_size == 4 * h
    assert saved_bytes_per_token(spec, "none", s) == 34 * h + 5 * a * s
    assert saved_bytes_per_token(spec, "selective", s) == 34 * h
    assert saved_bytes_per_token(spec, "full", s) == 2 * h
    layer = spec.layer_item(3, s, 2.0, "none", 2.0, 6, "eager")  # the planner reads the account in bytes
    assert layer.act_bytes == 34 * h + 5 * a * s
    assert spec.score_bytes == SCORE_BYTES == 9.0  # fused softmax r/w 2+2, dropout r/w 2+2 and a 1-byte mask


def test_megatron_layer_refuses_what_it_does_not_describe(gpt):
    with pytest.raises(ScheduleError, match="GPT layer.*use_swiglu false"):
        megatron_gpt(replace(gpt, use_swiglu=True))
    with pytest.raises(ScheduleError, match="GPT layer"):
        megatron_gpt(replace(gpt, expert_num=8, topk=2, moe_ffn_hidden_size=512))
    with pytest.raises(ScheduleError, match="unknown implementation 'deepspeed'; choose from mt_dualpipe, megatron-lm"):
        with_implementation(gpt, "deepspeed")
    assert with_implementation(gpt, "mt_dualpipe") is gpt


def test_gelu_mlp_keeps_two_tensors_and_moves_two_passes(gpt):
    t = Dtypes(elem=2.0, lin=2.0)
    h, ffn = gpt.hidden_size, gpt.intermediate_size
    assert gelu(ffn, t) == 2 * ffn * 2.0
    assert swiglu(ffn, t) == 4 * ffn * 2.0  # gate, up, silu(gate), the down-projection's input
    assert dense_ffn_saved(h, ffn, t, "none", False, gated=False) == rms_norm(h, t) + h * 2.0 + gelu(ffn, t)
    assert memory_bound_bytes(h, 0, ffn, 0, 2.0, False, gated=False) == (10 * h + 2 * ffn) * 2.0
    assert memory_bound_bytes(h, 0, ffn, 0, 2.0, False) == (10 * h + 3 * ffn) * 2.0


def test_eager_core_runs_the_full_products_and_pays_its_softmax_passes(gpt):
    s = 1024
    fused = gpt.layer_item(0, s, 2.0, "none", 2.0, 1, "fused")
    eager = gpt.layer_item(0, s, 2.0, "none", 2.0, 1, "eager")
    assert eager.attn_flops == fused.attn_flops == gpt.head_num * s * 2 * (gpt.hidden_size // gpt.head_num)
    # this library's eager core: scale, masked_fill, softmax into float32 and the cast back, per score element
    t = Dtypes(elem=2.0, lin=2.0, comp=4.0)
    assert eager_score_bytes(t) == 2 * 2 + 2 * 2 + (2 + 4) + (4 + 2) == 20.0
    assert eager_score_bytes(Dtypes(elem=4.0, lin=4.0, comp=4.0)) == 8 + 8 + 8  # float32: no cast
    assert eager.hbm_bytes - fused.hbm_bytes == gpt.head_num * s * 20.0
    assert core_work("fused") == (1.0, FLASH_BACKWARD) and core_work("eager") == (2.0, 4.0) == (
        EAGER_CORE_WORK, 2 * EAGER_CORE_WORK)
    a100 = PRESETS["a100"]
    rate = a100.tflops_bf16 * 1e12 * a100.attn_efficiency
    assert item_time(eager, s, a100, "bf16", attention="eager") - item_time(eager, s, a100, "bf16") == \
        pytest.approx(s * eager.attn_flops / rate, rel=1e-12)


def test_zero_bubble_runs_are_asked_as_the_papers_code_ran_them():
    """First and last stage one layer fewer (the fork's padding), unfused core attention, Megatron's layer."""
    for run in DOC["runs"]:
        if not run["name"].startswith("Zero Bubble"):
            continue
        st = run_strategy(run)
        k = st.layers_per_stage[1]
        assert st.layers_per_stage == (k - 1,) + (k,) * (st.pp - 2) + (k - 1,)
        assert sum(st.layers_per_stage) == DOC["models"][run["model"]]["layer_num"]
        assert st.attention == "eager" and DOC["models"][run["model"]]["implementation"] == "megatron-lm"


def test_zero_bubble_rows_agree_on_time_and_memory_at_every_size():
    """Every Zero Bubble row within 15 % on step time and memory, and no trend with the model's size: the
    1.5B rows (hidden 2,304) land as the 28.3B rows do."""
    rows = {r.name: r for r in calibrate() if r.name.startswith("Zero Bubble")}
    assert len(rows) == 24
    for row in rows.values():
        assert 0.85 <= row.ratio <= 1.15 and 0.85 <= row.memory_ratio <= 1.15, row.name
    small = [r.ratio for n, r in rows.items() if "1.5B" in n]
    large = [r.ratio for n, r in rows.items() if "28.3B" in n]
    assert abs(sum(small) / len(small) - sum(large) / len(large)) < 0.05


def test_plain_strategy_default_is_unchanged():
    """Nothing about a run that names no implementation changes: this library's modules are described."""
    spec = run_model("llama3-405b", DOC["models"])
    assert spec.declared_saved is None and spec.score_bytes is None
    assert Strategy(2, "1f1b", 4).attention == "fused"
