"""LLaVA on the shared model layer against transformers' ``LlavaForConditionalGeneration`` (float64, tiny
configs, CLIP and SigLIP towers, every checkpoint key layout), per-stage loading, the batch layout, frozen
vision parameters, the planner's spec and the balanced layout. Multi-process runs: ``test_llava_dist.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import mt_dualpipe.models.hf_checkpoint as hf_checkpoint
from mt_dualpipe.layers import RopeSpec
from mt_dualpipe.models import from_pretrained
from mt_dualpipe.models.llava import (
    KeyLayout,
    LlavaConfig,
    LlavaForConditionalGeneration,
    balanced_layout,
    build_stages,
    image_counts,
    next_token_labels,
    stages_for_rank,
)
from mt_dualpipe.schedules import placements
from tests.helpers import hf_reference
from tests.helpers.hf_reference import float64_transformers, randomize, recorded_reads, relative_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VISION_MODULES = ("transformers.models.clip.modeling_clip", "transformers.models.siglip.modeling_siglip")


@pytest.fixture(autouse=True)
def _float64_towers(monkeypatch):
    monkeypatch.setattr(hf_reference, "MODULES", hf_reference.MODULES + VISION_MODULES)


def batch(config: LlavaConfig, counts=(1, 0, 2), seq: int = 15, seed: int = 3):
    """Token rows holding ``counts[b]`` images each (right after token 0), right-padded with 0 by b tokens,
    and the padded-slot pixels (batch, max_images, C, H, W); padding slots hold noise (never read)."""
    g = torch.Generator().manual_seed(seed)
    T, image = config.tokens_per_image, config.image_token_id
    tokens = torch.randint(1, image, (len(counts), seq + 1), generator=g)
    for b, k in enumerate(counts):
        tokens[b, 1:1 + k * T] = image
        if b:
            tokens[b, -b:] = 0
    v = config.vision
    pixels = torch.randn(len(counts), max(counts), v.num_channels, v.image_size, v.image_size, generator=g,
                         dtype=torch.float64)
    return tokens, pixels


def flat_images(tokens: torch.Tensor, pixels: torch.Tensor, config: LlavaConfig) -> torch.Tensor:
    """transformers' layout: the real images only, in sample order."""
    counts = image_counts(tokens, config.image_token_id, config.tokens_per_image)
    return torch.cat([pixels[b, :k] for b, k in enumerate(counts.tolist())])


def hf_model(config: LlavaConfig, seed: int = 1):
    hf_config = transformers.LlavaConfig(**{**config.to_hf(), "attn_implementation": "eager"})
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(hf_config).double().eval()
    randomize(model, seed)
    return model


