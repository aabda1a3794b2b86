"""``mt_dualpipe.models.from_pretrained``: one entry point, the family chosen by ``config.json``'s ``model_type``."""

from __future__ import annotations

import json

import pytest
import torch

from mt_dualpipe.models import FAMILIES, family, from_pretrained
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mt_dualpipe.models.registry import family_entry

torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "qwen3_moe"])
def test_from_pretrained_returns_the_family_of_the_model_type(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig.preset("tiny", num_hidden_layers=2))
    elif kind == "deepseek_v3":
        model = DeepSeekV3Model(DeepSeekV3Config.preset("tiny"))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny"))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == kind
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is type(model) is family(kind)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_unknown_model_type_names_the_registered_ones_and_why_the_adapter_cannot_take_it(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported: it has no native family \(registered: "
                                         r"\['deepseek_v3', 'llama', 'llava', 'qwen3_moe'\]\) and the transformers "
                                         r"adapter cannot take it: GPT2LMHeadModel is not built as embed_tokens"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; registered: \['deepseek_v3', 'llama', "
                                         r"'llava', 'qwen3_moe'\]. Other transformers decoder-only causal LMs load "
                                         r"through the transformers adapter"):
        family_entry("gpt2")  # the planner's lookup: native families only
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained(tmp_path / "nowhere")
    assert set(FAMILIES) >= {"llama", "deepseek_v3", "qwen3_moe"}
