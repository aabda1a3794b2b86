"""Llama 3 family: sizes, transformers equality in float64, checkpoints, stages for any placement, FP8."""

from __future__ import annotations

import json

import pytest
import torch

import mt_dualpipe
from mt_dualpipe.fp8 import FP8Linear, dequantize, quantize_blocks
from mt_dualpipe.models.llama import (
    Llama3RopeScaling,
    LlamaConfig,
    LlamaForCausalLM,
    build_stages,
    criterion_for,
    save_pipeline_checkpoint,
    stages_for_rank,
    sync_replicas,
)
from mt_dualpipe.schedules import placements
from tests.helpers.hf_reference import float64_transformers, randomize, recorded_reads, relative_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(tie: bool = False, scaled: bool = True):
    rope = dict(LLAMA3) if scaled else {"rope_type": "default", "rope_theta": 10000.0}
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                                    max_position_embeddings=256, tie_word_embeddings=tie, attn_implementation="eager")


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(seed))


def test_8b_preset_has_8_03_billion_parameters_on_meta():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.preset("8b"))
    assert model.num_parameters() == 8_030_261_248
    layer = model.model.layers["0"]
    assert layer.self_attn.k_proj.weight.shape == (1024, 4096) and layer.mlp.up_proj.weight.shape == (14336, 4096)
    assert LlamaConfig.preset("8b").rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_config_round_trip_and_errors():
    ours = LlamaConfig.from_hf(hf_config().to_dict())
    assert ours.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 16) and ours.num_key_value_heads == 2
    assert LlamaConfig.from_hf(transformers.LlamaConfig(**ours.to_hf()).to_dict()) == ours
    with pytest.raises(ValueError, match="config field mlp_bias=True is not supported"):
        LlamaConfig.from_hf({**ours.to_hf(), "mlp_bias": True})
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported for Llama"):
        LlamaConfig.from_hf({**ours.to_hf(), "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"must be a multiple of num_key_value_heads \(3\)"):
        LlamaConfig.preset("tiny", num_key_value_heads=3)


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
@pytest.mark.parametrize("tie, scaled", [(False, True), (True, False)])
def test_transformers_checkpoint_gives_the_same_logits_and_back(tmp_path, tie, scaled):
    with float64_transformers():
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(hf_config(tie, scaled)).double().eval()
        randomize(hf, 1)
        hf.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
        with torch.no_grad():
            ref = hf(tokens()).logits
    ours = mt_dualpipe.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()  # the one entry point
    assert type(ours) is LlamaForCausalLM
    assert ("lm_head.weight" in dict(ours.named_parameters())) is not tie
    with torch.no_grad():
        assert relative_error(ours(tokens()), ref) < 1e-12
    # ours -> transformers: same logits; ours -> HF layout -> ours: bit-equal
    ours.save_pretrained(tmp_path / "ours", max_shard_size=30_000)
    with float64_transformers():
        again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64,
                                                              attn_implementation="eager").eval()
        with torch.no_grad():
            assert relative_error(again(tokens()).logits, ref) < 1e-12
    back = LlamaForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.fixture
def saved(tmp_path):
    config = LlamaConfig.preset("tiny", num_hidden_layers=4, vocab_size=128, hidden_size=64, intermediate_size=96)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size=60_000)
    return config, model, tmp_path


@pytest.mark.parametrize("placement", ["linear", "v", "interleaved", "dual"])
def test_stages_for_any_placement_read_only_their_tensors_and_match_the_model(saved, placement):
    config, model, path = saved
    place = placements.make_placement(placement, 2, 4)
    with recorded_reads() as read:
        by_rank = [stages_for_rank(config, place, r, checkpoint=path) for r in range(2)]
    every = [st for mods in by_rank for st in mods]  # DualPipe's dual placement: each stage twice (mirrored)
    assert sorted(read) == sorted(k for st in every for k in st.state_dict())
    stages = sorted({st.index: st for st in every}.values(), key=lambda st: st.index)
    assert [st.index for st in stages] == list(range(place.num_stages))
    x = tokens()[:, :-1] % config.vocab_size
    y = tokens()[:, 1:] % config.vocab_size
    h = x
    for st in stages[:-1]:
        h = st(h)
    assert torch.equal(stages[-1].criterion(stages[-1](h), y), model(x, y))


