"""The transformers adapter in one process: ``mt_dualpipe.from_pretrained`` for models without a native family,
its stages (from a model, or per stage from the checkpoint transformers wrote, converted as transformers converts
it), saving back, the one stage entry for every family, and the refusals with their reasons. The pipelined
steps against transformers are ``test_transformers_adapter_dist.py``."""

from __future__ import annotations

import json

import pytest
import torch

import mt_dualpipe
from mt_dualpipe.models.hf_checkpoint import save_pipeline_checkpoint
from mt_dualpipe.models.transformers_adapter import AdaptedCausalLM, AdaptedStage, AdapterError, build_stages
from mt_dualpipe.schedules import placements
from mt_dualpipe.schedules.registry import build_schedule
from tests.helpers import hf_adapter
from tests.helpers.hf_reference import recorded_reads

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

DOCS = 'docs/models.md, section "Any transformers decoder-only model"'


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Family name -> the folder transformers wrote its tiny model to."""
    return {name: hf_adapter.save_tiny(name, tmp_path_factory.mktemp(name)) for name in hf_adapter.FAMILIES}


def load(name, folder):
    return mt_dualpipe.from_pretrained(folder, dtype=torch.float64, **hf_adapter.FAMILIES[name][2])


def chain_logits(stages, x):
    h = x
    for st in stages[:-1]:
        h = st(h)
    return stages[-1].head_logits(stages[-1](h))


@pytest.mark.kernels
@pytest.mark.parametrize("name", list(hf_adapter.FAMILIES))
def test_from_pretrained_adapts_a_model_without_a_native_family(saved, name):
    model = load(name, saved[name])
    assert type(model) is AdaptedCausalLM and model.config.model_type == name
    ref = hf_adapter.load_reference(name, saved[name])
    x, y = hf_adapter.batch(ref.config.pad_token_id)
    with torch.no_grad():
        want = ref(x).logits
        assert torch.equal(model(x), want)  # the same modules, the same ops: bit-equal
        stages = mt_dualpipe.stages_for_rank(model, placements.make_placement("v", 2, 1), 0) + \
            mt_dualpipe.stages_for_rank(model, placements.make_placement("v", 2, 1), 1)
        stages.sort(key=lambda st: st.index)
        assert [type(st) for st in stages] == [AdaptedStage] * 4
        assert torch.equal(chain_logits(stages, x), want)
        assert float(model(x, y)) == pytest.approx(
            float(torch.nn.functional.cross_entropy(want.flatten(0, 1), y.flatten())), rel=1e-14)
    assert model.check_against_transformers() == 0.0


@pytest.mark.parametrize("name, placement", [("mixtral", "linear"), ("gemma3_text", "v"), ("qwen2", "dual")])
def test_stages_read_only_their_tensors_and_write_them_back_as_transformers_does(saved, tmp_path, name, placement):
    """Mixtral's checkpoint holds one tensor per expert, its modules one fused tensor: each stage reads exactly
    the names that feed its modules, converted by transformers' own table; saved back per stage, the folder
    loads into transformers with the same logits. Gemma3 and Qwen2 are tied (the last stage reads the
    embedding for its head)."""
    model = load(name, saved[name])
    place = placements.make_placement(placement, 2, 4)
    with recorded_reads() as read:
        by_rank = [mt_dualpipe.stages_for_rank(saved[name], place, r, dtype=torch.float64,
                                               **hf_adapter.FAMILIES[name][2]) for r in range(2)]
    every = [st for mods in by_rank for st in mods]  # dual: each stage twice
    assert sorted(read) == sorted(k for st in every for k in st.hf_state_dict())
    if name == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in read
        assert "model.layers.0.mlp.experts.gate_up_proj" in dict(every[0].named_parameters())
    stages = sorted({st.index: st for st in every}.values(), key=lambda st: st.index)
    from_model = build_stages(model.config, len(stages), source=model)
    for a, b in zip(stages, from_model):
        assert {k: v for k, v in a.state_dict().items()}.keys() == b.state_dict().keys()
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    x, _ = hf_adapter.batch(model.config.hf.pad_token_id)
    ref = hf_adapter.load_reference(name, saved[name])
    with torch.no_grad():
        want = ref(x).logits
        assert torch.equal(chain_logits(stages, x), want)
    save_pipeline_checkpoint(stages, tmp_path / "stages")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stages", dtype=torch.float64,
                                                             **hf_adapter.FAMILIES[name][2])
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)


def test_save_pretrained_round_trips(saved, tmp_path):
    model = load("gemma3_text", saved["gemma3_text"])
    model.save_pretrained(tmp_path)
    back = mt_dualpipe.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.state_dict().keys() == back.state_dict().keys()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    x, _ = hf_adapter.batch(0)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_a_transformers_model_is_adapted_by_the_stage_entry(saved):
    ref = hf_adapter.load_reference("olmo2", saved["olmo2"])
    stages = mt_dualpipe.stages_for_rank(ref, placements.make_placement("linear", 1, 2), 0)
    x, y = hf_adapter.batch(0)
    with torch.no_grad():
        assert torch.equal(chain_logits(stages, x), ref(x).logits)
    assert mt_dualpipe.criterion_for(stages) == stages[-1].criterion
    assert all(p.dtype == torch.float64 for st in stages for p in st.parameters())  # the model's dtype


def test_native_families_stay_native_through_the_one_entry(tmp_path):
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
    from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM, LlamaStage

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig.preset("tiny", num_hidden_layers=2, vocab_size=64, hidden_size=32,
                                                intermediate_size=48)).double()
    llama.save_pretrained(tmp_path)
    assert type(mt_dualpipe.from_pretrained(tmp_path)) is LlamaForCausalLM
    place = placements.make_placement("linear", 2, 1)
    x = torch.randint(0, 64, (2, 9))
    for source in (llama, tmp_path):  # a model (its dtype), or the checkpoint folder (per stage)
        stages = [st for r in range(2) for st in mt_dualpipe.stages_for_rank(
            source, place, r, **({} if source is llama else {"dtype": torch.float64}))]
        assert [type(st) for st in stages] == [LlamaStage] * 2
        assert all(p.dtype == torch.float64 for st in stages for p in st.parameters())
        with torch.no_grad():
            assert torch.equal(chain_logits(stages, x), llama(x))
    deepseek = DeepSeekV3Model(DeepSeekV3Config.preset("tiny")).double()  # its stages take no dtype: recast
    stages = mt_dualpipe.stages_for_rank(deepseek, build_schedule("1f1b", 1, 2), 0)
    assert type(stages[0]).__name__ == "DeepSeekV3Stage"
    assert all(torch.equal(v, deepseek.state_dict()[k]) for k, v in stages[0].state_dict().items())
    with pytest.raises(TypeError, match="stages_for_rank takes a model from mt_dualpipe.from_pretrained"):
        mt_dualpipe.stages_for_rank(torch.nn.Linear(2, 2), place, 0)


@pytest.mark.parametrize("config, reason", [
    ({"model_type": "bart"}, "'bart' is an encoder-decoder model"),
    ({"model_type": "gpt2"}, "GPT2LMHeadModel is not built as embed_tokens -> layers -> norm (transformers' "
                             "base_model_pp_plan for it: none)"),
    ({"model_type": "qwen3_next"}, "it has layers of type ['linear_attention']; the adapter rebuilds the masks of "
                                   "['full_attention', 'sliding_attention'] layers only"),
    ({"model_type": "gemma3"}, "it is a multimodal model (the adapter takes its text decoder's own checkpoint, "
                               "text_config)"),
    ({"model_type": "mixtral", "output_router_logits": True}, "it uses output_router_logits=True"),
    ({"model_type": "no_such_model"}, f"transformers {transformers.__version__} does not know model_type "
                                      "'no_such_model'"),
])
def test_a_model_the_adapter_cannot_take_is_refused_with_the_reason(tmp_path, config, reason):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        mt_dualpipe.from_pretrained(tmp_path)
    message = str(info.value)
    assert message.startswith(f"model_type {config['model_type']!r} is not supported: it has no native family "
                              "(registered: ['deepseek_v3', 'llama', 'llava', 'qwen3_moe']) and the transformers "
                              f"adapter cannot take it: {reason}")
    assert message.endswith("It takes transformers' decoder-only causal LMs built as embed_tokens -> layers -> norm "
                            f"whose layers use full or sliding-window attention; see {DOCS}")


def test_the_load_time_check_catches_what_the_adapter_does_not_rebuild(saved):
    """Mistral's window is 4 tokens: a stage that built full causal masks instead would differ from transformers'
    forward on the 16 checked tokens, and the check says so."""
    model = load("mistral", saved["mistral"])
    model.layer_inputs.types = {i: "full_attention" for i in model.layer_inputs.types}
    with pytest.raises(AdapterError, match=r"the adapter's logits for MistralForCausalLM differ from transformers' "
                                           r"own forward by [0-9.e-]+ \(relative; rounding allows 0.0001\): its body "
                                           "does something the adapter does not rebuild; see docs/models.md"):
        model.check_against_transformers()


def test_recompute_and_compile_are_refused(saved):
    model = load("qwen2", saved["qwen2"])
    with pytest.raises(AdapterError, match=r"recompute='full', compile=False: an adapted transformers model runs "
                                           r"its own modules as they are \(recompute='none', compile=False\)"):
        build_stages(model.config, 2, source=model, recompute="full")


def test_split_model_on_transformers_layers_points_at_the_adapter(saved):
    from mt_dualpipe import split_model
    from mt_dualpipe.runtime.errors import PipelineError

    ref = hf_adapter.load_reference("qwen2", saved["qwen2"])
    with pytest.raises(PipelineError, match=r"split_model got transformers' Qwen2DecoderLayer, whose forward takes "
                                            r"attention_mask, position_ids, position_embeddings from the model's "
                                            r"body, .* mt_dualpipe.stages_for_rank\(model, schedule, rank\)"):
        split_model(ref.model.layers, "zbv", 0, 2)
    with pytest.raises(PipelineError, match="split_model takes a stack of layers .*, got a Qwen2ForCausalLM; build "
                                            "the stages from the whole model instead"):
        split_model(ref, "zbv", 0, 2)


def test_config_round_trips_through_transformers_fields(saved):
    from mt_dualpipe.models.transformers_adapter import AdaptedConfig

    config = load("gemma3_text", saved["gemma3_text"]).config
    again = AdaptedConfig.from_hf(config.to_hf())
    assert again.to_hf() == config.to_hf()
    assert (again.num_hidden_layers, again.tie_word_embeddings, again.vocab_size) == (4, True, hf_adapter.VOCAB)


MORE = {  # model_type: config fields beyond the small sizes (what makes each family differ from Llama)
    "qwen3": {},  # q/k norms
    "gemma2": {"head_dim": 8, "sliding_window": 4, "attn_implementation": "eager"},  # attention softcap, windows
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5},
    "cohere": {"logit_scale": 0.5},  # parallel attention and MLP, layer norms
    "starcoder2": {"sliding_window": 4},  # biased projections, a window on every layer
    "qwen2_moe": {"experts_implementation": "eager"},  # experts with a shared expert
}


@pytest.mark.parametrize("model_type", list(MORE))
def test_more_families_match_transformers_stage_by_stage(model_type):
    """Beyond the six pipelined families: the stages of a transformers model (random weights, 16 tokens, longer
    than the windows) give transformers' own logits, the body's and the head's scalings included."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.helpers.hf_reference import randomize

    fields = dict(MORE[model_type])
    options = {k: fields.pop(k) for k in ("attn_implementation", "experts_implementation") if k in fields}
    small = {k: v for k, v in hf_adapter.hf_config("olmo2").to_dict().items()
             if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**small, **fields),
                                                       dtype=torch.float64, **options).eval()
    randomize(lm, 1)
    place = placements.make_placement("linear", 4, 1)
    stages = [st.eval() for r in range(4) for st in mt_dualpipe.stages_for_rank(lm, place, r)]
    x = torch.randint(0, hf_adapter.VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(chain_logits(stages, x), lm(x).logits)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3_text"])
def test_adapted_stages_take_packed_documents_as_transformers_does(saved, name):
    """Position ids as the stages' second input: each stage hands them on, rebuilds its rotary positions from
    them, and transformers' own masks keep attention inside each document (a new one where the ids do not count
    up by one) under full and sliding-window layers. Against transformers given the same position ids (its packed
    path: no attention mask, no cache) and, per document, transformers run on that document alone."""
    model = load(name, saved[name])
    ref = hf_adapter.load_reference(name, saved[name])
    x, _ = hf_adapter.batch(None)
    lengths = (5, 4, 3)  # three documents per row, the first longer than Mistral's and Gemma3's window of 4
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(x.shape[0], -1).contiguous()
    stages = sorted((st for r in range(2) for st in mt_dualpipe.stages_for_rank(
        model, placements.make_placement("v", 2, 1), r)), key=lambda st: st.index)
    with torch.no_grad():
        h, p = stages[0](x, positions)
        for st in stages[1:]:
            h, p = st(h, p)
        assert torch.equal(p, positions.to(p.dtype))
        got = stages[-1].head_logits(h)
        want = ref(x, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        start = 0
        for n in lengths:  # the same as each document alone: float64 GEMMs of another length round differently, a
            # few units of 2**-52 per layer on logits of order 10 over 4 layers: 1e-13 absolute
            alone = ref(x[:, start:start + n], use_cache=False).logits
            torch.testing.assert_close(got[:, start:start + n], alone, rtol=1e-13, atol=1e-13)
            start += n
