"""LLaVA (``LlavaForConditionalGeneration`` in transformers): a vision tower, a projector and a Llama.

The forward embeds the tokens, runs the vision tower on the images the image tokens stand for (the
batch layout of ``inputs.py``), projects the selected hidden state to the text width and writes it
over the image-token embeddings; from there it is a plain causal LM. Module names are transformers 5's
(``model.vision_tower.encoder.layers.0.mlp.fc1``, ``model.language_model.layers.3.self_attn.q_proj``), so a
state-dict key is the checkpoint name of the layout written (``checkpoint.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...layers import check_document_labels, check_position_ids, deferred_init, init_normal, lm_head, lm_loss, logits
from .checkpoint import build_loaded, open_checkpoint, save_weights
from .config import LlavaConfig
from .inputs import merge_features, real_images
from .text import LanguageModel
from .vision import MultiModalProjector, VisionTower, init_vision


class LlavaBody(nn.Module):
    """transformers' ``LlavaModel`` part (``model.*``). A pipeline stage builds only what it holds: the
    first stage the vision tower, the projector and the embedding, the last the final norm."""

    def __init__(self, config: LlavaConfig, layer_ids: Sequence[int], vision: bool, embed: bool, norm: bool) -> None:
        super().__init__()
        if vision:
            self.vision_tower = VisionTower(config)
            self.multi_modal_projector = MultiModalProjector(config)
        self.language_model = LanguageModel(config.text, layer_ids, embed=embed, norm=norm)


def embed_inputs(body: LlavaBody, config: LlavaConfig, input_ids: torch.Tensor,
                 pixel_values: torch.Tensor | None) -> torch.Tensor:
    """Token embeddings with the projected image features at the image-token positions (batch, seq, hidden)."""
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"the first stage takes token ids (int64), got a {input_ids.dtype} tensor")
    h = body.language_model.embed_tokens(input_ids)
    if pixel_values is None:
        if bool((input_ids == config.image_token_id).any()):
            raise ValueError("input_ids hold image tokens but no pixel_values were given")
        return h
    images = real_images(pixel_values, input_ids, config.image_token_id, config.tokens_per_image)
    if images.size(0) == 0:
        return h
    features = body.vision_tower(images)
    if config.vision_feature_select_strategy == "default":
        features = features[:, 1:]
    return merge_features(h, input_ids, config.image_token_id, body.multi_modal_projector(features))


def init_llava(module: nn.Module, config: LlavaConfig) -> None:
    """Fresh weights: the text side ~ N(0, initializer_range), the vision tower as ``init_vision``, every
    linear bias zero (``deferred_init`` skipped ``nn.Linear``'s own init, biases included)."""
    body = module.model if hasattr(module, "model") else module
    init_normal(body.language_model, config.text.initializer_range)
    if hasattr(module, "lm_head"):
        init_normal(module.lm_head, config.text.initializer_range)
    if hasattr(body, "vision_tower"):
        init_vision(body.vision_tower, config.vision)
        init_normal(body.multi_modal_projector, config.text.initializer_range)
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is not None and not m.bias.is_meta:
            nn.init.zeros_(m.bias)


class LlavaForConditionalGeneration(nn.Module):
    """The whole model: ``model`` (vision tower, projector, language model) and ``lm_head`` (absent when tied)."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        with deferred_init():
            self.model = LlavaBody(config, range(config.num_hidden_layers), vision=True, embed=True, norm=True)
            if not config.tie_word_embeddings:
                self.lm_head = lm_head(config.text.hidden_size, config.text.vocab_size)
        init_llava(self, config)

    def head_weight(self) -> torch.Tensor:
        lm = self.model.language_model
        return lm.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, normalizer: float | torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) without labels; with them the next-token loss (``labels[:, i]`` is token
        i + 1, ``-100`` ignored: ``inputs.next_token_labels``), its mean or its sum over ``normalizer``.
        ``pixel_values``: (batch, max_images, C, H, W) padded slots, or transformers' (images, C, H, W).
        ``position_ids`` (batch, seq): packed documents, each beginning where the ids restart (``layers.documents``)."""
        if position_ids is not None:
            check_position_ids(position_ids, input_ids.shape, "LlavaForConditionalGeneration")
        h = embed_inputs(self.model, self.config, input_ids, pixel_values)
        lm = self.model.language_model
        out = logits(lm.norm(lm.run_layers(h, position_ids)), self.head_weight())
        if labels is None:
            return out
        if position_ids is not None:
            check_document_labels(labels, position_ids)
        return lm_loss(out, labels, normalizer=normalizer)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
                        device: torch.device | str = "cpu", **overrides: Any) -> LlavaForConditionalGeneration:
        """A model from a Hugging Face LLaVA checkpoint in any accepted key layout (every tensor read once,
        nothing initialised)."""
        ckpt = open_checkpoint(path)
        config = LlavaConfig.from_hf(ckpt.config(), **overrides)
        return build_loaded(lambda: cls(config), ckpt, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        max_shard_size: int | None = None) -> Path:
        """config.json, safetensors shards and index in transformers 5's layout (no ``lm_head`` when tied)."""
        return save_weights(self, path, dtype=dtype, max_shard_size=max_shard_size)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())