def hub_layout(src, dst) -> None:
    """The hub's older layout: ``transformers``' default save with ``vision_tower.vision_model.*``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def names(path) -> list[str]:
    return hf_checkpoint.Checkpoint(path).names()


LLAMA3 = RopeSpec(10000.0, "llama3", (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                         ("original_max_position_embeddings", 8)))


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
@pytest.mark.parametrize("tower, tied", [("clip", False), ("siglip", True)])
def test_transformers_checkpoints_in_every_layout_give_the_same_logits_and_back(tmp_path, tower, tied):
    """CLIP: untied head, plain RoPE; SigLIP: tied embeddings, Llama-3 RoPE scaling."""
    config = LlavaConfig.preset("tiny", tower=tower, tie_word_embeddings=tied,
                                text={"rope": LLAMA3} if tower == "siglip" else {})
    tokens, pixels = batch(config)
    with float64_transformers():
        hf = hf_model(config)
        hf.save_pretrained(tmp_path / "default")  # transformers 5's default: language_model.model.*, vision_tower.*
        hf.save_pretrained(tmp_path / "v5", save_original_format=False)  # model.language_model.*, lm_head.*
        with torch.no_grad():
            ref = hf(input_ids=tokens, pixel_values=flat_images(tokens, pixels, config)).logits
    hub_layout(tmp_path / "default", tmp_path / "hub")
    assert any(n.startswith("language_model.model.") for n in names(tmp_path / "default"))
    assert any(n.startswith("vision_tower.vision_model.") for n in names(tmp_path / "hub"))
    assert any(n.startswith("model.vision_tower.") for n in names(tmp_path / "v5"))
    errors = {}
    for layout in ("default", "hub", "v5"):
        ours = from_pretrained(tmp_path / layout, dtype=torch.float64).eval()
        assert isinstance(ours, LlavaForConditionalGeneration) and ours.config == config
        with torch.no_grad():
            errors[layout] = relative_error(ours(tokens, pixels), ref)
    print(f"llava ({tower}) logits max relative error vs transformers (float64): {errors}")
    assert max(errors.values()) < 1e-12, errors
    # ours -> transformers 5's layout -> transformers: the same logits; -> ours: bit-equal
    ours.save_pretrained(tmp_path / "ours", max_shard_size=20_000)
    saved = names(tmp_path / "ours")
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in saved if n.startswith("model.")} == \
        {"model.vision_tower", "model.multi_modal_projector", "model.language_model"}
    assert ("lm_head.weight" in saved) is not tied and not any(n.startswith("language_model.") for n in saved)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "llava"
    with float64_transformers():
        again = transformers.LlavaForConditionalGeneration.from_pretrained(
            tmp_path / "ours", dtype=torch.float64, attn_implementation="eager").eval()
        with torch.no_grad():
            err = relative_error(again(input_ids=tokens, pixel_values=flat_images(tokens, pixels, config)).logits, ref)
    assert err < 1e-12, err
    back = from_pretrained(tmp_path / "ours", dtype=torch.float64)
    assert back.config == config
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_key_layouts_map_each_part():
    old = KeyLayout.detect(["language_model.model.norm.weight", "language_model.lm_head.weight",
                            "vision_tower.vision_model.post_layernorm.weight", "multi_modal_projector.linear_1.weight"])
    assert old.to_checkpoint("model.language_model.layers.3.mlp.up_proj.weight") == \
        "language_model.model.layers.3.mlp.up_proj.weight"
    assert old.to_checkpoint("lm_head.weight") == "language_model.lm_head.weight"
    assert old.to_checkpoint("model.vision_tower.encoder.layers.0.mlp.fc1.bias") == \
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.bias"
    assert old.to_checkpoint("model.multi_modal_projector.linear_2.bias") == "multi_modal_projector.linear_2.bias"
    ours = KeyLayout.ours()
    assert ours.to_checkpoint("model.vision_tower.embeddings.class_embedding") == \
        "model.vision_tower.embeddings.class_embedding"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny CLIP LLaVA of ours, saved in the hub's older layout (so per-stage reads go through the mapping)."""
    config = LlavaConfig.preset("tiny")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).double()
    path = tmp_path_factory.mktemp("llava")
    layout = KeyLayout.detect(["language_model.model.x", "language_model.lm_head.x", "vision_tower.vision_model.x",
                               "multi_modal_projector.x"])
    tensors = {layout.to_checkpoint(k): v.contiguous() for k, v in model.state_dict().items()}
    hf_checkpoint.save_tensors(tensors, path, config.to_hf(), max_shard_size=20_000)
    return config, model, path


def test_stages_read_only_their_tensors_and_match_the_model(saved):
    config, model, path = saved
    place = placements.make_placement("v", 2, 4)
    by_rank = []
    with recorded_reads() as read:
        for r in range(2):
            before = len(read)
            by_rank.append(stages_for_rank(config, place, r, checkpoint=path, dtype=torch.float64))
            if r == 1:  # stages 1 and 2: text layers only
                assert read[before:] and all(n.startswith("language_model.model.layers.") for n in read[before:])
    every = [st for mods in by_rank for st in mods]
    layout = KeyLayout.detect(names(path))
    assert sorted(read) == sorted(layout.to_checkpoint(k) for st in every for k in st.state_dict())
    assert len(read) == len(set(read)) == len(names(path))
    stages = sorted(every, key=lambda st: st.index)
    assert stages[0].is_first and hasattr(stages[0].model, "vision_tower")
    assert not any(hasattr(st.model, "vision_tower") for st in stages[1:])
    tokens, pixels = batch(config)
    x, y = next_token_labels(tokens, config.image_token_id, config.text.pad_token_id)
    h = stages[0](x, pixels)
    for st in stages[1:-1]:
        h = st(h)
    assert torch.equal(stages[-1].criterion(stages[-1](h), y), model(x, pixels, y))


