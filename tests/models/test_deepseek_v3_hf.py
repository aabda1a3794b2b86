"""DeepSeek-V3 against Hugging Face transformers: config, checkpoints both ways, logits in float64.

transformers is a test extra: every test here builds a tiny random ``DeepseekV3ForCausalLM`` from a
config written in the test and saves it to ``tmp_path``; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

import mt_dualpipe
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, YarnScaling
from mt_dualpipe.models.deepseek_v3.hf_names import to_hf_name
from tests.helpers.hf_reference import float64_transformers, randomize, relative_error

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

# The released deepseek-ai/DeepSeek-V3 config.json (values as published with the checkpoint).
RELEASED_671B = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def hf_config(yarn: bool = False, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
                max_position_embeddings=2560, attn_implementation="eager", experts_implementation="eager")
    return transformers.DeepseekV3Config(**{**base, **kw})


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def hf_model(config, seed: int = 1):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).double().eval()
    randomize(model, seed)
    return model


# ----- config ---------------------------------------------------------------------------------------------
def test_671b_preset_is_the_released_config():
    released = DeepSeekV3Config.from_hf(RELEASED_671B)
    # config.json carries initializer_range 0.02 and aux_loss_alpha 0.001; the preset keeps the technical
    # report's training values (std 0.006, alpha 1e-4). Every size, routing and rope field is equal.
    assert released == DeepSeekV3Config.preset("671b", init_std=0.02, balance_loss_weight=0.001)
    assert released.rope_scaling == YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert released.max_seq_len == 163840 and released.mtp_depth == 1 and released.n_dense_layers == 3
    back = released.to_hf()
    for key, value in RELEASED_671B.items():
        if key not in ("quantization_config", "torch_dtype"):  # storage: written with the weights
            assert back[key] == value, key
    assert "quantization_config" not in back


def test_to_hf_is_read_by_transformers_as_the_same_model():
    ours = DeepSeekV3Config.from_hf(hf_config(yarn=True).to_dict())
    assert ours.rope_scaling == YarnScaling(40.0, 64, 32.0, 1.0, 0.707, 1.0)
    assert (ours.n_dense_layers, ours.n_expert_groups, ours.n_limited_groups, ours.mtp_depth) == (1, 2, 1, 1)
    theirs = transformers.DeepseekV3Config(**ours.to_hf())
    assert theirs.rope_parameters["rope_type"] == "yarn" and theirs.rope_parameters["factor"] == 40.0
    assert DeepSeekV3Config.from_hf(theirs.to_dict()) == ours
    softmax = DeepSeekV3Config.from_hf({**ours.to_hf(), "scoring_func": "softmax", "topk_method": "greedy",
                                        "norm_topk_prob": False})
    assert (softmax.scoring_func, softmax.topk_method, softmax.norm_topk_prob) == ("softmax", "greedy", False)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "config field hidden_act='gelu' is not supported: this DeepSeek-V3 implementation "
                           "runs hidden_act='silu' only"),
    ("num_key_value_heads", 1, "config field num_key_value_heads=1 is not supported"),
    ("scoring_func", "relu", "scoring_func 'relu' is not supported; choose one of ('sigmoid', 'softmax')"),
    ("topk_method", "top2", "topk_method 'top2' is not supported; choose one of"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope scaling type 'dynamic' is not supported"),
    ("sliding_window", 128, "config field(s) ['sliding_window'] are not supported by the DeepSeek-V3 integration"),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [1, 128]},
     "weight_block_size=[1, 128] is not supported"),
])
def test_unsupported_config_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        DeepSeekV3Config.from_hf({**RELEASED_671B, field: value})


def test_from_hf_reads_a_folder_and_says_when_config_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_671B))
    assert DeepSeekV3Config.from_hf(tmp_path) == DeepSeekV3Config.from_hf(RELEASED_671B)
    with pytest.raises(FileNotFoundError, match="no Hugging Face config at"):
        DeepSeekV3Config.from_hf(tmp_path / "nowhere")


# ----- logits against transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("yarn", [False, True])
def test_transformers_checkpoint_gives_the_same_logits(tmp_path, yarn):
    with float64_transformers():
        hf = hf_model(hf_config(yarn))
        hf.save_pretrained(tmp_path, max_shard_size="20KB")
        with torch.no_grad():
            ref = hf(tokens()).logits
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # sharded, read through the index
    # transformers does not save the MTP layer: load the main model only
    ours = mt_dualpipe.from_pretrained(tmp_path, dtype=torch.float64, mtp_depth=0).eval()  # the one entry point
    assert type(ours) is DeepSeekV3Model
    with torch.no_grad():
        got = ours(tokens())
    assert relative_error(got, ref) < 1e-12
    # with every memory saver on, in a forward that builds the graph (where the savers act), too
    saving = DeepSeekV3Model.from_pretrained(tmp_path, dtype=torch.float64, mtp_depth=0, memory_savers="all")
    assert relative_error(saving.eval()(tokens()).detach(), ref) < 1e-12
    # the flash-style core (q, k, v, output and log-sum-exp kept; a graph-building forward takes it)
    flash = DeepSeekV3Model.from_pretrained(tmp_path, dtype=torch.float64, mtp_depth=0, core_attention="flash")
    assert relative_error(flash.eval()(tokens()).detach(), ref) < 1e-12
    # a yarn model run without yarn is far off: the scaling is really applied
    if yarn:
        plain = DeepSeekV3Model.from_pretrained(tmp_path, dtype=torch.float64, mtp_depth=0, rope_scaling=None)
        with torch.no_grad():
            assert relative_error(plain.eval()(tokens()), ref) > 1e-3


def _our_model(config: DeepSeekV3Config, seed: int = 5) -> DeepSeekV3Model:
    torch.manual_seed(seed)
    model = DeepSeekV3Model(config).double().eval()
    randomize(model, seed)
    return model


@pytest.mark.parametrize("yarn", [False, True])
def test_our_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, yarn):
    config = DeepSeekV3Config.from_hf(hf_config(yarn).to_dict())
    ours = _our_model(config)
    ours.save_pretrained(tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
            "model.layers.3.shared_head.norm.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.mlp.experts.7.down_proj.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(index)
    with float64_transformers():
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
        with torch.no_grad():
            ref = hf(tokens()).logits
            got = ours(tokens())
    assert relative_error(got, ref) < 1e-12


def test_round_trips_are_bit_equal(tmp_path):
    config = DeepSeekV3Config.from_hf(hf_config(True).to_dict())
    ours = _our_model(config)
    ours.save_pretrained(tmp_path / "a")
    back = DeepSeekV3Model.from_pretrained(tmp_path / "a", dtype=torch.float64)
    assert back.config == config
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    # ours -> transformers -> ours (main model: transformers keeps no MTP layer)
    main = _our_model(config.replace(mtp_depth=0))
    main.save_pretrained(tmp_path / "b")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float64)
    pinned = {k for k, v in hf.state_dict().items() if v.dtype == torch.float32}
    assert pinned == {f"model.layers.{i}.mlp.gate.{n}" for i in (1, 2) for n in ("weight", "e_score_correction_bias")}
    hf.save_pretrained(tmp_path / "c")
    again = DeepSeekV3Model.from_pretrained(tmp_path / "c", dtype=torch.float64, mtp_depth=0)
    for k, v in main.state_dict().items():
        w = again.state_dict()[k]
        want = v.float().double() if to_hf_name(k, config) in pinned else v  # transformers' float32 router
        assert w.dtype == v.dtype and torch.equal(w, want), k


def test_mtp_follows_the_released_convention():
    """eh_proj sees [enorm(embedding), hnorm(h)], h being the main model's *normed* output."""
    config = DeepSeekV3Config.from_hf(hf_config().to_dict())
    model = _our_model(config)
    x = tokens()
    nxt = tokens(seed=9)
    mtp = model.mtp[0]
    with torch.no_grad():
        h = model.model.norm(model.hidden(x))[:, :-1]
        emb = model.model.embed_tokens(nxt[:, :-1])
        w = mtp.eh_proj.weight
        proj = mtp.enorm(emb) @ w[:, :32].T + mtp.hnorm(h) @ w[:, 32:].T
        want = model.lm_head(mtp.shared_head.norm(mtp.block(proj)))
        (got,) = model.mtp_logits(x, nxt)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_precision_follows_the_model_dtype():
    """float64 model: RoPE, router scores and softmax in float64 (what lets the logits above agree to
    1e-12); bf16 / fp32 models keep float32 for them."""
    from mt_dualpipe.layers import cos_sin
    from mt_dualpipe.models.deepseek_v3.mla import compute_dtype
    from mt_dualpipe.models.deepseek_v3.moe import router

    config = DeepSeekV3Config.from_hf(hf_config(True).to_dict())
    assert [compute_dtype(torch.zeros(1, dtype=d)) for d in (torch.float64, torch.float32, torch.bfloat16)] == \
        [torch.float64, torch.float32, torch.float32]
    cos, _ = cos_sin(8, 8, config.rope_spec, torch.float64)
    assert cos.dtype == torch.float64
    gate = router(config)
    torch.nn.init.normal_(gate.weight)
    for dtype, want in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
        weights, _, scores = gate.to(dtype)(torch.randn(4, 32, dtype=dtype))
        assert scores.dtype == want and weights.dtype == want
