"""``mt-dualpipe plan``: the ranking table and JSON, strategy files, model files and their errors."""

from __future__ import annotations

import json

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.cli.plan_cmd import strategy_options
from mt_dualpipe.parallel.modes import DP_MODES


def test_cli_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "512", "--global-batch", "1024", "--pp", "16",
               "--gpu-memory", "256GB", "--gpu-tflops", "989", "--net-gbps", "400", "--dtype", "fp8",
               "--top", "3", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "schedule" in text and "mem GB" in text
    data = json.loads(out.read_text())
    assert data["format"] == "mt-dualpipe.plan/1" and data["gpus"] == 512
    first = data["configurations"][0]
    assert first["pp"] == 16 and first["pp"] * first["dp"] == 512 and first["tp"] == 1
    assert set(first["memory_gb"]) == {"weights", "gradients", "optimizer", "activations", "total"}


def test_cli_plan_strategy_json(tmp_path, capsys):
    strat = tmp_path / "s.json"
    strat.write_text(json.dumps({"seq_len": 4096, "micro_batch_size": 1, "tp_size": 1, "pp_size": 16, "ep_size": 64,
                                 "zero_state": 1, "dtype": "fp8"}))
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--strategy", str(strat), "--top", "3",
               "--gpu-memory", "256GB"])
    assert rc == 0
    assert "ranks" in capsys.readouterr().out
    # tensor parallelism is estimated (issue 31) and marked: the runtime's launch path runs tp 1 only
    strat.write_text(json.dumps({"tp_size": 8, "pp_size": 16, "ep_size": 8, "dtype": "fp8"}))
    out_json = tmp_path / "tp.json"
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--strategy", str(strat), "--top", "2",
               "--gpu-memory", "256GB", "--schedules", "1f1b", "--json", str(out_json)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    first = data["configurations"][0]
    assert first["tp"] == 8 and first["launch"]["tp"] == 8 and first["pp"] * first["dp"] * first["tp"] == 2048
    assert not first["runnable"] and any(r.startswith("tp 8") for r in first["unrunnable"])


def test_cli_plan_bad_memory(capsys):
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "64", "--gpu-memory", "eighty"])
    assert rc == 2
    assert "--gpu-memory must look like '80GB'" in capsys.readouterr().err


def test_cli_plan_names_the_model_file_and_its_size(tmp_path, capsys):
    path = tmp_path / "llama2-7b.json"
    path.write_text(json.dumps({"model_name": "llama2-7b", "hidden_size": 4096, "num_layers": 32,
                                "ffn_hidden_size": 11008, "vocab_size": 32000, "num_attention_heads": 32}))
    rc = main(["plan", "--model", str(path), "--gpus", "16", "--global-batch", "64", "--pp", "2", "--top", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"llama2-7b ({path}, 6.74 B parameters) on 16 x h800" in out.replace("\n", " ").replace("  ", " ")
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--top", "1", "--gpu-memory", "256GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "deepseek_v3_671b (deepseek_v3_671b.json, 671.03 B parameters) on 2048" in out


def test_cli_plan_refuses_an_unknown_model_key(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"hidden_size": 4096, "num_layers": 32, "ffn_size": 11008, "vocab_size": 32000,
                                "num_attention_heads": 32}))
    assert main(["plan", "--model", str(path), "--gpus", "16", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mt-dualpipe: error: model description {path} has unknown key(s) 'ffn_size'; accepted: ")
    assert "ffn_hidden_size (intermediate_size)" in err


def test_cli_plan_json_carries_the_launch_tuple_and_marks_unrunnable(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "deepseek-v3", "--gpus", "512", "--global-batch", "1024", "--pp", "16", "--ep", "8,32",
            "--dtype", "fp8", "--schedules", "dualpipe,zbv", "--top", "3", "--gpu-memory", "256GB"]
    assert main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "schedule" in line and "mem GB" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][-1] == "run"
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all(line.rstrip("│ ").endswith("yes") for line in rows)  # selective recompute runs
    data = json.loads(out.read_text())
    for c in data["configurations"]:
        launch = c["launch"]
        assert set(launch) == {"pp", "dp", "ep", "tp", "schedule", "microbatches", "dp_mode", "recompute",
                               "schedule_options", "micro_batch_size", "core_attention", "memory_savers"}
        assert launch["pp"] * launch["dp"] * launch["ep"] * launch["tp"] == 512
        assert (launch["dp"] * launch["ep"], launch["schedule"], launch["microbatches"]) == \
            (c["dp"], c["schedule"], c["num_microbatches"])
        assert (launch["dp_mode"], launch["recompute"], c["runnable"]) == ("zero1", "selective", True)
    # --runnable-only with a recompute the runtime has: every row runnable, all-reduce for --zero 0
    assert main([*args, "--recompute", "none", "--zero", "0", "--runnable-only", "--json", str(out)]) in (0, 1)
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert all(c["runnable"] and c["launch"]["dp_mode"] == "allreduce" for c in data["configurations"]
               + data["over_memory"])
    assert "no: " not in text
    # --runnable-only with selective recompute: the runtime has it, so the same rows are offered
    assert main([*args, "--runnable-only"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]) == 3


def test_cli_plan_help_documents_runnability(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--runnable-only rank only configurations the runtime can launch" in text
    assert "today it runs recompute none, selective and full, dp_mode allreduce (--zero 0), zero1 (--zero 1) or " \
        "fsdp (--zero 3, without expert parallelism or weights tied across stages), tp 1" in text
    assert "--zero {0,1,3}" in text


def test_cli_plan_zero_stages_come_from_the_mode_table(tmp_path, capsys):
    assert sorted({m.zero_stage for m in DP_MODES.values()}) == [0, 1, 3]
    with pytest.raises(SystemExit):  # no runtime mode runs ZeRO-2: argparse refuses it
        main(["plan", "--model", "deepseek-v3", "--gpus", "64", "--zero", "2"])
    assert "argument --zero: invalid choice: 2 (choose from 0, 1, 3)" in capsys.readouterr().err
    strat = tmp_path / "s.json"
    for given, planned in ((0, 0), (1, 1), (2, 1), (3, 3)):  # a config's ZeRO-2 plans as zero1
        strat.write_text(json.dumps({"zero_state": given}))
        assert strategy_options(str(strat)) == {"zero": planned}
    for bad in (4, True, "3"):
        strat.write_text(json.dumps({"zero_state": bad}))
        assert main(["plan", "--model", "deepseek-v3", "--gpus", "64", "--strategy", str(strat)]) == 2
        assert (f"strategy JSON {str(strat)!r}: zero_state {bad!r} is not a ZeRO stage; allowed: 0, 1, 2 (run as 1), 3"
                in capsys.readouterr().err)