def test_pipeline_save_round_trips(saved, tmp_path):
    from mt_dualpipe.models.llava import save_pipeline_checkpoint

    config, model, path = saved
    stages = build_stages(config, 3, checkpoint=path, dtype=torch.float64)
    out = save_pipeline_checkpoint(stages, tmp_path / "again")
    assert all(n.startswith(("model.", "lm_head.")) for n in names(out))  # transformers 5's layout
    back = from_pretrained(out, dtype=torch.float64)
    assert back.config == config and back.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_unused_vision_parameters_are_frozen_and_the_used_ones_get_gradients(tower):
    config = LlavaConfig.preset("tiny", tower=tower)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).double()
    torch.manual_seed(0)
    again = LlavaForConditionalGeneration(config).double()
    for k, v in model.state_dict().items():  # every tensor initialised (none left as empty memory)
        assert torch.equal(again.state_dict()[k], v) and bool(torch.isfinite(v).all()), k
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    expected = {"model.vision_tower.post_layernorm."}
    if tower == "clip":  # vision_feature_layer -2 of 3 layers: layer 2 never runs
        expected.add("model.vision_tower.encoder.layers.2.")
    else:  # -1: every layer runs; the attention-pooling head never does
        expected.add("model.vision_tower.head.")
    assert {next(e for e in expected if n.startswith(e)) for n in frozen} == expected
    tokens, pixels = batch(config)
    x, y = next_token_labels(tokens, config.image_token_id, 0)
    model(x, pixels, y).backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n in frozen), n


def test_batch_layout_splits_by_sample_and_ignores_padding_slots():
    config = LlavaConfig.preset("tiny")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).double().eval()
    tokens, pixels = batch(config, counts=(2, 0, 1, 2))
    x = tokens[:, :-1]
    assert image_counts(x, config.image_token_id, config.tokens_per_image).tolist() == [2, 0, 1, 2]
    with torch.no_grad():
        whole = model(x, pixels)
        noisy = pixels.clone()
        noisy[1] = 1e6  # sample 1 has no image and sample 2 one: their other slots are padding
        noisy[2, 1] = -1e6
        assert torch.equal(model(x, noisy), whole)
        parts = [model(xm, pm) for xm, pm in zip(torch.tensor_split(x, 3), torch.tensor_split(pixels, 3))]
    assert relative_error(torch.cat(parts), whole) < 1e-14
    with pytest.raises(ValueError, match="not multiples of the 4 tokens"):
        model(x[:, 2:], pixels)
    with pytest.raises(ValueError, match="2 images' worth of image tokens but pixel_values has 1 slots"):
        model(x, pixels[:, :1])
    with pytest.raises(ValueError, match="no pixel_values"):
        model(x)
    labels = next_token_labels(tokens, config.image_token_id, 0)[1]
    assert not bool(((labels == config.image_token_id) | (labels == 0)).any())


