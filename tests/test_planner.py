"""The strategy planner: model facts, estimates, valid configurations, the DeepSeek-V3 sanity check, CLI."""

from __future__ import annotations

import json

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy, SystemSpec, estimate, load_system, plan
from mt_dualpipe.planner.estimate import a2a_time, activation_peak_bytes, partition
from mt_dualpipe.planner.system import parse_size_gb
from mt_dualpipe.schedules import ScheduleError, accepts, build_schedule, simulate
from mt_dualpipe.schedules.ir import Op


@pytest.fixture(scope="module")
def v3():
    return ModelSpec.load("deepseek-v3")


def test_deepseek_v3_published_sizes(v3):
    assert v3.total_params() / 1e9 == pytest.approx(671, rel=0.005)    # "671B total parameters"
    assert v3.activated_params() / 1e9 == pytest.approx(37, rel=0.03)  # "37B activated for each token"
    assert v3.layer_num == 61 and v3.expert_num == 256 and v3.topk == 8


def test_tiny_deepseek_parameter_count_matches_the_model():
    torch = pytest.importorskip("torch")
    ds = pytest.importorskip("mt_dualpipe.integrations.deepseek_v3")
    torch.manual_seed(0)
    cfg = ds.DeepSeekV3Config.preset("tiny")
    model = ds.DeepSeekV3Model(cfg)
    spec = ModelSpec.from_deepseek_config(cfg)
    assert spec.total_params() == model.num_parameters("main")
    assert spec.total_params(include_mtp=True) == sum(p.numel() for p in model.parameters())


def test_partition_minimises_the_heaviest_stage():
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([3, 1, 1, 1], 2) == [1, 3]
    assert partition([1, 1, 1, 1, 4], 3) in ([2, 2, 1], [3, 1, 1])
    with pytest.raises(ScheduleError, match="cannot cut 3 model pieces into 4 pipeline stages"):
        partition([1, 1, 1], 4)


def test_activation_peak_bytes_walks_the_order():
    ops = [Op("F", 0, 0, 0), Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("W", 0, 1, 0), Op("F", 0, 0, 1),
           Op("BW", 0, 0, 0), Op("BW", 0, 0, 1)]
    assert activation_peak_bytes(ops, [10.0, 3.0]) == 20.0


def test_all_to_all_model(v3):
    h800 = PRESETS["h800"]
    st1 = Strategy(16, "dualpipe", 120, ep=1, dp=128)
    assert a2a_time(v3, st1, h800, 4096) == 0.0
    inside = a2a_time(v3, Strategy(16, "dualpipe", 120, ep=8, dp=128), h800, 4096)
    across = a2a_time(v3, Strategy(16, "dualpipe", 120, ep=64, dp=128), h800, 4096)
    assert 0 < inside < across  # InfiniBand is 8x slower than NVLink on an H800 node
    fp8 = a2a_time(v3, Strategy(16, "dualpipe", 120, ep=64, dp=128, dtype="fp8"), h800, 4096)
    assert fp8 < across  # FP8 dispatch halves one of the two transfers


def test_estimate_uses_the_simulator(v3):
    st = Strategy(16, "dualpipe", 120, ep=64, dp=128, dtype="fp8")
    est = estimate(v3, PRESETS["h800"], st)
    res = simulate(build_schedule("dualpipe", 16, 120), est.costs)
    assert est.pipeline_time == pytest.approx(res.makespan)
    assert est.bubble_rate == pytest.approx(res.bubble_rate)
    assert est.peak_activations == 17  # DualPipe: P + 1
    assert est.step_time == pytest.approx(est.pipeline_time + est.dp_sync_time)
    mem = est.memory_gb
    assert mem["total"] == pytest.approx(mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"],
                                         abs=0.05)
    assert mem["gradients"] == pytest.approx(2 * mem["weights"], rel=0.01)  # FP32 grads of BF16 weights
    assert sum(est.stage_layers) == 61 + 2  # embedding, 61 layers, head + MTP


def test_estimate_rejects_bad_splits(v3):
    with pytest.raises(ScheduleError, match="expert parallel size 3 must divide the data parallel size 128"):
        estimate(v3, PRESETS["h800"], Strategy(16, "1f1b", 120, ep=3, dp=128))


