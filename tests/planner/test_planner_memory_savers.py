"""DeepSeek-V3's memory savers (``DeepSeekV3Config.memory_savers``): the planner's saved bytes per token of a
dense and a MoE layer, counted under ``planner.activations.memory_savers``, against what the modules built
with the same savers hand autograd (``SavedActivationMeter``), in a bf16 model with and without FP8
linears, one saver at a time and all together, for every recompute policy.

The "wide tiny" model's dimensions are multiples of 128, so the FP8 tiles (linear inputs and the SwiGLU's
cached inputs) are whole. Parameters and each ``FP8Linear``'s cached FP8 weight are weight memory, left
out of both sides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mt_dualpipe.fp8.linear import FP8Linear
from mt_dualpipe.layers.savers import MEMORY_SAVERS
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages
from mt_dualpipe.models.recompute import POLICIES, SavedActivationMeter
from mt_dualpipe.planner import ModelSpec
from mt_dualpipe.planner.activations import FP8_LIN, SAVERS, memory_savers

SEQ = 32
WIDE = DeepSeekV3Config.preset("tiny", dim=128, n_layers=2, vocab_size=64, inter_dim=256, moe_inter_dim=128,
                               q_lora_rank=128, kv_lora_rank=128, max_seq_len=64, mtp_depth=0)


def _fp8_weight_copies(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in layer.modules() if isinstance(m, FP8Linear)
            for t in (m.quantized_weight().data, m.quantized_weight().scale)]


def measured(cfg: DeepSeekV3Config, policy: str, fp8: bool, seq: int = SEQ) -> list[float]:
    """Saved bytes per token of each layer of a one-stage bf16 pipeline (dense first, then MoE)."""
    torch.manual_seed(0)
    stage = build_stages(cfg, 1, source=DeepSeekV3Model(cfg), fp8=fp8, recompute=policy)[0].to(torch.bfloat16)
    out = []
    for layer in stage.model.layers.values():
        x = torch.randn(1, seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
        meter = SavedActivationMeter(exclude=list(layer.parameters()) + _fp8_weight_copies(layer))
        with meter.measure():
            layer(x)
        out.append(meter.peak / seq)
    return out


def planned(cfg: DeepSeekV3Config, policy: str, fp8: bool, seq: int = SEQ) -> list[float]:
    with memory_savers(cfg.memory_savers):
        items = ModelSpec.from_deepseek_config(cfg).items(seq, act_unit=FP8_LIN if fp8 else 2.0, recompute=policy,
                                                          elem=2.0, attention="eager")
    return [i.act_bytes for i in items[1:1 + cfg.n_layers]]


def test_the_planner_knows_the_savers_the_modules_have():
    assert SAVERS == MEMORY_SAVERS


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("saver", [*MEMORY_SAVERS, "all"])
def test_planner_layer_bytes_match_the_runtime_with_each_saver(saver, fp8):
    torch.set_num_threads(1)
    cfg = WIDE.replace(memory_savers=saver)
    for policy in POLICIES:
        got, plan = measured(cfg, policy, fp8), planned(cfg, policy, fp8)
        for kind, m, p in zip(("dense", "moe"), got, plan):
            assert p == pytest.approx(m, rel=0.10), (saver, policy, kind, m, p)
        if policy == "none":  # each saver saves: fewer bytes than without it, in the layers it touches
            # (the combine's alone keeps the unscaled SwiGLU product, ffn wide, instead of the expert outputs,
            # hidden wide: equal here; with the SwiGLU saver nothing replaces them)
            base = measured(WIDE.replace(memory_savers="swiglu") if saver == "combine" else WIDE, policy, fp8)
            got = measured(cfg.replace(memory_savers="swiglu,combine"), policy, fp8) if saver == "combine" else got
            touched = {"norm": (0, 1), "swiglu": (0, 1), "attention": (0, 1), "all": (0, 1), "loss": (),
                       "mla_input": (0, 1) if fp8 else ()}.get(saver, (1,))  # mla_input: FP8 copies only
            for i in touched:
                assert got[i] < base[i], (saver, i, got[i], base[i])


def _stage_bytes(cfg: DeepSeekV3Config, fp8: bool) -> list[float]:
    """Saved bytes per token of each of two pipeline stages (the stages' piecewise forward, the last one
    with its head, MTP and losses), as the runtime runs them."""
    torch.manual_seed(0)
    stages = [s.to(torch.bfloat16) for s in build_stages(cfg, 2, source=DeepSeekV3Model(cfg), fp8=fp8)]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    out, x = [], tokens
    for i, stage in enumerate(stages):
        meter = SavedActivationMeter(exclude=list(stage.parameters()) + _fp8_weight_copies(stage))
        with meter.measure():
            y = stage(x)
            if i == len(stages) - 1:
                stage.criterion(y, labels)
        out.append(meter.peak / SEQ)
        x = y.detach().requires_grad_()
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("savers", ["", "loss", "all"])
def test_planner_stage_bytes_match_the_runtime_stages(savers, fp8):
    """Whole stages through the runtime's piecewise forward (the path the pipeline runs; the combine's gate
    weights cross its pieces), the last one with its head, MTP depth and the losses."""
    torch.set_num_threads(1)
    cfg = WIDE.replace(n_layers=3, mtp_depth=1, memory_savers=savers)
    with memory_savers(cfg.memory_savers):
        items = ModelSpec.from_deepseek_config(cfg).items(SEQ, act_unit=FP8_LIN if fp8 else 2.0, recompute="none",
                                                          elem=2.0, attention="eager")
    # build_stages' default split of 3 layers over 2 stages: embedding + 2 layers | 1 layer + head + MTP
    plan = [sum(i.act_bytes for i in items[:3]), sum(i.act_bytes for i in items[3:])]
    got = _stage_bytes(cfg, fp8)
    for stage, (m, p) in enumerate(zip(got, plan)):
        assert p == pytest.approx(m, rel=0.10), (savers, stage, m, p)
    if savers == "loss":  # the last stage keeps bf16 logits instead of float32 log-probabilities
        assert got[1] < _stage_bytes(WIDE.replace(n_layers=3, mtp_depth=1), fp8)[1]


def test_the_plan_command_counts_the_savers_it_is_given(tmp_path, capsys):
    """``plan --memory-savers``: the published DeepSeek-V3 layout's activations shrink by the savers' rule, and a
    name the modules do not have is refused."""
    import json

    from mt_dualpipe.cli import main

    argv = ["plan", "--model", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--ep", "64", "--schedules",
            "dualpipe", "--dtype", "fp8", "--recompute", "selective", "--zero", "1", "--top", "1"]
    acts = {}
    for savers in ("none", "all"):
        main([*argv, "--memory-savers", savers, "--json", str(tmp_path / "plan.json")])
        capsys.readouterr()
        data = json.loads((tmp_path / "plan.json").read_text())
        entry = (data["configurations"] or data["over_memory"])[0]
        acts[savers] = entry["memory_gb"]["activations"]
    assert acts["all"] < 0.4 * acts["none"]  # 671B: 482 -> 160 KiB per MoE layer and token
    assert main([*argv, "--memory-savers", "flash"]) != 0
    captured = capsys.readouterr()
    assert "unknown memory saver 'flash'" in captured.out + captured.err


def test_the_issue_command_fits_by_switching_the_savers_on(tmp_path, capsys):
    """``plan`` with no ``--memory-savers`` (``auto``) at DeepSeek-V3's published layout: nothing fits without
    the report's savers, so the plan counts all of them, says so, and its launch carries them; asked for none,
    it reports that nothing fits. A model whose modules have no savers is planned without them either way."""
    import json

    from mt_dualpipe.cli import main
    from mt_dualpipe.cli.plan_cmd import planned_with_savers

    argv = ["plan", "--model", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--ep", "64", "--schedules",
            "dualpipe", "--dtype", "fp8", "--recompute", "selective", "--zero", "1"]
    assert main([*argv, "--json", str(tmp_path / "auto.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing fits without the activation savers")
    data = json.loads((tmp_path / "auto.json").read_text())
    best = data["configurations"][0]
    assert data["memory_savers"] == sorted(SAVERS) and best["memory_gb"]["total"] <= 80 and best["runnable"]
    assert best["launch"]["memory_savers"] == ",".join(sorted(SAVERS))
    assert main([*argv, "--memory-savers", "none"]) == 1
    assert "no configuration fits" in capsys.readouterr().out

    calls = []

    def planned(savers):
        calls.append(savers)
        return SimpleNamespace(ranked=[])

    llama = ModelSpec(name="llama", hidden_size=4096, head_num=32, layer_num=32, vocab_size=32000,
                      intermediate_size=11008, attention_type="gqa")
    _, note = planned_with_savers(llama, "auto", planned)
    assert calls == ["none"] and note == ""
    calls.clear()
    _, note = planned_with_savers(ModelSpec.load("deepseek-v3"), "auto", planned)
    assert calls == ["none", "all"] and note == ""  # nothing fits with them either: the plain plan is reported
