"""Hugging Face checkpoints of DeepSeek-V3: per-stage lazy loading, FP8 block-scaled weights, clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

import mt_dualpipe.models.hf_checkpoint as hf_checkpoint
from mt_dualpipe.fp8 import FP8Linear, dequantize, quantize_blocks
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages
from mt_dualpipe.models.deepseek_v3.hf_names import to_hf_name
from mt_dualpipe.models.hf_checkpoint import CheckpointError, save_pipeline_checkpoint

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=3, vocab_size=128, inter_dim=128, moe_inter_dim=32, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


@pytest.fixture
def saved(tmp_path):
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    with torch.no_grad():
        for block in model.model.layers.values():
            if block.is_moe:
                block.mlp.gate.e_score_correction_bias.normal_()  # a trained correction bias, so its mapping is checked
    model.save_pretrained(tmp_path, max_shard_size=200_000)
    return config, model, tmp_path


class ReadLog:
    """Wraps ``safe_open`` to record every tensor read (and every file opened)."""

    def __init__(self, monkeypatch):
        self.tensors: list[str] = []
        self.files: list[str] = []
        real = hf_checkpoint.safe_open
        log = self

        class Recording:
            def __init__(self, path, framework):
                log.files.append(path)
                self.inner = real(path, framework=framework)

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return self.f.get_slice(name)

            def get_tensor(self, name):
                log.tensors.append(name)
                return self.f.get_tensor(name)

        monkeypatch.setattr(hf_checkpoint, "safe_open", Recording)


def test_save_writes_sharded_official_names(saved):
    config, model, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in model.hf_state_dict().values())
    assert json.loads((path / "config.json").read_text()) == {**config.to_hf(), "torch_dtype": "float32"}


@pytest.mark.parametrize("wanted", [[0], [1], [2], [0, 2]])
def test_a_stage_reads_only_its_own_tensors(saved, monkeypatch, wanted):
    config, model, path = saved
    log = ReadLog(monkeypatch)
    stages = build_stages(config, 3, [1, 1, 1], checkpoint=path, indices=wanted)
    expected = [to_hf_name(k, config) for st in stages for k in st.state_dict()]
    assert sorted(log.tensors) == sorted(expected)  # each stage's tensors once per stage, nothing else
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f.rsplit("/", 1)[-1] for f in log.files} == {index[n] for n in expected}
    for st, ref in zip(stages, build_stages(config, 3, [1, 1, 1], source=model, indices=wanted)):
        own, want = st.state_dict(), ref.state_dict()
        assert own.keys() == want.keys()
        for k in own:
            assert torch.equal(own[k], want[k]), k
        assert all(float(b.abs().sum()) == 0 for n, b in st.named_buffers() if n.endswith("gate.load"))


def test_loaded_stages_give_the_models_loss(saved):
    config, model, path = saved
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    stages = build_stages(config, 2, checkpoint=path)
    loss = stages[1].criterion(stages[1](stages[0](x)), y)
    assert torch.equal(loss, model(x, y))


def test_pipeline_save_round_trips_single_process(saved, tmp_path):
    config, model, path = saved
    stages = build_stages(config, 3, [1, 1, 1], source=model)
    out = save_pipeline_checkpoint(stages, tmp_path / "pipe")
    back = DeepSeekV3Model.from_pretrained(out)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# ----- FP8 checkpoints ------------------------------------------------------------------------------------
def test_fp8_checkpoint_loads_to_its_dequantisation(saved, tmp_path):
    config, model, _ = saved
    model.save_pretrained(tmp_path / "fp8", fp8=True)
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in index
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in index and "lm_head.weight_scale_inv" not in index
    # the same weights written dequantised (what a bf16/fp32 conversion of the FP8 checkpoint holds)
    dequantised = DeepSeekV3Model(config)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            fp8 = to_hf_name(k, config) + "_scale_inv" in index
            dequantised.state_dict()[k].copy_(dequantize(quantize_blocks(v)) if fp8 else v)
    dequantised.save_pretrained(tmp_path / "deq")
    a = DeepSeekV3Model.from_pretrained(tmp_path / "fp8")
    b = DeepSeekV3Model.from_pretrained(tmp_path / "deq")
    changed = 0
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k], v), k
        changed += not torch.equal(v, model.state_dict()[k])
    assert changed > 20  # the FP8 weights really went through E4M3


def test_fp8_checkpoint_into_fp8_linears_keeps_the_stored_fp8(saved, tmp_path):
    config, model, _ = saved
    model.save_pretrained(tmp_path / "fp8", fp8=True)
    fp8_model = DeepSeekV3Model.from_pretrained(tmp_path / "fp8", fp8=True)
    layer = fp8_model.model.layers["1"].mlp.experts["3"].up_proj
    assert isinstance(layer, FP8Linear)
    ref = quantize_blocks(model.model.layers["1"].mlp.experts["3"].up_proj.weight.detach())
    q = layer.quantized_weight()  # the cached copy: no re-quantisation of the dequantised master weight
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    assert torch.equal(layer.weight.detach(), dequantize(ref))
    stages = build_stages(config, 2, checkpoint=tmp_path / "fp8", fp8=True)
    assert sum(isinstance(m, FP8Linear) for st in stages for m in st.modules()) > 20


# ----- errors ---------------------------------------------------------------------------------------------
def _shard_of(path, name):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_shard_is_named(saved):
    config, _, path = saved
    shard = _shard_of(path, "model.layers.2.self_attn.o_proj.weight")
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{shard} is missing"):
        DeepSeekV3Model.from_pretrained(path)
    build_stages(config, 3, [1, 1, 1], checkpoint=path, indices=[0])  # a stage that needs no tensor there


def test_truncated_shard_is_named(saved):
    _, _, path = saved
    shard = path / _shard_of(path, "model.layers.0.mlp.up_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"shard .*{shard.name} cannot be read as safetensors"):
        DeepSeekV3Model.from_pretrained(path)


def test_wrong_shape_is_named_and_nothing_is_read(saved, monkeypatch):
    _, _, path = saved
    log = ReadLog(monkeypatch)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight in model-\d+-of-\d+"
                                              r"\.safetensors has shape \(128, 64\), but the model's "
                                              r"model\.layers\.0\.mlp\.gate_proj\.weight needs \(96, 64\)"):
        DeepSeekV3Model.from_pretrained(path, inter_dim=96)
    assert log.tensors == []  # shapes come from the headers: no tensor was loaded


def test_missing_tensor_and_missing_mtp_layer_are_named(saved):
    config, _, path = saved
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.5.down_proj.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight.*"
                                              r"layers\.1\.mlp\.experts\.5\.down_proj\.weight"):
        DeepSeekV3Model.from_pretrained(path)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith("model.layers.3.")}
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"has no MTP layer \(model\.layers\.3\.\*\).*load with mtp_depth=0"):
        build_stages(config, 2, checkpoint=path, indices=[1])


def test_bad_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        hf_checkpoint.Checkpoint(tmp_path)


def test_bf16_checkpoint_keeps_the_router_in_float32_and_loads_into_float32(saved, tmp_path):
    config, model, _ = saved
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ckpt = hf_checkpoint.Checkpoint(tmp_path / "bf16")
    dtypes = {n: t.dtype for n, t in ckpt.read(["model.layers.1.mlp.gate.weight",
                                                "model.layers.1.mlp.gate.e_score_correction_bias",
                                                "model.layers.1.mlp.experts.0.up_proj.weight"])}
    assert list(dtypes.values()) == [torch.float32, torch.float32, torch.bfloat16]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = DeepSeekV3Model.from_pretrained(tmp_path / "bf16")
    for k, v in model.state_dict().items():
        want = v if k.endswith(("gate.weight", "gate.e_score_correction_bias")) else v.bfloat16().float()
        assert back.state_dict()[k].dtype == torch.float32 and torch.equal(back.state_dict()[k], want), k
