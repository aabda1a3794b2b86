"""The planner takes a family's own Hugging Face ``config.json`` as shipped, through the one family registry: the
keys that shape the model are read, the others ignored and named; Qwen3-235B-A22B on 512 H800 gets a layout the
runtime can launch that fits in 80 GB; the savers of the config are counted from the modules' declarations."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mt_dualpipe.models import FAMILIES, planner_model, planner_names
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig
from mt_dualpipe.models.qwen3_moe.spec import planner_spec
from mt_dualpipe.planner import plan
from mt_dualpipe.planner.system import load_system
from tests.helpers.family_configs import QWEN3_235B


def _write(tmp_path, data: dict):
    folder = tmp_path / "Qwen3-235B-A22B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def test_a_config_json_is_read_by_its_family_and_the_plan_names_what_it_ignored(tmp_path):
    folder = _write(tmp_path, QWEN3_235B)
    got = planner_model(str(folder))
    want = planner_spec(Qwen3MoeConfig.from_hf(QWEN3_235B))
    assert got.spec.name == "Qwen3-235B-A22B" and got.spec.source == "config.json via Qwen3MoeConfig"
    sizes = ("hidden_size", "head_num", "layer_num", "vocab_size", "expert_num", "topk", "moe_ffn_hidden_size",
             "kv_head_num", "head_size", "dense_layers")
    assert {k: getattr(got.spec, k) for k in sizes} == {k: getattr(want, k) for k in sizes}
    assert (got.spec.layer_num, got.spec.expert_num, got.spec.topk, got.spec.dense_layers) == (94, 128, 8, 0)
    read = sorted(k for k in QWEN3_235B if k in FAMILIES["qwen3_moe"].cost_keys)
    ignored = sorted(set(QWEN3_235B) - set(read))
    assert "architectures" in ignored and "rms_norm_eps" in ignored and "rope_theta" in ignored
    assert f"the plan's model is built from {', '.join(k for k in QWEN3_235B if k in read)}" in got.note
    assert f"ignored (no effect on the plan's cost): {', '.join(k for k in QWEN3_235B if k in ignored)}" in got.note
    assert planner_model(str(folder / "config.json")).spec.name == "Qwen3-235B-A22B"  # the file as well as its folder


def test_a_config_json_of_an_unknown_family_or_an_unsupported_value_is_refused(tmp_path):
    folder = _write(tmp_path, {**QWEN3_235B, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; registered: \["):
        planner_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**QWEN3_235B, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported for Qwen3-MoE"):
        planner_model(str(folder))
    assert planner_model("no-such-model") is None  # the caller then tries a bundled or SimuMax JSON


def test_preset_names_come_from_the_one_registry():
    assert planner_names() == ["qwen3-moe", "qwen3-30b-a3b", "llama3-8b", "llama-3.1-8b"]
    assert planner_model("QWEN3-MOE").spec.name == "qwen3_30b_a3b"


def test_the_savers_of_a_family_are_counted_from_its_declarations(tmp_path):
    folder = _write(tmp_path, QWEN3_235B)
    plain, saved = (planner_model(str(folder), savers).spec for savers in ("none", "all"))
    for kind in ("moe",):
        for policy in ("none", "selective"):
            assert saved.declared_saved(kind, policy, 4096) < plain.declared_saved(kind, policy, 4096)
    # each saver's own change is what the modules declare: silu(gate) per routed row (the product stays: it is
    # the down-projection's input)
    swiglu = planner_model(str(folder), "swiglu").spec
    rows = QWEN3_235B["num_experts_per_tok"] * QWEN3_235B["moe_intermediate_size"]
    assert plain.declared_saved("moe", "none", 4096) - swiglu.declared_saved("moe", "none", 4096) == rows


def test_qwen3_235b_on_512_h800_fits_80_gb_in_a_layout_the_runtime_launches(tmp_path):
    """The issue's case: 94 layers, 128 experts, top-8; 4,096 tokens, 1,024 sequences a step; 512 H800. Selective
    recompute does not fit (the S x S-free flash core still keeps every layer's projections); full recompute
    does, at pp 16 with expert parallelism, in a layout the runtime runs (tp 1)."""
    spec = planner_model(str(_write(tmp_path, QWEN3_235B))).spec
    h800 = load_system("h800")
    result = plan(spec, h800, 512, 1024, seq_len=4096, recompute="full", runnable_only=True, pp=[16])
    best = result.ranked[0]
    assert best.runnable and best.fits and best.memory_gb["total"] <= h800.gpu_memory_gb
    assert (best.strategy.pp, best.strategy.tp, best.strategy.recompute) == (16, 1, "full")
    strategy = best.strategy
    assert strategy.ep > 1 and strategy.pp * strategy.dp == 512 and strategy.dp % strategy.ep == 0
    selective = plan(dataclasses.replace(spec), h800, 512, 1024, seq_len=4096, recompute="selective", pp=[16])
    assert not selective.ranked
