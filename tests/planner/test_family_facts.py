"""The planner's table of families (``planner/families.py``) holds what the families are: every family the planner
describes has a row, each tiny preset's shape is the row's, and each family's savers are exactly those that change
what its model keeps; the miniature's command for a family other than DeepSeek-V3 runs its own example."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mt_dualpipe.layers.savers import MEMORY_SAVERS
from mt_dualpipe.models.registry import FAMILIES, planned_families
from mt_dualpipe.planner import ModelSpec
from mt_dualpipe.planner.activations import SAVERS
from mt_dualpipe.planner.families import DEEPSEEK_V3, DESCRIPTION, FAMILY_EXAMPLE, family_of
from mt_dualpipe.planner.runnable import command_refusal, demo_command, miniature
from mt_dualpipe.schedules.errors import ScheduleError

PLANNED = planned_families()

ROOT = Path(__file__).resolve().parents[2]


def test_every_planned_family_has_a_row_and_every_row_a_family():
    planned = {t for t, f in FAMILIES.items() if f.planner_names} | {"deepseek_v3"}
    assert set(PLANNED) == planned
    for family in PLANNED.values():
        assert (ROOT / family.example).is_file()
        assert set(family.savers) <= set(MEMORY_SAVERS)
        assert list(family.savers) == [s for s in MEMORY_SAVERS if s in family.savers]  # SAVERS order
    assert SAVERS == MEMORY_SAVERS and DEEPSEEK_V3.savers == MEMORY_SAVERS


@pytest.mark.parametrize("model_type", sorted(PLANNED))
def test_the_tiny_preset_is_the_rows(model_type):
    entry, family = FAMILIES[model_type], PLANNED[model_type]
    tiny = entry.load(entry.config_class).preset("tiny")
    experts = getattr(tiny, "num_experts", getattr(tiny, "n_routed_experts", 0))
    layers = getattr(tiny, "num_hidden_layers", getattr(tiny, "n_layers", None))
    assert (family.tiny_experts, family.tiny_layers) == (experts, layers)


def _saved_bytes(model_type: str, savers: frozenset[str]) -> int:
    """Bytes autograd keeps for one forward and loss of the family's tiny model (each storage once)."""
    entry = FAMILIES[model_type]
    config = entry.load(entry.config_class).preset("tiny", memory_savers=savers)
    torch.manual_seed(0)
    model = entry.load(entry.model_class)(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    kept: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    return sum(kept.values())


@pytest.mark.parametrize("model_type", [t for t, f in PLANNED.items() if f.example == FAMILY_EXAMPLE])
def test_a_familys_savers_are_those_that_change_what_its_model_keeps(model_type):
    """A saver the row lists keeps less; every other saver is a switch the family's modules never read, so the
    plan must not offer it (Qwen3-MoE's router keeps nothing more anyway; only MLA has an input to share)."""
    plain = _saved_bytes(model_type, frozenset())
    changes = {s for s in MEMORY_SAVERS if _saved_bytes(model_type, frozenset({s})) != plain}
    assert changes == set(PLANNED[model_type].savers)


def test_the_plans_savers_are_the_familys():
    qwen = PLANNED["qwen3_moe"]
    assert qwen.memory_savers("all") == "norm,swiglu,combine,attention,loss"
    assert qwen.memory_savers("loss,norm") == "norm,loss" and qwen.memory_savers("none") == "none"
    assert qwen.memory_savers("auto") == "auto"
    with pytest.raises(ScheduleError, match=r"memory saver 'mla_input' is not one of Qwen3-MoE's: its modules have "
                                            r"norm, swiglu, combine, attention, loss"):
        qwen.memory_savers("norm,mla_input")
    with pytest.raises(ScheduleError, match="unknown memory saver 'flash'"):
        qwen.memory_savers("flash")
    assert DEEPSEEK_V3.memory_savers("all") == ",".join(SAVERS)


def test_a_model_names_its_family():
    assert family_of(ModelSpec.load("deepseek-v3")) is DEEPSEEK_V3  # MLA: DeepSeek-V3's modules
    dense = ModelSpec(name="gpt", hidden_size=64, head_num=4, layer_num=2, vocab_size=128, intermediate_size=256)
    assert family_of(dense) is DESCRIPTION and "mla_input" not in DESCRIPTION.savers
    qwen = PLANNED["qwen3_moe"]  # a family's spec carries its registry entry's facts, MLA or not
    assert family_of(ModelSpec(name="x", hidden_size=64, head_num=4, layer_num=2, vocab_size=128,
                               intermediate_size=256, facts=qwen)) is qwen
    assert "llava" not in PLANNED  # the planner does not take it: no planner names, no facts


def _launch(**kw) -> dict:
    base = {"pp": 16, "dp": 4, "ep": 8, "tp": 1, "schedule": "zbv", "microbatches": 32, "dp_mode": "zero1",
            "recompute": "full", "schedule_options": {}, "micro_batch_size": 1, "core_attention": "flash",
            "memory_savers": "none"}
    return {**base, **kw}


def test_a_familys_miniature_runs_its_own_example():
    """Qwen3-MoE's miniature: its 4 tiny experts bound ep, its example takes --family, and no --core-attention
    (its modules have one core); a chain longer than the preset is deep gets one layer a stage; a dense family
    keeps ep 1; fsdp runs there (dense), but no example takes tensor parallelism or a searched placement."""
    qwen, llama = PLANNED["qwen3_moe"], PLANNED["llama"]
    small = miniature(_launch(), qwen)
    assert (small["pp"], small["dp"], small["ep"], small["layers"]) == (2, 1, 2, None)
    assert demo_command(small, qwen) == ("python examples/train_family.py --family qwen3_moe --pp 2 --dp 1 --ep 2 "
                                         "--dp-mode zero1 --schedule zbv --recompute full")
    inter = miniature(_launch(schedule="interleaved-1f1b", schedule_options={"virtual_stages": 3}), qwen)
    assert inter["layers"] == 6 and demo_command(inter, qwen).endswith("--virtual-stages 3 --layers 6")
    deep = miniature(_launch(), qwen, keep_pp=True)
    assert (deep["pp"], deep["ep"], deep["layers"], deep["microbatches"]) == (16, 1, 32, 32)
    assert miniature(_launch(ep=1, dp=8), llama)["ep"] == 1
    fsdp = demo_command(miniature(_launch(ep=1, dp=8, dp_mode="fsdp"), llama), llama)
    assert fsdp.startswith("python examples/train_family.py --family llama --pp 2 --dp 2 --ep 1 --dp-mode fsdp")
    assert demo_command(_launch(dp_mode="fsdp"), DEEPSEEK_V3) is None  # the DeepSeek-V3 demo's stages are not
    assert "tp 2" in command_refusal(_launch(tp=2), llama)
    assert "placement" in command_refusal(_launch(schedule="auto", schedule_options={"placement": "v"}), qwen)
    assert "not one of the families" in command_refusal(_launch(), DESCRIPTION)
