"""examples/vlm_pipeline.py: a tiny LLaVA trained from generated images and captions under ZB-V on 2 gloo
ranks, read per stage from a Hugging Face checkpoint and saved back; the loss falls and the saved
checkpoint (transformers 5's layout) loads whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mt_dualpipe.models.hf_checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "vlm_pipeline.py"


def test_vlm_pipeline_trains_from_images_and_saves_back(tmp_path):
    summary = tmp_path / "s.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", "4", "--out", str(tmp_path), "--summary", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(summary.read_text())
    losses = data["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert data["reloaded_loss"] < losses[0]
    assert len(list(Path(data["data"]).glob("*.png"))) == len(list(Path(data["data"]).glob("*.txt"))) > 0
    names = Checkpoint(data["trained"]).names()
    assert sorted(names) == sorted(Checkpoint(data["init"]).names())
    assert any(n.startswith("model.vision_tower.") for n in names) and "lm_head.weight" in names
    assert "step 3: loss" in done.stdout and "reloaded" in done.stdout
