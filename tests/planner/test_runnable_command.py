"""Planner -> runtime: the launch tuple becomes the DeepSeek-V3 demo's command line, and that command line
parses back into the same tuple; what the demo or runtime cannot run gets no command (or is marked)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.parallel.modes import DP_MODES
from mt_dualpipe.planner import runnable as runnable_module
from mt_dualpipe.planner.runnable import (
    DEEP_MINIATURE,
    DEMO,
    MINIATURE_PROCESSES,
    TINY_DEEPSEEK,
    TINY_EXPERTS,
    demo_command,
    miniature,
    unrunnable_reasons,
)
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
TUPLE = ("pp", "dp", "ep", "tp", "schedule", "microbatches", "dp_mode", "recompute")


def _demo():
    return load_script(ROOT / DEMO, "deepseek_v3_repro_plan")


def _launch(**kw) -> dict:
    base = {"pp": 16, "dp": 2, "ep": 64, "tp": 1, "schedule": "dualpipe", "microbatches": 120, "dp_mode": "zero1",
            "recompute": "selective", "schedule_options": {}, "micro_batch_size": 1}
    return {**base, **kw}


def test_demo_command_spells_every_knob():
    assert demo_command(_launch()) == (
        "python examples/deepseek_v3_repro.py --pp 16 --dp 2 --ep 64 --dp-mode zero1 --schedule dualpipe "
        "--microbatches 120 --recompute selective --micro-batch-size 1")
    inter = demo_command(_launch(schedule="interleaved-1f1b", schedule_options={"virtual_stages": 3},
                                 dp_mode="allreduce"))
    assert "--schedule interleaved-1f1b" in inter and inter.endswith("--virtual-stages 3 --micro-batch-size 1")
    # the core attention and the activation savers the estimate counted travel with the command
    full = demo_command(_launch(ep=16, core_attention="flash", memory_savers="attention,combine,norm,router,swiglu"))
    assert full.endswith("--micro-batch-size 1 --core-attention flash --memory-savers attention,combine,norm,router,"
                         "swiglu")
    args = _demo().parse_args(shlex.split(full)[2:])
    assert (args.core_attention, args.memory_savers) == ("flash", "attention,combine,norm,router,swiglu")
    # what the demo cannot take: a searched schedule's placement, tensor parallelism
    assert demo_command(_launch(schedule="auto", schedule_options={"placement": "v"})) is None
    assert demo_command(_launch(tp=2)) is None


def test_the_command_parses_back_into_the_launch_tuple():
    demo = _demo()
    for launch in (_launch(ep=16), _launch(pp=4, dp=1, ep=8, schedule="zbv", microbatches=16, dp_mode="allreduce",
                                      recompute="full")):
        words = shlex.split(demo_command(launch))
        assert words[:2] == ["python", DEMO]
        args = demo.parse_args(words[2:])
        args.num_mb = args.microbatches
        assert demo.launch_tuple(args) == {k: launch[k] for k in TUPLE}


def test_tensor_parallel_moe_stays_unrunnable_when_dense_tp_runs(monkeypatch):
    @dataclass(frozen=True)
    class WithTp:
        tp: int
        ep: int
        recompute: str = "none"
        zero: int = 0  # allreduce: the runtime's mode that reduces tensor-parallel shards (DP_MODES)

    monkeypatch.setattr(runnable_module, "RUNTIME_TP", (1, 2))  # dense tensor-parallel stages run
    assert unrunnable_reasons(WithTp(2, 1)) == []
    assert unrunnable_reasons(WithTp(2, 8)) == [
        "tp 2 with expert parallelism is not launched: tensor-parallel stages are dense only (MoE stages shard "
        "experts over ep, not tp)"]


def _plan(tmp_path, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "512", "--global-batch", "1024", "--pp", "16",
               "--gpu-memory", "256GB", "--dtype", "fp8", "--schedules", "dualpipe,zbv", "--top", "3",
               "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_plan_json_carries_the_command_of_each_runnable_configuration(tmp_path, capsys):
    data = _plan(tmp_path)
    rows = data["configurations"] + data["over_memory"]
    assert rows and all(r["runnable"] for r in rows)
    for row in rows:
        assert row["command"] == demo_command(row["launch"])
        assert f"--pp {row['pp']} --dp {row['dp'] // row['ep']} --ep {row['ep']} " in row["command"]
    best = data["configurations"][0]
    assert best["miniature"] == demo_command(miniature(best["launch"]))
    lead = (f"the best runnable layout launches as pp {best['pp']} x dp {best['dp'] // best['ep']} x ep {best['ep']} "
            f"({best['schedule']}, {best['launch']['dp_mode']}, recompute {best['recompute']}, "
            f"{best['num_microbatches']} micro-batches of {best['micro_batch_size']}); the same program in miniature")
    out = capsys.readouterr().out
    assert lead in out and f"\n  {best['miniature']}\n" in out


def test_the_miniature_is_the_same_program_on_a_few_local_processes():
    """The published DeepSeek-V3 layout (pp 16 x dp 2 x ep 64, 2,048 ranks) shrinks to pp 2 x ep 2 on the tiny
    preset's 16 experts, keeping every knob that is not a size; the demo accepts the result."""
    demo = _demo()
    full = _launch(core_attention="flash", memory_savers="attention,combine,norm,router,swiglu")
    small = miniature(full)
    assert (small["pp"], small["dp"], small["ep"]) == (2, 1, 2)
    assert small["pp"] * small["dp"] * small["ep"] <= MINIATURE_PROCESSES
    sizes = ("pp", "dp", "ep", "microbatches", "micro_batch_size", "layers")
    assert {k: v for k, v in small.items() if k not in sizes} == {k: v for k, v in full.items() if k not in sizes}
    assert small["layers"] is None  # the preset's own depth fills pp 2
    command = demo_command(small)
    assert command == ("python examples/deepseek_v3_repro.py --pp 2 --dp 1 --ep 2 --dp-mode zero1 --schedule "
                       "dualpipe --recompute selective --core-attention flash --memory-savers "
                       "attention,combine,norm,router,swiglu")
    args = demo.parse_args(shlex.split(command)[2:])  # parse_args runs the demo's own mesh and batch checks
    assert (args.pp, args.dp, args.ep, args.microbatches) == (2, 1, 2, None)
    # no expert parallelism: the data-parallel ranks fill what pp 2 leaves; an ep the experts do not divide shrinks
    assert miniature(_launch(dp=8, ep=1))["dp"] == 2
    assert miniature(_launch(dp=1, ep=3), experts=16)["ep"] == 2
    assert miniature(_launch(dp=1, ep=3), experts=9)["ep"] == 1
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config

    assert TINY_EXPERTS == DeepSeekV3Config.preset("tiny").n_routed_experts  # the demo's default preset


