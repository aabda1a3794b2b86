"""Llama 3 decoder (GQA, RoPE with llama3 scaling, SwiGLU, RMSNorm), the single-process reference.

Composed only of ``mt_dualpipe.layers``: the attention is ``GQAttention`` without q/k norms, the MLP
``SwiGLUMLP``, RoPE the shared ``RopeSpec`` (``LlamaConfig.rope``). Module names are transformers'
(``model.layers.3.self_attn.q_proj``, ``lm_head``), so a state-dict key *is* the checkpoint name and the
loader needs no mapping. RoPE, the softmax and the loss run in float64 for a float64 model and float32
otherwise (``compute_dtype``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...layers import (
    GQAttention,
    RMSNorm,
    SwiGLUMLP,
    check_document_labels,
    check_position_ids,
    deferred_init,
    embedding,
    init_normal,
    inv_freq,
    lm_head,
    lm_loss,
    logits,
)
from .checkpoint import build_loaded, open_checkpoint, save_weights
from .config import Llama3RopeScaling, LlamaConfig


def llama3_inv_freq(dim: int, theta: float, scaling: Llama3RopeScaling | None, dtype: torch.dtype) -> torch.Tensor:
    """Rotary frequencies of a Llama config's RoPE (kept for callers of the old name; ``layers.rope.inv_freq``)."""
    return inv_freq(dim, LlamaConfig(rope_theta=theta, rope_scaling=scaling).rope, dtype)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU, each with its residual. ``"selective"`` recompute is declared by the
    attention (its core) and the MLP (its product) themselves; the layer declares ``"full"``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        norm = c.saves("norm")
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, norm)
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.dim_per_head,
                                     c.rope, core="recomputed" if c.saves("attention") else "eager")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, norm)
        self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, recompute_product=c.saves("swiglu"))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``"full"``: the whole layer (it then keeps only its input)."""
        if policy == "full":
            yield self, "forward", "layer"


class LlamaBody(nn.Module):
    """transformers' ``LlamaModel`` part (``model.*`` names): embedding, some layers, maybe the final norm."""

    def __init__(self, config: LlamaConfig, layer_ids: range | list[int], embed: bool, norm: bool) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in layer_ids})
        if norm:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.saves("norm"))


def init_llama(module: nn.Module, std: float) -> None:
    """Linears and embeddings ~ N(0, std²), as transformers' ``initializer_range``; norms keep their ones."""
    init_normal(module, std)


class LlamaForCausalLM(nn.Module):
    """The whole model: ``model`` (embedding, layers, norm) and ``lm_head`` (absent when tied: the head
    is the embedding matrix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        with deferred_init():
            self.model = LlamaBody(config, range(config.num_hidden_layers), embed=True, norm=True)
            if not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_llama(self, config.initializer_range)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def hidden(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            check_position_ids(position_ids, tokens.shape, "LlamaForCausalLM")
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers.values():
            h = layer(h, position_ids)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) without labels; with them the mean over this call's valid targets
        (a pipeline's criterion can instead normalise by the whole step's count: ``stages.criterion_for``).
        ``position_ids`` (batch, seq): packed documents, each beginning where the ids restart (``layers.documents``; the
        label of a document's last token must then be -100)."""
        out = logits(self.model.norm(self.hidden(tokens, position_ids)), self.head_weight())
        if labels is None:
            return out
        if position_ids is not None:
            check_document_labels(labels, position_ids)
        return lm_loss(out, labels, keep_logits=self.config.saves("loss"))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----- Hugging Face checkpoints -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
                        device: torch.device | str = "cpu", fp8: bool = False, **overrides: Any) -> LlamaForCausalLM:
        """A model from a Hugging Face Llama checkpoint (bf16, fp32 or block-scaled FP8); ``fp8`` converts
        the linears to ``FP8Linear`` first (FP8 weights then kept as stored)."""
        ckpt = open_checkpoint(path)
        config = LlamaConfig.from_hf(ckpt.config(), **overrides)
        return build_loaded(lambda: cls(config), ckpt, dtype=dtype, device=device, fp8=fp8)

    def save_pretrained(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None, fp8: bool = False,
                        max_shard_size: int | None = None) -> Path:
        """config.json, safetensors shards and index with transformers' names (no ``lm_head`` when tied)."""
        return save_weights(self, path, dtype=dtype, fp8=fp8, max_shard_size=max_shard_size)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


LlamaModel = LlamaForCausalLM
