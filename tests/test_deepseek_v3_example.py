"""The DeepSeek-V3 example end to end: a short run spawns its ranks, trains and writes the summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_example_writes_summary_and_timeline(tmp_path):
    summary, timeline = tmp_path / "summary.json", tmp_path / "timeline.json"
    cmd = [sys.executable, str(ROOT / "examples" / "deepseek_v3_repro.py"), "--ranks", "2", "--steps", "3",
           "--micro-batch-size", "1", "--seq-len", "16", "--no-progress", "--summary", str(summary),
           "--timeline", str(timeline)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(summary.read_text())
    assert data["schedule"] == "dualpipe" and data["ranks"] == 2 and data["microbatches"] == 4
    assert len(data["loss"]) == len(data["mtp_loss"]) == len(data["expert_load_max_violation"]) == 3
    assert all(2.0 < v < 10.0 for v in data["loss"] + data["mtp_loss"])
    assert data["tokens_per_s"] > 0
    assert 0.0 <= data["bubble_rate"]["measured"] < 1.0 and data["bubble_rate"]["simulated"] is not None
    events = json.loads(timeline.read_text())["events"]
    assert {e["op"] for e in events} >= {"F", "FB"}  # DualPipe ran overlapped F&B units
    assert "bubble rate measured / simulated" in done.stdout