@pytest.mark.parametrize("field, value, match", [
    ("vision_feature_layer", [-2, -1], "a list of layers"),
    ("vision_feature_select_strategy", "cls", "vision_feature_select_strategy"),
    ("projector_hidden_act", "swish", "projector_hidden_act"),
    ("vision_config.model_type", "dinov2", "dinov2"),
    ("vision_config.hidden_act", "relu", "vision hidden_act"),
    ("vision_config.attention_dropout", 0.1, "attention_dropout"),
    ("text_config.model_type", "mistral", "mistral"),
    ("text_config.attention_bias", True, "attention_bias"),
    ("text_config.rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("ignore_index", -1, "ignore_index"),
])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    data = LlavaConfig.preset("tiny").to_hf()
    assert LlavaConfig.from_hf(data) == LlavaConfig.preset("tiny")
    part, _, key = field.rpartition(".")
    (data[part] if part else data)[key] = value
    with pytest.raises(ValueError, match=match):
        LlavaConfig.from_hf(data)


# llava-hf/llava-1.5-7b-hf's config.json as published: most sizes left to the sub-configs' defaults
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_the_published_llava_15_7b_config_gives_its_sizes():
    from mt_dualpipe.models.llava.spec import planner_spec

    config = LlavaConfig.from_hf(LLAVA_15_7B)
    assert config.tokens_per_image == 576 and config.vision_layers_used == 23
    assert (config.text.hidden_size, config.text.num_hidden_layers, config.text.head_dim) == (4096, 32, 128)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    assert model.num_parameters() == 7_063_427_072  # llava-1.5-7b-hf's safetensors hold 7.06 B
    frozen = model.num_parameters() - model.num_parameters(trainable_only=True)
    assert frozen == 12_596_224 + 2 * 1024  # CLIP layer 23 and post_layernorm: built, never run
    assert planner_spec(config).total_params() == model.num_parameters(trainable_only=True)


def one_stage_grads(**kwargs):
    """The tiny model as one float64 stage built with ``kwargs``, one forward and backward on ``batch``: the
    stage and its parameters' gradients."""
    config = LlavaConfig.preset("tiny")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).double()
    tokens, pixels = batch(config)
    x, y = next_token_labels(tokens, config.image_token_id, 0)
    (st,) = build_stages(config, 1, source=model, dtype=torch.float64, defer_weight_grads=False, **kwargs)
    st.criterion(st(x, pixels), y).backward()
    return st, {n: p.grad for n, p in st.named_parameters() if p.grad is not None}


def test_recompute_policies_give_the_same_gradients():
    """"selective" and "full" (the vision layers' regions included) give the same gradients as "none"."""
    grads = {}
    for policy in ("none", "selective", "full"):
        st, grads[policy] = one_stage_grads(recompute=policy)
        if policy != "none":
            assert any("vision" in tag for tag in st.recompute_calls)
    for policy in ("selective", "full"):
        assert grads[policy].keys() == grads["none"].keys()
        for n, g in grads["none"].items():
            assert torch.allclose(grads[policy][n], g, rtol=0, atol=1e-13), (policy, n)


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
def test_compiled_stages_give_the_same_gradients():
    """``compile=`` (aot_eager) compiles every text layer's parts (the tower stays eager) and gives eager's
    gradients; the compiled regions are the shared ``DecoderStage.compile_targets``."""
    from mt_dualpipe.models.compile import compiled_targets

    torch._dynamo.reset()
    grads = {}
    for compile in (False, "aot_eager"):
        st, grads[compile] = one_stage_grads(compile=compile)
        if compile:
            compiled = compiled_targets(st)
            assert len(compiled) == 4 * st.config.num_hidden_layers + 1  # 2 norms, attention, MLP per layer; the norm
            assert not any(m is st.model.vision_tower or m in list(st.model.vision_tower.modules()) for m in compiled)
    assert grads["aot_eager"].keys() == grads[False].keys()
    for n, g in grads[False].items():
        assert torch.allclose(grads["aot_eager"][n], g, rtol=1e-12, atol=1e-14), n


def test_planner_spec_counts_the_vision_encoder_on_the_first_item():
    from mt_dualpipe.models.llava.spec import planner_spec

    for tower in ("clip", "siglip"):
        config = LlavaConfig.preset("tiny", tower=tower)
        model = LlavaForConditionalGeneration(config)
        spec = planner_spec(config, images_per_sample=2)
        assert spec.total_params() == model.num_parameters(trainable_only=True)
        no_images, two = planner_spec(config, 0).items(64), spec.items(64)
        assert two[0].name == "embedding+vision" and two[1:] == no_images[1:]
        assert two[0].mm_flops > no_images[0].mm_flops and two[0].attn_flops > 0
        assert two[0].params - spec.text_spec().items(64)[0].params == spec.vision.params
        assert spec.flops_per_token(64) > planner_spec(config, 1).flops_per_token(64)
    # the planner's own stage cut (LLaVA-1.5-7B's sizes, the defaults): 8 images per sequence move layers off stage 0
    from mt_dualpipe.planner import PRESETS, Strategy
    from mt_dualpipe.planner.estimate import stage_items

    strategy = Strategy(pp=4, schedule="1f1b", num_microbatches=8, seq_len=2048)
    cuts = {k: [len(s) for s in stage_items(planner_spec(LlavaConfig(), k), strategy, PRESETS["h100"])]
            for k in (0, 8)}
    assert cuts[8][0] < cuts[0][0], cuts