def test_planner_configurations_are_valid(v3):
    gpus, batch = 512, 1024
    result = plan(v3, PRESETS["h800"], gpus, batch, pp=[8, 16], dtype="fp8")
    assert result.ranked
    cap = PRESETS["h800"].gpu_memory_gb * PRESETS["h800"].mem_factor
    times = [e.step_time for e in result.ranked]
    assert times == sorted(times)
    for e in result.ranked:
        s = e.strategy
        assert s.pp * s.dp == gpus and s.dp % s.ep == 0 and 256 % s.ep == 0
        assert s.num_microbatches * s.dp * s.micro_batch_size == batch
        opts = {"virtual_stages": s.virtual_stages} if s.schedule == "interleaved-1f1b" else {}
        assert accepts(s.schedule, s.pp, s.num_microbatches, **opts) is None
        assert e.fits and e.total_memory_gb <= cap
        assert 0 <= e.bubble_rate < 1 and 0 < e.mfu < 1
    assert all(not e.fits for e in result.rejected)


def test_deepseek_v3_on_2048_h800(v3):
    """DeepSeek trained V3 with PP16 DualPipe, EP64 over 8 nodes and ZeRO-1 DP on 2,048 H800s."""
    result = plan(v3, PRESETS["h800"], 2048, pp=[8, 16])
    assert result.reference is not None
    ref = result.reference.strategy
    assert (ref.pp, ref.schedule, ref.ep, ref.dp, ref.num_microbatches) == (16, "dualpipe", 64, 128, 120)
    assert result.reference_rank is not None and result.reference_rank <= 5
    assert result.ranked[0].strategy.schedule in ("dualpipe", "dualpipev")
    assert "ranks #" in result.verdict or "ranks first" in result.verdict


def test_system_presets_and_simumax_layout(tmp_path):
    h800 = load_system("H800")
    assert (h800.tflops_bf16, h800.tflops_fp8, h800.inter_gbs, h800.intra_gbs) == (989, 1979, 50, 400)
    path = tmp_path / "sys.json"
    path.write_text(json.dumps(h800.to_simumax()))
    again = load_system(str(path))
    assert again.replace(name="h800") == h800
    with pytest.raises(ScheduleError, match="neither a preset"):
        load_system("tpu9000")
    with pytest.raises(ScheduleError, match="not in SimuMax's layout"):
        SystemSpec.from_simumax({"networks": {}})
    assert parse_size_gb("80GB") == 80.0 and parse_size_gb("141 GiB") == 141.0
    with pytest.raises(ScheduleError, match="--gpu-memory must look like '80GB'"):
        parse_size_gb("lots")


def test_model_json_errors(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ScheduleError, match="model description lacks head_num, layer_num, vocab_size"):
        ModelSpec.load(str(bad))
    with pytest.raises(ScheduleError, match="neither a bundled model"):
        ModelSpec.load("gpt-17")


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


def test_plan_with_auto_schedule(v3, monkeypatch):
    import importlib

    est_mod = importlib.import_module("mt_dualpipe.planner.estimate")  # the package exports the function
    monkeypatch.setattr(est_mod, "AUTO_TIME_BUDGET", 0.3)
    result = plan(v3, PRESETS["h800"], 512, 1024, pp=[8], ep=[64], dtype="fp8", schedules=("zbv", "1f1b"),
                  auto_top=2)
    autos = [e for e in result.ranked + result.rejected if e.strategy.schedule == "auto"]
    assert {e.strategy.placement for e in autos} == {"v", "linear"}
    for a in autos:
        hand = {"v": "zbv", "linear": "1f1b"}[a.strategy.placement]
        ref = next(e for e in result.ranked + result.rejected if e.strategy.schedule == hand)
        assert a.pipeline_time <= ref.pipeline_time + 1e-9
        assert a.to_dict()["placement"] == a.strategy.placement


def test_dense_model_in_simumax_layout(tmp_path):
    path = tmp_path / "llama3-8b.json"
    path.write_text(json.dumps({"model_type": "dense", "model_name": "llama3-8b", "hidden_size": 4096, "head_num": 32,
                                "kv_head_num": 8, "head_size": 128, "intermediate_size": 14336, "layer_num": 32,
                                "vocab_size": 128256, "use_swiglu": True}))
    model = ModelSpec.load(str(path))
    assert model.total_params() / 1e9 == pytest.approx(8.03, rel=0.01)  # Llama 3 8B
    result = plan(model, PRESETS["a100"], 64, 512, pp=[2, 4])
    assert result.ranked and all(e.strategy.ep == 1 for e in result.ranked + result.rejected)
    with pytest.raises(ScheduleError, match="unknown schedule 'foo'; available:"):
        plan(model, PRESETS["a100"], 64, 512, schedules=("foo",))
