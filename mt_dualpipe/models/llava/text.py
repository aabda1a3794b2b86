"""The language model: a Llama decoder composed of ``mt_dualpipe.layers`` (transformers' ``LlamaModel`` names).

Kept apart from ``models.llama`` on purpose: a family composes the shared layer and imports no
other family, so the Llama here is the shared pieces (``GQAttention`` without q/k norm, ``SwiGLUMLP``,
``RMSNorm``, any ``RopeSpec`` incl. Llama-3 scaling) put together under ``language_model.*``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ...layers import GQAttention, RMSNorm, SwiGLUMLP, embedding
from .config import TextConfig


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope,
                                     eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``"full"``: the whole layer (it keeps only its input); ``"selective"`` is declared by the attention
        (core) and the SwiGLU (activation) themselves."""
        if policy == "full":
            yield self, "forward", "layer"


class LanguageModel(nn.Module):
    """transformers' ``LlamaModel`` part (``language_model.*``): maybe the embedding, some layers (keyed by
    their global index, so a stage's names are the checkpoint's), maybe the final norm."""

    def __init__(self, c: TextConfig, layer_ids: Sequence[int], embed: bool, norm: bool) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(c, i) for i in layer_ids})
        if norm:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, position_ids)
        return h
