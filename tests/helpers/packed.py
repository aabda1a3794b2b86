"""Packed-document runs of every family against transformers (``test_packed_documents*.py``).

``hf_models(family, path)`` builds a tiny random float64 transformers model, saves it to ``path`` and
loads ours from that checkpoint; ``documents`` makes fine-tuning documents (a prompt, then targets) that
``data.batching`` packs; ``logits_of`` runs either side on packed rows (transformers without a cache, so
that it reads the documents from the position ids); ``max_grad_error`` compares two gradient sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import mt_dualpipe
from mt_dualpipe.data.documents import Document
from mt_dualpipe.layers import GQAttention, MLAttention
from mt_dualpipe.models.deepseek_v3.hf_names import from_hf_name
from mt_dualpipe.models.llava import LlavaConfig
from tests.helpers.hf_reference import float64_transformers, randomize

FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "llava")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
              "llava": "LlavaForConditionalGeneration"}
# transformers modules that must compute in float64 too (``hf_reference.MODULES``) for these families
EXTRA_MODULES = ("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.clip.modeling_clip")
VOCAB = 64  # every family's; LLaVA's image token is 63, which ``documents`` never draws


def hf_config(family: str, layers: int = 2):
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, rope_parameters=rope, max_position_embeddings=64, attn_implementation="eager")
    if family == "llama":
        return transformers.LlamaConfig(**common, intermediate_size=48)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=16, head_dim=8,
                                           num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                           experts_implementation="eager")
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 2},
                                             intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,
                                             n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                             qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                                             experts_implementation="eager")
    text = {"num_hidden_layers": layers}
    return transformers.LlavaConfig(**{**LlavaConfig.preset("tiny", text=text).to_hf(), "attn_implementation": "eager"})


def hf_models(family: str, path: Path, layers: int = 2) -> tuple[torch.nn.Module, torch.nn.Module,
                                                                    Callable[[str], str | None]]:
    """(transformers' model, ours loaded from its checkpoint at ``path``, checkpoint name -> our parameter name).
    Ours has neither MTP nor DeepSeek-V3's sequence-wise balance loss: transformers has neither."""
    import transformers

    with float64_transformers():
        torch.manual_seed(0)
        hf = getattr(transformers, HF_CLASSES[family])(hf_config(family, layers)).double()
        randomize(hf, 1)
        hf.save_pretrained(path)
    extra = dict(mtp_depth=0, balance_loss_weight=0.0) if family == "deepseek_v3" else {}
    ours = mt_dualpipe.from_pretrained(path, dtype=torch.float64, **extra)
    rename = (lambda n: from_hf_name(n, ours.config)) if family == "deepseek_v3" else (lambda n: n)
    return hf, ours, rename


def documents(lengths: Sequence[int], image: int | None = None, tokens_per_image: int = 0,
              images: Sequence[int] = (), seed: int = 7) -> list[Document]:
    """Documents of random ids in 1..VOCAB-2, the first 1 + i % 2 of document i a prompt (not trained on), so
    that a document's first label is sometimes a target; documents ``images`` hold ``tokens_per_image`` copies
    of ``image`` after their first token, all prompt."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB - 1, (n,), generator=g).tolist()
        prompt = 1 + i % 2
        if i in images:
            ids[1:1 + tokens_per_image] = [image] * tokens_per_image
            prompt = 1 + tokens_per_image
        docs.append(Document(tuple(ids), (False,) * prompt + (True,) * (n - prompt)))
    return docs


def set_core(model: torch.nn.Module, core: str) -> None:
    """Every text attention of ``model`` runs ``core`` (LLaVA's vision tower attends bidirectionally, its own way)."""
    for m in model.modules():
        if isinstance(m, (GQAttention, MLAttention)):
            m.core_kind = core


def logits_of(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor | None,
              pixels: torch.Tensor | None = None) -> torch.Tensor:
    """Ours or transformers' logits; transformers runs without a cache (with one it ignores packed rows)."""
    images = {} if pixels is None else {"pixel_values": pixels}
    if hasattr(model, "generation_config"):  # transformers
        return model(input_ids=ids, position_ids=pos, use_cache=False, **images).logits
    return model(ids, position_ids=pos, **images)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, zeros where none arrived (an expert no token reached)."""
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad) for n, p in model.named_parameters()
            if p.requires_grad}


def max_grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over tensors of max |got - want| / max |want|, a tensor's scale taken as at least 1e-3 of the largest
    gradient G. Rounding leaves ~1e-16 G where a gradient is zero in exact arithmetic (LLaVA's vision key biases:
    softmax ignores a shift of all of a query's scores), which a relative error of its own would blow up; the
    floor still holds every such tensor to ~1e-15 G absolute, far below any real mismatch."""
    assert got and set(got) <= set(want), sorted(set(got) - set(want))[:5]
    floor = 1e-3 * max(float(want[n].abs().max()) for n in got)
    return max(float((g - want[n]).abs().max()) / max(float(want[n].abs().max()), floor) for n, g in got.items())
