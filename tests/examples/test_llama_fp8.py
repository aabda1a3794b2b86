"""examples/llama_fp8.py: a tiny Llama trained twice over a 2-rank pipeline (fp32 and FP8, same data and
seed); both curves in one PNG and the relative gap printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "llama_fp8.py"


def _module():
    return load_script(SCRIPT, "llama_fp8")


def test_fp8_and_fp32_train_the_same_model_on_the_same_data(tmp_path):
    png, summary = tmp_path / "curves.png", tmp_path / "s.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", "4", "--window", "2", "--micro-batch-size", "2",
           "--seq-len", "32", "--out", str(png), "--summary", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(summary.read_text())
    base, fp8 = data["runs"]["fp32"]["loss"], data["runs"]["fp8"]["loss"]
    assert len(base) == len(fp8) == 4 and data["baseline"] == "fp32" and data["schedule"] == "zbv"
    # the same seeded weights and batches: the first losses agree to FP8's rounding, but are not identical
    assert base[0] != fp8[0] and abs(fp8[0] - base[0]) / base[0] < 0.01
    tail_b, tail_f = sum(base[-2:]) / 2, sum(fp8[-2:]) / 2
    assert data["final_mean_loss"] == pytest.approx({"fp32": tail_b, "fp8": tail_f,
                                                     "relative_gap": (tail_f - tail_b) / tail_b})
    assert abs(data["final_mean_loss"]["relative_gap"]) < 0.05
    held = data["held_out_loss"]
    assert held["relative_gap"] == pytest.approx((held["fp8"] - held["fp32"]) / held["fp32"])
    assert f"relative gap {100 * data['final_mean_loss']['relative_gap']:+.2f} %" in done.stdout
    assert f"loss curves written to {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_numbers_still_print(monkeypatch, capsys, tmp_path):
    module = _module()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    runs = {"fp32": {"loss": [2.0, 1.0], "held_out": None}, "fp8": {"loss": [2.0, 1.1], "held_out": None}}
    result = module.gaps(runs, "fp32", 1)
    assert result == {"final_mean_loss": {"fp32": 1.0, "fp8": 1.1, "relative_gap": pytest.approx(0.1)},
                      "max_step_relative_gap": pytest.approx(0.1)}
    assert module.plot(runs, "fp32", result, str(tmp_path / "x.png"), "t") is False
    assert "no plot: matplotlib is not installed (pip install matplotlib" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--window", "0"], "--window must be in 1..--steps (60), got 0"),
    (["--steps", "5", "--window", "6"], "--window must be in 1..--steps (5), got 6"),
    (["--tokenizer", "t.json"], "--tokenizer needs --corpus (the text it tokenizes)"),
    (["--baseline", "fp16"], "argument --baseline: invalid choice: 'fp16'"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _module().parse_args(argv)
    assert message in capsys.readouterr().err
