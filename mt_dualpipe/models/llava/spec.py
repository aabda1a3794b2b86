"""The planner's model description of a LLaVA config: the Llama decoder plus the vision encoder on stage 0.

The planner cuts a model into items (embedding, decoder layers, head), each with its parameters, FLOPs
and saved bytes *per text token*. The vision tower and the projector run where the embedding runs (the
first pipeline stage), so ``LlavaModelSpec`` folds them into the embedding item: their parameters, and
their per-image FLOPs and saved activations times ``images_per_sample`` divided by the sequence length.
Any stage cut by the planner (``planner.estimate.stage_items``) or by ``balance.balanced_layout`` then
sees the encoder's cost on the first stage.

Counted per image (``vision_costs``), with P encoder positions (patches, plus CLIP's class token),
width h, MLP width i and the L encoder layers that run: the patch convolution, per layer the four
h x h projections and the two MLP linears over P rows plus the bidirectional core attention (QKᵀ and
·V, 4·P²·h), and the projector over the image's tokens. The frozen layers above the feature layer run
nothing and have no gradient or optimizer state, so they are left out of the parameters; the norms'
element-wise work is left out of the FLOPs. Saved activations are the modules' own declarations
(``vision.py``: ``saved_per_token`` of the tower and the projector), so the planner counts what they keep.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...layers import saved_elements_per_token
from ...planner.model import Item, ModelSpec
from .config import LlavaConfig


@dataclass(frozen=True)
class VisionCost:
    """One image through the tower and the projector."""

    params: float  # trainable: the tower's used part and the projector
    linear_params: float  # of ``params``, the linears' weights (what FP8 training would convert)
    mm_flops: float  # forward GEMM FLOPs
    attn_flops: float  # forward core-attention FLOPs
    saved: tuple[tuple[str, float], ...]  # (recompute policy, saved elements)

    def saved_elements(self, policy: str) -> float:
        return dict(self.saved)[policy]


@functools.cache
def _vision_modules(config: LlavaConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tower and the projector on the meta device (no memory): what the declarations are read from."""
    from .vision import MultiModalProjector, VisionTower  # lazy: the model's modules only when asked

    with torch.device("meta"):
        return VisionTower(config), MultiModalProjector(config)


def declared_vision_saved(config: LlavaConfig, policy: str) -> float:
    """Saved elements per image under ``policy``, as the modules declare them: the tower's per position times
    its P positions, the projector's per image token times the image's tokens."""
    tower, projector = _vision_modules(config)
    positions = config.vision.num_positions
    return (positions * sum(tower.saved_per_token(policy, positions).values())
            + config.tokens_per_image * sum(projector.saved_per_token(policy, positions).values()))


def vision_costs(config: LlavaConfig) -> VisionCost:
    v, text_h = config.vision, config.text.hidden_size
    h, i, P, L, T = v.hidden_size, v.intermediate_size, v.num_positions, config.vision_layers_used, \
        config.tokens_per_image
    patch_in = v.num_channels * v.patch_size ** 2
    bias = 1 if config.multimodal_projector_bias else 0
    embed_p = patch_in * h + (0 if v.class_token else h) + P * h + (h if v.class_token else 0)
    layer_p = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
    proj_p = h * text_h + text_h * text_h + 2 * bias * text_h
    params = embed_p + (2 * h if v.kind == "clip" else 0) + L * layer_p + proj_p  # + CLIP's pre_layrnorm
    linear = L * (4 * h * h + 2 * h * i) + h * text_h + text_h * text_h
    mm = 2 * v.num_patches * patch_in * h + L * 2 * P * (4 * h * h + 2 * h * i) + 2 * T * (h * text_h + text_h ** 2)
    attn = L * 4 * P * P * h
    saved = {policy: declared_vision_saved(config, policy) for policy in ("none", "selective", "full")}
    return VisionCost(float(params), float(linear), float(mm), float(attn),
                      tuple((k, float(x)) for k, x in saved.items()))


@dataclass
class LlavaModelSpec(ModelSpec):
    """``ModelSpec`` whose embedding item carries the vision encoder (module docstring)."""

    vision: VisionCost | None = dataclasses.field(default=None, compare=False)
    images_per_sample: float = 1.0

    def items(self, seq_len: int, act_unit: float = 2.0, recompute: str = "selective", elem: float = 2.0,
              micro_batch_size: int = 1, attention: str = "eager") -> list[Item]:
        out = super().items(seq_len, act_unit, recompute, elem, micro_batch_size, attention)
        if self.vision is None:
            return out
        v, per_token = self.vision, self.images_per_sample / seq_len
        emb = out[0]
        re_mm, re_attn = (v.mm_flops, v.attn_flops) if recompute == "full" else \
            (0.0, v.attn_flops) if recompute == "selective" else (0.0, 0.0)
        out[0] = dataclasses.replace(
            emb, name="embedding+vision", params=emb.params + v.params,
            mm_flops=emb.mm_flops + per_token * v.mm_flops, attn_flops=emb.attn_flops + per_token * v.attn_flops,
            act_bytes=emb.act_bytes + per_token * v.saved_elements(recompute) * elem,
            recompute_mm_flops=per_token * re_mm, recompute_attn_flops=per_token * re_attn,
            linear_params=emb.linear_params + v.linear_params)
        return out

    def text_spec(self) -> ModelSpec:
        """The same description without the vision encoder (a plain ``ModelSpec``)."""
        return ModelSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSpec)})

    def total_params(self, include_mtp: bool = False) -> float:
        return self.text_spec().total_params(include_mtp) + (self.vision.params if self.vision else 0.0)

    def activated_params(self) -> float:
        return self.text_spec().activated_params() + (self.vision.params if self.vision else 0.0)


def declared_saved(config: LlavaConfig) -> Callable[[str, str, int], float]:
    """(kind, policy, seq) -> saved elements per token of one text decoder layer, read from its modules'
    declarations (built once on the meta device)."""
    from .text import LlamaDecoderLayer  # lazy: the model's modules only when the planner asks

    @functools.cache
    def layer() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaDecoderLayer(config.text, 0)

    def per_token(kind: str, policy: str, seq: int, t: object = None) -> float:
        kept_input = config.text.hidden_size if policy == "full" else 0  # a fully recomputed layer keeps its input
        return float(saved_elements_per_token(layer(), policy, seq) + kept_input)

    return per_token


def planner_spec(config: LlavaConfig, images_per_sample: float = 1.0) -> LlavaModelSpec:
    """The planner's description: the Llama decoder (GQA, SwiGLU) and, on the embedding item, the vision
    encoder and projector for ``images_per_sample`` images per sequence."""
    if images_per_sample < 0:
        raise ValueError(f"images_per_sample must be >= 0, got {images_per_sample}")
    t = config.text
    return LlavaModelSpec(name="llava", hidden_size=t.hidden_size, head_num=t.num_attention_heads,
                          layer_num=t.num_hidden_layers, vocab_size=t.vocab_size, intermediate_size=t.intermediate_size,
                          attention_type="gqa", kv_head_num=t.num_key_value_heads, head_size=t.head_dim,
                          declared_saved=declared_saved(config), vision=vision_costs(config),
                          images_per_sample=float(images_per_sample))
