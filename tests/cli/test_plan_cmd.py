"""``mt-dualpipe plan``: the ranking table and JSON, strategy files, model files and their errors."""

from __future__ import annotations

import json

from mt_dualpipe.cli import main


def test_cli_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "512", "--global-batch", "1024", "--pp", "16",
               "--gpu-memory", "80GB", "--gpu-tflops", "989", "--net-gbps", "400", "--dtype", "fp8",
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
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--strategy", str(strat), "--top", "3"])
    assert rc == 0
    assert "ranks" in capsys.readouterr().out
    strat.write_text(json.dumps({"tp_size": 8}))
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--strategy", str(strat)])
    assert rc == 2
    assert "tensor parallelism is not modelled" in capsys.readouterr().err


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
    rc = main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--top", "1"])
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
