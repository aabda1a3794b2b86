"""The planner's bundled models equal what the families' own configs describe."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig
from mt_dualpipe.models.qwen3_moe.spec import planner_spec
from mt_dualpipe.planner.model import ModelSpec


def test_bundled_qwen3_30b_a3b_is_the_family_presets_spec():
    bundled = ModelSpec.load("qwen3-30b-a3b")
    derived = planner_spec(Qwen3MoeConfig.preset("30b-a3b"))
    skip = {"name", "source", "training", "declared_saved"}  # the JSON has no modules to read declarations from
    assert {f.name: getattr(bundled, f.name) for f in dataclasses.fields(ModelSpec) if f.name not in skip} == \
        {f.name: getattr(derived, f.name) for f in dataclasses.fields(ModelSpec) if f.name not in skip}
    assert abs(bundled.total_params() / 1e9 - 30.53) < 0.01  # Qwen3-30B-A3B: 30.5 B parameters


def test_plan_takes_the_qwen3_moe_model():
    out = subprocess.run([sys.executable, "-m", "mt_dualpipe", "plan", "--model", "qwen3-30b-a3b", "--gpus", "64",
                          "--pp", "4", "--ep", "8", "--schedules", "dualpipev", "--seq-len", "4096",
                          "--global-batch", "512"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "qwen3_30b_a3b" in out.stdout or "qwen3-30b-a3b" in out.stdout, out.stdout[-2000:]
