"""examples/torchtitan_style.py: Llama under ZB-V on a user's (pp, dp_shard) DeviceMesh with FSDP2, per-block
activation checkpointing and per-block torch.compile (aot_eager here: the same AOTAutograd graphs as inductor,
compiled in seconds), 4 gloo ranks; the per-step loss equals a single-process run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchtitan_style.py"


def test_pipeline_loss_equals_one_process_with_ac_compile_and_fsdp(tmp_path):
    summary = tmp_path / "s.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", "2", "--backend", "aot_eager", "--summary", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(summary.read_text())
    assert data["compile"] == "aot_eager" and (data["pp"], data["dp"], data["schedule"]) == (2, 2, "zbv")
    pipeline, reference = data["pipeline"], data["single_process"]
    assert len(pipeline) == len(reference) == 2
    for a, b in zip(pipeline, reference):
        assert abs(a - b) <= 1e-5 * abs(b), (pipeline, reference)
    assert pipeline[0] != pipeline[1]  # the optimizer stepped: the second step is a different model
    assert len(data["w_closures"]) == 4 and all(n > 0 for n in data["w_closures"])  # W ran the weight GEMMs
    assert "largest relative difference" in done.stdout