def test_the_miniature_can_keep_the_plans_pp():
    """``keep_pp``: the published layout's miniature at pp 16, one process per pipeline rank, at the deep
    miniature's sizes, with the fewest layers whose balanced cut puts a block on every stage (the demo refuses
    the tiny preset's 4 there; with selective recompute the first stage needs one too: 15, not 14); the
    planner's model of the tiny preset is the demo's."""
    demo = _demo()
    small = miniature(_launch(core_attention="flash"), keep_pp=True)
    assert (small["pp"], small["dp"], small["ep"], small["layers"]) == (16, 1, 1, 15)
    command = demo_command(small)
    assert command == ("python examples/deepseek_v3_repro.py --pp 16 --dp 1 --ep 1 --dp-mode zero1 --schedule "
                       "dualpipe --microbatches 32 --recompute selective --layers 15 --vocab-size 128 --seq-len 16 "
                       "--steps 20 --micro-batch-size 1 --core-attention flash")
    args = demo.parse_args(shlex.split(command)[2:])
    assert {k: getattr(args, k) for k in DEEP_MINIATURE} == DEEP_MINIATURE
    assert demo.depth_problem(args) is None  # the demo's own cut: a block on every stage
    shallow = demo.parse_args(shlex.split(command.replace(" --layers 15", ""))[2:])
    assert "Pass --layers 15 (the fewest that fill pp 16)" in demo.depth_problem(shallow)
    assert miniature(_launch(recompute="none"), keep_pp=True)["layers"] == 14  # the middle stages only
    # ZB-V at pp 8 holds 16 stages: 14 layers; DualPipe's 4 stages at pp 4 take the preset's own 4 (no --layers)
    assert miniature(_launch(pp=8, schedule="zbv", recompute="none"), keep_pp=True)["layers"] == 14
    four = miniature(_launch(pp=4, recompute="none"), keep_pp=True)
    assert four["layers"] is None and "--layers" not in demo_command(four)
    assert miniature(_launch())["layers"] is None  # the default miniature stays at pp 2 on the preset
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config

    tiny = DeepSeekV3Config.preset("tiny")
    assert TINY_DEEPSEEK == {k: getattr(tiny, k) for k in TINY_DEEPSEEK}


