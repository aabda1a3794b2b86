"""The planner's bundled models equal what the families' own configs describe."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from mt_dualpipe.models import planner_model
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig
from mt_dualpipe.models.qwen3_moe.spec import declared_saved, planner_spec
from mt_dualpipe.planner.model import ModelSpec


def test_bundled_qwen3_30b_a3b_is_the_family_presets_spec():
    bundled = ModelSpec.load("qwen3-30b-a3b")
    derived = planner_spec(Qwen3MoeConfig.preset("30b-a3b"))
    # the JSON has no modules to read declarations from
    skip = {"name", "source", "training", "declared_saved", "declared_head", "score_bytes"}
    assert {f.name: getattr(bundled, f.name) for f in dataclasses.fields(ModelSpec) if f.name not in skip} == \
        {f.name: getattr(derived, f.name) for f in dataclasses.fields(ModelSpec) if f.name not in skip}
    assert abs(bundled.total_params() / 1e9 - 30.53) < 0.01  # Qwen3-30B-A3B: 30.5 B parameters


def test_plan_takes_the_qwen3_moe_model_from_the_family():
    """``plan --model qwen3-moe`` plans the family preset's ``planner_spec`` (saved bytes declared by the
    modules), not the bundled JSON."""
    out = subprocess.run([sys.executable, "-m", "mt_dualpipe", "plan", "--model", "qwen3-moe", "--gpus", "64",
                          "--pp", "4", "--ep", "8", "--schedules", "dualpipev", "--seq-len", "4096",
                          "--global-batch", "512"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "qwen3_30b_a3b (mt_dualpipe.models.qwen3_moe preset '30b-a3b', declared saved bytes" in out.stdout, \
        out.stdout[-2000:]


def test_family_planner_models_read_the_declarations():
    spec = planner_model("qwen3-30b-a3b").spec
    assert planner_model("Qwen3-MoE").spec == spec and planner_model("deepseek-v3") is None
    config = Qwen3MoeConfig.preset("30b-a3b")
    assert spec.total_params() == planner_spec(config).total_params()
    declared = declared_saved(config)
    for policy in ("none", "selective", "full"):  # the layer's saved bytes are the declaration's, in the model dtype
        assert spec.layer_item(0, 4096, 2.0, policy).act_bytes == declared("moe", policy, 4096) * 2.0
