"""The DualPipe / DualPipeV examples run as a user runs them and check themselves against a single process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,ranks,chunks,name", [
    ("example_dualpipe.py", 2, 4, "DualPipe"),
    ("example_dualpipev.py", 2, 4, "DualPipeV"),
])
def test_example_runs_and_matches_single_process(script: str, ranks: int, chunks: int, name: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--ranks", str(ranks),
                          "--chunks", str(chunks)], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{name} with {ranks} ranks, {chunks} micro-batches: OK" in out.stdout
    assert out.stdout.count("loss and outputs equal the single-process run") == ranks