def test_plan_keep_pp_prints_the_miniature_at_the_layouts_pp(tmp_path, capsys):
    data = _plan(tmp_path, "--keep-pp")
    best = data["configurations"][0]
    assert best["pp"] == 16 and best["miniature"] == demo_command(miniature(best["launch"], keep_pp=True))
    out = capsys.readouterr().out
    assert "in miniature (tiny DeepSeek-V3, 15 layers, pp 16 x dp 1 x ep 1 local gloo processes)" in out
    assert f"\n  {best['miniature']}\n" in out and " --layers 15 " in best["miniature"]


def _printed_miniature(capsys, *argv: str) -> str:
    """The command line ``mt-dualpipe plan`` prints for the best layout's miniature."""
    assert main(["plan", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return next(lines[i + 1] for i, line in enumerate(lines) if line.endswith("local gloo processes):")).strip()


@pytest.mark.slow  # the demo as printed: 20 steps of ZB-V on 4 processes
def test_the_printed_miniature_runs_as_printed(capsys):
    """A plan at pp 4 under ZB-V printed with --keep-pp: its command (the tiny preset deepened to 7 layers, so
    that with the plan's selective recompute every stage holds a block; the plan's savers and core attention;
    the deep miniature's sizes) runs as printed, trains every stage, and its loss falls."""
    command = _printed_miniature(capsys, "--model", "deepseek-v3", "--gpus", "64", "--global-batch", "256", "--pp",
                                 "4", "--gpu-memory", "256GB", "--dtype", "fp8", "--schedules", "zbv", "--keep-pp")
    words = shlex.split(command)
    assert words[:2] == ["python", DEMO] and words[2:4] == ["--pp", "4"] and "--layers" in words
    done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("zbv · 4 ranks · 8 micro-batches of 1x16 tokens · layout ")
    layout = first.split(" · layout ")[1].split(" · ")[0].split("|")
    assert len(layout) == 8 and all("t" in stage for stage in layout[:-1]) and "--layers" in words
    before, after = re.search(r"loss \(first → last step\) +│ +([\d.]+) → ([\d.]+)", done.stdout).groups()
    assert float(after) < float(before) - 0.1


def test_plan_json_gives_no_command_to_what_the_runtime_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runnable_module, "RUNTIME_RECOMPUTE", ("none",))
    data = _plan(tmp_path, "--recompute", "selective")
    rows = data["configurations"] + data["over_memory"]
    assert rows and all(not r["runnable"] and r["command"] is None for r in rows)
    assert "launch the best runnable layout" not in capsys.readouterr().out


@pytest.mark.parametrize("knob", ["dp_mode", "recompute"])
def test_every_runtime_value_is_a_demo_choice(knob):
    demo = _demo()
    # every mode of the table but fully_shard's (the demo's stages are not wrapped; demo_command gives None)
    values = ([m for m, spec in DP_MODES.items() if not spec.needs_fully_shard] if knob == "dp_mode"
              else runnable_module.RUNTIME_RECOMPUTE)
    for value in values:
        args = demo.parse_args([f"--{knob.replace('_', '-')}", value])
        assert getattr(args, knob) == value


def test_plan_zero3_marks_fsdp_runnable_exactly_where_the_runtime_runs_it(tmp_path):
    dense = tmp_path / "llama2-7b.json"
    dense.write_text(json.dumps({"model_name": "llama2-7b", "hidden_size": 4096, "num_layers": 32,
                                 "ffn_hidden_size": 11008, "vocab_size": 32000, "num_attention_heads": 32}))
    out = tmp_path / "dense.json"
    assert main(["plan", "--model", str(dense), "--gpus", "32", "--global-batch", "64", "--pp", "4",
                 "--schedules", "1f1b,zbv", "--zero", "3", "--top", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["configurations"]
    assert rows and all(r["launch"]["dp_mode"] == "fsdp" and r["runnable"] and r["command"] is None for r in rows)
    moe = _plan(tmp_path, "--zero", "3")  # DeepSeek-V3: expert parallelism and the MTP's tied embedding
    rows = moe["configurations"] + moe["over_memory"]
    assert rows and all(not r["runnable"] and r["command"] is None for r in rows)
    for r in rows:
        tied = [u for u in r["unrunnable"] if "tied across stages" in u]
        with_ep = [u for u in r["unrunnable"] if "with ep" in u]
        assert tied and bool(with_ep) == (r["ep"] > 1)
