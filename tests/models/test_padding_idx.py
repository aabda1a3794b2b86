"""Embeddings honour ``pad_token_id`` as transformers does (``nn.Embedding(padding_idx=...)``): the pad row gets no
gradient from the lookup, in every family (Llama, Qwen3-MoE, DeepSeek-V3, LLaVA's text model; the transformers
adapter runs transformers' own embedding), on the whole model and on its stages, and the configs read and
write the id. Llama's gradients equal transformers' (before, its embedding gradient norm was 4.47 against
transformers' 3.38 on this kind of batch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3 import build_stages as deepseek_stages
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM
from mt_dualpipe.models.llama import build_stages as llama_stages
from mt_dualpipe.models.llava import LlavaConfig, LlavaForConditionalGeneration
from mt_dualpipe.models.llava import build_stages as llava_stages
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mt_dualpipe.models.qwen3_moe import build_stages as qwen_stages
from tests.helpers.hf_reference import float64_transformers, randomize, relative_error

torch.set_num_threads(1)
PAD = 0


def padded_batch(vocab: int, low: int = 1, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids left-padded (their targets -100), so later tokens attend to the pads: without ``padding_idx`` the pad row
    takes gradient through them (right padding would hide it: nothing unmasked comes after)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(low, vocab, (4, 11), generator=g)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row, pad in enumerate((0, 2, 3, 5)):
        if pad:
            x[row, :pad], y[row, :pad] = PAD, -100
    return x, y


def test_llama_gradients_equal_transformers_with_a_pad_id(tmp_path):
    """Every gradient equals transformers' with a pad id set; the pad row's is zero, where without the pad id
    it is not (checked on the same weights)."""
    transformers = pytest.importorskip("transformers")
    with float64_transformers():
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
            attn_implementation="eager")).double()
        randomize(hf, 1)
        hf.save_pretrained(tmp_path)
        x, y = padded_batch(96)
        torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).backward()
    ours = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert ours.config.pad_token_id == PAD and ours.config.to_hf()["pad_token_id"] == PAD
    assert ours.model.embed_tokens.padding_idx == PAD
    ours(x, y).backward()
    want = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert relative_error(p.grad, want[name].grad) < 1e-12, name
    assert not ours.model.embed_tokens.weight.grad[PAD].any()
    plain = LlamaForCausalLM(ours.config.replace(pad_token_id=None)).double()
    plain.load_state_dict(ours.state_dict())
    plain(x, y).backward()
    assert plain.model.embed_tokens.weight.grad[PAD].abs().max() > 0  # what the lookup gave the pad row before
    assert [st.model.embed_tokens.padding_idx for st in llama_stages(ours.config, 2, source=ours)[:1]] == [PAD]


def _grads(model: torch.nn.Module, loss_of) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _with_and_without_pad(make, loss_of, embedding: str) -> None:
    """Same weights with and without the pad id: only the pad row of the embedding's gradient differs, and it is
    zero with the pad id; the pad row took gradient before (so the check can fail)."""
    torch.manual_seed(0)
    padded = make(PAD).double()
    plain = make(None).double()
    plain.load_state_dict(padded.state_dict())
    got, old = _grads(padded, loss_of), _grads(plain, loss_of)
    assert not got[embedding][PAD].any() and old[embedding][PAD].abs().max() > 0
    assert torch.equal(got[embedding][PAD + 1:], old[embedding][PAD + 1:])
    assert all(torch.equal(g, old[n]) for n, g in got.items() if n != embedding)


def test_qwen3_moe_pad_row_gets_no_gradient():
    config = Qwen3MoeConfig.preset("tiny", pad_token_id=PAD)
    assert Qwen3MoeConfig.from_hf(config.to_hf()).pad_token_id == PAD
    x, y = padded_batch(config.vocab_size)
    _with_and_without_pad(lambda pad: Qwen3MoeForCausalLM(config.replace(pad_token_id=pad)),
                          lambda m: m(x, y), "model.embed_tokens.weight")
    first = qwen_stages(config, 2, source=Qwen3MoeForCausalLM(config), dtype=torch.float64)[0]
    assert first.model.embed_tokens.padding_idx == PAD


def test_deepseek_v3_pad_row_gets_no_gradient_from_the_main_model_or_mtp():
    config = DeepSeekV3Config.preset("tiny", vocab_size=128, dim=64, inter_dim=96, n_layers=2, pad_token_id=PAD)
    assert DeepSeekV3Config.from_hf(config.to_hf()).pad_token_id == PAD
    x, y = padded_batch(config.vocab_size)
    _with_and_without_pad(lambda pad: DeepSeekV3Model(dataclasses.replace(config, pad_token_id=pad)),
                          lambda m: m(x, y), "model.embed_tokens.weight")
    stages = deepseek_stages(config, 2)
    assert [st.model.embed_tokens.padding_idx for st in stages] == [PAD, PAD]  # the first stage's and MTP's on the last
    with pytest.raises(ValueError, match=r"DeepSeekV3Config.pad_token_id 128 is outside the vocabulary 0..127"):
        dataclasses.replace(config, pad_token_id=128)


def test_llava_text_pad_row_gets_no_gradient():
    config = LlavaConfig.preset("tiny")
    assert config.text.pad_token_id == PAD  # the preset's text model has a pad id
    x, y = padded_batch(config.image_token_id)  # text only: ids below the image token
    _with_and_without_pad(
        lambda pad: LlavaForConditionalGeneration(dataclasses.replace(
            config, text=dataclasses.replace(config.text, pad_token_id=pad))),
        lambda m: m(x, None, y), "model.language_model.embed_tokens.weight")
    first = llava_stages(config, 2, dtype=torch.float64)[0]
    assert first.model.language_model.embed_tokens.padding_idx == PAD


def test_a_pad_id_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"pad_token_id 512 is outside the vocabulary 0..511"):
        LlamaForCausalLM(LlamaConfig.preset("tiny", pad_token_id=512))
