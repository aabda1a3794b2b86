"""The miniature ``mt-dualpipe plan`` prints for a family other than DeepSeek-V3 runs that family in
``examples/train_family.py``: for the issue's Qwen3-235B-A22B on 512 H800 and for Llama 3 8B, the command in the
plan's JSON names the family, the example's parser takes it as the plan's layout in miniature, and (slow) it
trains: exit 0, the loss printed every step and falling."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.models.registry import planned_families
from mt_dualpipe.planner.families import FAMILY_EXAMPLE
from mt_dualpipe.planner.runnable import miniature
from tests.helpers.family_configs import QWEN3_235B, write_config
from tests.helpers.scripts import load_script

PLANNED = planned_families()

ROOT = Path(__file__).resolve().parents[2]
PLANS = {
    "qwen3_moe": ["--gpus", "512", "--global-batch", "1024", "--seq-len", "4096", "--recompute", "full",
                  "--runnable-only", "--pp", "16", "--top", "3"],
    "llama": ["--gpus", "64", "--global-batch", "256", "--seq-len", "4096", "--runnable-only", "--top", "3"],
}
"""The plans (``mt-dualpipe plan`` arguments after --model): the issue's Qwen3-235B case, and Llama 3 8B on 64 GPUs."""


def _example():
    return load_script(ROOT / FAMILY_EXAMPLE, "train_family_example")


@pytest.fixture(scope="module")
def best(tmp_path_factory) -> dict:
    """Each family's best runnable configuration in its plan's JSON (its "launch" and "miniature")."""
    out = {}
    for family, argv in PLANS.items():
        folder = tmp_path_factory.mktemp(family)
        model = str(write_config(folder / "Qwen3-235B-A22B", QWEN3_235B)) if family == "qwen3_moe" else "llama3-8b"
        assert main(["plan", "--model", model, *argv, "--json", str(folder / "plan.json")]) == 0
        out[family] = json.loads((folder / "plan.json").read_text())["configurations"][0]
    return out


@pytest.mark.parametrize("family", sorted(PLANS))
def test_the_printed_miniature_names_the_family_and_parses_as_the_layout(best, family):
    entry = best[family]
    words = shlex.split(entry["miniature"])
    assert words[:4] == ["python", FAMILY_EXAMPLE, "--family", family]
    args = _example().parse_args(words[2:])  # the example's own checks: mesh, mode, experts, schedule, depth
    small = miniature(entry["launch"], PLANNED[family])
    assert args.family == family
    assert {k: getattr(args, k) for k in ("pp", "dp", "ep", "dp_mode", "schedule", "recompute")} == \
        {k: small[k] for k in ("pp", "dp", "ep", "dp_mode", "schedule", "recompute")}
    assert args.pp * args.dp * args.ep <= 4 and (family != "qwen3_moe" or args.ep > 1)


def test_the_example_refuses_what_its_preset_cannot_run(capsys):
    example = _example()
    for argv, message in ((["--family", "qwen3_moe", "--ep", "3"], "does not divide the 4 experts"),
                          (["--family", "llama", "--ep", "2"], "has no experts to shard"),
                          (["--family", "qwen3_moe", "--ep", "2", "--dp-mode", "fsdp"], "with expert parallelism"),
                          (["--family", "llama", "--schedule", "interleaved-1f1b", "--virtual-stages", "3"],
                           "pass --layers 6"),
                          (["--family", "deepseek_v3"], "invalid choice")):
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.slow  # 4 gloo processes each, 20 steps: about 40 s a family on 2 cores
@pytest.mark.parametrize("family", sorted(PLANS))
def test_the_printed_miniature_trains(best, family):
    words = shlex.split(best[family]["miniature"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.findall(r"^step \d+/20 loss [\d.]+$", done.stdout, re.MULTILINE)
    first, last = (float(x) for x in re.search(r"^loss ([\d.]+) -> ([\d.]+) over 20 steps", done.stdout,
                                               re.MULTILINE).groups())
    assert last < first - 0.5