def test_tied_embedding_gradients_sum_across_first_and_last_stage():
    config = LlamaConfig.preset("tiny", num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48,
                                tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    x, y = tokens()[:, :-1] % 64, tokens()[:, 1:] % 64
    model(x, y).backward()
    first, last = (st.double() for st in build_stages(config, 2, source=model))
    h = first(x)
    h_in = h.detach().requires_grad_()
    last.criterion(last(h_in), y).backward()
    h.backward(h_in.grad)
    sync_replicas([first, last])
    want = model.model.embed_tokens.weight.grad
    for st in (first, last):
        torch.testing.assert_close(st.model.embed_tokens.weight.grad, want, rtol=1e-12, atol=1e-14)


def test_pipeline_save_round_trips(saved, tmp_path):
    config, model, _ = saved
    stages = build_stages(config, 3, source=model)
    out = save_pipeline_checkpoint(stages, tmp_path / "pipe")
    assert json.loads((out / "config.json").read_text()) == {**config.to_hf(), "torch_dtype": "float32"}
    back = LlamaForCausalLM.from_pretrained(out)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_fp8_checkpoint_and_conversion(saved, tmp_path):
    config, model, _ = saved
    model.save_pretrained(tmp_path / "fp8", fp8=True)
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "fp8")
    w = model.model.layers["2"].mlp.down_proj.weight.detach()
    assert torch.equal(plain.model.layers["2"].mlp.down_proj.weight, dequantize(quantize_blocks(w)))
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight)  # the head is not stored in FP8
    stages = build_stages(config, 2, checkpoint=tmp_path / "fp8", fp8=True)
    layer = stages[1].model.layers["2"].mlp.down_proj
    assert isinstance(layer, FP8Linear)
    assert torch.equal(layer.quantized_weight().data.view(torch.uint8), quantize_blocks(w).data.view(torch.uint8))
    x, y = tokens()[:, :-1] % config.vocab_size, tokens()[:, 1:] % config.vocab_size
    with torch.no_grad():
        fp8_loss, ref = float(stages[1].criterion(stages[1](stages[0](x)), y)), float(model(x, y))
    assert fp8_loss != ref and abs(fp8_loss - ref) < 0.01 * ref  # FP8 GEMMs: close, not equal


# ----- the step's global valid-target count, 2 gloo ranks ------------------------------------------------------
def _normalized_worker(rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.layers import step_normalizer
    from mt_dualpipe.schedules.registry import build_schedule

    torch.set_num_threads(1)
    config = LlamaConfig.preset("tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    sched = build_schedule("dualpipev", world, 4)
    mods = stages_for_rank(config, sched, rank, source=model)
    for m in mods:
        m.double()
    pipe = Pipeline(mods, sched, timeout=120)
    crit = criterion_for(mods, normalizer=step_normalizer(y))  # every rank holds the whole batch here
    pipe.step(*([x] if rank == 0 else []), num_chunks=4, criterion=crit, labels=(y,) if rank == 0 else ())
    return {n: p.grad.clone() for m in mods for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
def test_the_step_normalizer_makes_pipelined_gradients_equal_the_whole_batch_token_mean():
    """Micro-batches with 0, 4, 8 and 12 ignored targets under DualPipeV: pipelined gradients with
    ``normalizer=step_normalizer(labels)`` equal one process's token mean over the whole batch; the
    per-micro-batch mean (what the criterion gives without a normalizer) does not."""
    from tests.helpers.dist import run_ranks

    config = LlamaConfig.preset("tiny")
    t = torch.randint(0, config.vocab_size, (8, 9), generator=torch.Generator().manual_seed(5))
    x, y = t[:, :-1], t[:, 1:].clone()
    for m, part in enumerate(torch.tensor_split(y, 4)):
        part.view(-1)[: 4 * m] = -100
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    model(x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        model(xm, ym).backward()
    per_micro_batch = {n: p.grad for n, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for grads in run_ranks(_normalized_worker, 2, x, y, timeout=120):
        for n, g in grads.items():
            got[n] = got[n] + g if n in got else g
    assert sorted(got) == sorted(want)
    assert max(relative_error(got[n], want[n]) for n in got) < 1e-12
    # averaging the micro-batch means instead (the same scale as the token mean) still weighs each
    # micro-batch's targets by 1 / its own count: with uneven masks that is another gradient
    assert max(relative_error(per_micro_batch[n] / 4, want[n]) for n in want) > 1e-2


# ----- the planner reads the layers' declarations ---------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_planner_counts_what_the_layers_declare_and_autograd_keeps(policy):
    """The planner's saved bytes per token of a Llama layer come from the modules' ``saved_per_token``
    (``spec.declared_saved``); against what autograd keeps (the meter), float32, sequence 64: within 10 %."""
    from mt_dualpipe.models.llama import LlamaDecoderLayer
    from mt_dualpipe.models.llama.spec import planner_spec
    from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute

    config = LlamaConfig.preset("tiny")
    b, s = 2, 64
    planned = planner_spec(config).layer_item(0, s, 4.0, policy, elem=4.0).act_bytes * b * s
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config)
    apply_recompute(layer, policy)
    x = torch.randn(b, s, config.hidden_size, requires_grad=True)
    meter = SavedActivationMeter(exclude=list(layer.parameters()))
    with meter.measure():
        layer(x)
    assert abs(planned / meter.peak - 1) < 0.10, (planned, meter.peak)


def test_the_8b_planner_spec_counts_the_models_parameters():
    from mt_dualpipe.models import planner_model
    from mt_dualpipe.models.llama.spec import planner_spec

    spec = planner_model("llama3-8b").spec
    assert spec.name == "llama3_8b" and spec.declared_saved is not None
    assert spec.total_params() == planner_spec(LlamaConfig.preset("8b")).total_params()
    assert spec.total_params() == 8_030_261_248  # LlamaForCausalLM's count on meta (the test above)
