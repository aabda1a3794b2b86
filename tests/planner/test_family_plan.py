"""A plan for a family other than DeepSeek-V3 speaks of that family: the memory breakdown names the code that
holds its experts and where its saved bytes come from, the savers line lists its own savers, and the miniature
it prints runs its own tiny preset (the issue's Qwen3-235B-A22B on 512 H800, and Llama 3 8B)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.models.registry import planned_families
from mt_dualpipe.planner.runnable import demo_command, miniature
from tests.helpers.family_configs import QWEN3_235B, write_config

PLANNED = planned_families()

ISSUE = ["--gpus", "512", "--global-batch", "1024", "--seq-len", "4096", "--recompute", "full", "--runnable-only",
         "--pp", "16", "--top", "3"]


def _plan(capsys, tmp_path, model: str, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", model, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.fixture(scope="module")
def qwen3_235b(tmp_path_factory):
    """The issue's plan, once: (the config folder, the JSON, what it printed)."""
    folder = write_config(tmp_path_factory.mktemp("q") / "Qwen3-235B-A22B", QWEN3_235B)
    out, text = tmp_path_factory.mktemp("o") / "plan.json", io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["plan", "--model", str(folder), *ISSUE, "--json", str(out)]) == 0
    return folder, json.loads(out.read_text()), text.getvalue()


def test_the_qwen3_plan_talks_qwen3(qwen3_235b):
    _, data, out = qwen3_235b
    best = data["configurations"][0]
    assert best["runnable"] and best["memory_gb"]["total"] <= 80 and best["pp"] == 16
    assert "deepseek" not in out.lower() and "mla_input" not in out
    terms = {t["name"]: t for t in best["memory_terms"]}
    assert "models/qwen3_moe/model.py" in terms["routed-expert weights"]["kept_by"]
    assert "saved_per_token declarations, models/qwen3_moe/spec.py" in terms["saved activations at the rank's peak"][
        "formula"]
    assert ("Qwen3-MoE's activation savers off (--memory-savers all turns them on: norm, swiglu, combine, attention, "
            "loss).") in out
    qwen = PLANNED["qwen3_moe"]
    assert best["miniature"] == demo_command(miniature(best["launch"], qwen), qwen)
    assert best["command"] == demo_command(best["launch"], qwen)
    assert shlex.split(best["miniature"])[1:4] == ["examples/train_family.py", "--family", "qwen3_moe"]
    assert (f"the same program in miniature (tiny Qwen3-MoE, pp 2 x dp 1 x ep 2 local gloo processes):\n  "
            f"{best['miniature']}\n") in out


def test_a_saver_the_family_lacks_is_one_clear_error(qwen3_235b, capsys):
    folder, _, _ = qwen3_235b
    assert main(["plan", "--model", str(folder), *ISSUE, "--memory-savers", "mla_input"]) == 2
    assert "memory saver 'mla_input' is not one of Qwen3-MoE's: its modules have norm, swiglu, combine, attention, " \
           "loss" in capsys.readouterr().err


def test_the_llama_plan_is_dense_and_talks_llama(tmp_path, capsys):
    data, out = _plan(capsys, tmp_path, "llama3-8b", "--gpus", "64", "--global-batch", "256", "--runnable-only",
                      "--top", "3", "--memory-savers", "all")
    best = data["configurations"][0]
    assert "deepseek" not in out.lower() and "routed-expert" not in out
    assert [t["name"] for t in best["memory_terms"]] == ["non-expert weights", "gradients",
                                                         "non-expert optimizer state",
                                                         "saved activations at the rank's peak"]
    assert "Llama's activation savers attention, loss, norm, swiglu." in out
    assert "selective recompute (the core attention and each SwiGLU product" in out
    assert best["launch"]["memory_savers"] == "attention,loss,norm,swiglu"
    words = shlex.split(best["miniature"])
    assert words[1:4] == ["examples/train_family.py", "--family", "llama"]
    assert words[words.index("--memory-savers") + 1] == "attention,loss,norm,swiglu"
    assert "--core-attention" not in words and words[words.index("--ep") + 1] == "1"


def test_a_layout_the_example_cannot_take_is_said_not_printed(tmp_path, capsys):
    """A searched schedule's placement (the auto schedule beats 1F1B): the plan names the layout and says why
    it has no miniature."""
    data, out = _plan(capsys, tmp_path, "llama3-8b", "--gpus", "16", "--global-batch", "64", "--pp", "4",
                      "--schedules", "1f1b", "--auto", "1", "--runnable-only", "--top", "1")
    best = data["configurations"][0]
    assert best["miniature"] is None and "placement" in best["no_miniature"]
    assert f"; no miniature: {best['no_miniature']}" in out and "python examples/" not in out