def test_balanced_layout_gives_stage_0_fewer_text_layers_when_the_encoder_is_heavy():
    """8 text layers over 2 stages; the encoder (4 layers of width 32 on 17 positions per image) weighs more
    the more images a sample holds. A V placement puts stages 0 and 3 on rank 0: both shrink."""
    config = LlavaConfig.preset("tiny", text={"num_hidden_layers": 8},
                                vision={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                                        "image_size": 16})
    layouts = [balanced_layout(config, 2, seq_len=64, images_per_sample=k) for k in (0, 2, 4)]
    assert layouts == [[4, 4], [3, 5], [2, 6]]
    v = placements.make_placement("v", 2, 4).ranks
    assert balanced_layout(config, v, seq_len=64, images_per_sample=0) == [2, 2, 2, 2]
    assert balanced_layout(config, v, seq_len=64, images_per_sample=4) == [1, 3, 3, 1]
    sched = type("Linear2", (), {"num_stages": 2, "placement": ((0, 1),), "local_stages": lambda self, r: [(0, r)]})()
    (first,) = stages_for_rank(config, sched, 0, layout="balanced", seq_len=64, images_per_sample=4)
    assert list(first.model.language_model.layers) == ["0", "1"] and hasattr(first.model, "vision_tower")


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_planner_counts_what_the_vision_modules_declare_and_autograd_keeps(tower, policy):
    """The planner's saved elements per image (``spec.vision_costs``) are the tower's and the projector's
    declarations; against what autograd keeps running them on 3 images (float32): equal."""
    from mt_dualpipe.models.llava.model import LlavaBody, init_llava
    from mt_dualpipe.models.llava.spec import vision_costs
    from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute

    config = LlavaConfig.preset("tiny", tower=tower, vision={"hidden_size": 64, "intermediate_size": 128,
                                                             "num_hidden_layers": 4, "image_size": 32,
                                                             "patch_size": 8, "num_attention_heads": 4})
    torch.manual_seed(0)
    body = LlavaBody(config, [], vision=True, embed=True, norm=False)
    init_llava(body, config)
    apply_recompute(body, policy)
    meter = SavedActivationMeter(exclude=list(body.parameters()))
    with meter.measure():
        features = body.vision_tower(torch.randn(3, 3, 32, 32))
        if config.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        body.multi_modal_projector(features)
    planned = vision_costs(config).saved_elements(policy) * 4 * 3
    print(f"{tower} {policy}: planner {planned:.0f} B, autograd {meter.peak} B")
    assert planned == pytest.approx(meter.peak, rel=1e-9)


def test_the_stage_cut_is_the_planners_with_a_layer_on_every_stage():
    """One stage-cut search: LLaVA's layout is ``planner.stage_cut.balance`` on its planner model, each stage
    keeping a text layer when there are enough (and the cut refuses a minimum the model cannot meet)."""
    from mt_dualpipe.models.llava import balanced_layout
    from mt_dualpipe.models.llava.spec import planner_spec
    from mt_dualpipe.planner.stage_cut import balance
    from mt_dualpipe.schedules import build_schedule

    config = LlavaConfig.preset("tiny")
    spec = planner_spec(config, 1.0)
    for name, ranks in (("1f1b", 2), ("zbv", 2), ("1f1b", 4)):
        placement = build_schedule(name, ranks, 2 * ranks).placement
        got = balanced_layout(config, placement)
        want = balance(spec, placement, config.text.max_position_embeddings, min_blocks=1).counts
        assert got == list(want) and min(got) >= 1 and sum(got) == config.num_hidden_layers
    with pytest.raises(ValueError, match=r"8 stages of at least 1 block\(s\) need more than the model's 4"):
        balance(spec, build_schedule("zbv", 4, 8).placement, 256, min_blocks=1)
