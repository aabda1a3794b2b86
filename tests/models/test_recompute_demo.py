"""The DeepSeek-V3 demo with ``--recompute``: its summary carries the runtime's recorded peak of saved-activation
bytes on every rank (gathered to rank 0) and the step time, and selective / full record less than none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepseek_v3_repro.py"
TINY = ["--ranks", "2", "--micro-batch-size", "1", "--seq-len", "16", "--no-progress", "--no-rewind", "--steps", "2"]


def _summary(policy: str, tmp_path: Path) -> tuple[dict, str]:
    path = tmp_path / f"{policy}.json"
    cmd = [sys.executable, str(SCRIPT), *TINY, "--recompute", policy, "--summary", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(path.read_text()), done.stdout


@pytest.mark.slow  # bit-equal gradients and per-rank peaks per policy: test_recompute.py, test_activation_peak.py
def test_demo_summary_shows_each_ranks_peak_and_step_time_per_recompute_mode(tmp_path):
    peaks = {}
    for policy in ("none", "full"):
        data, out = _summary(policy, tmp_path)
        got = data["activation_peak_bytes_per_rank"]
        assert data["recompute"] == policy and len(got) == 2 and all(p > 0 for p in got)
        assert data["step_time_s"] > 0
        assert f"step time (recompute {policy})" in out
        assert f"saved activations peak per rank (recompute {policy})" in out
        peaks[policy] = got
    assert all(f < n for f, n in zip(peaks["full"], peaks["none"]))
