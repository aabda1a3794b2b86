"""Llama 3 decoder (GQA, RoPE with llama3 scaling, SwiGLU, RMSNorm), the single-process reference.

Module names are transformers' (``model.layers.3.self_attn.q_proj``, ``lm_head``), so a state-dict
key *is* the checkpoint name and the loader needs no mapping. RoPE rotates the two halves of each
head (transformers' ``rotate_half`` layout); RoPE, the softmax and the loss run in float64 for a
float64 model and float32 otherwise (``compute_dtype``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...layers import RMSNorm, apply_rope, compute_dtype, deferred_init
from ...layers.head import lm_loss as shared_lm_loss
from .checkpoint import build_loaded, open_checkpoint, save_weights
from .config import Llama3RopeScaling, LlamaConfig


def llama3_inv_freq(dim: int, theta: float, scaling: Llama3RopeScaling | None, dtype: torch.dtype) -> torch.Tensor:
    """Rotary frequencies; with llama3 scaling long wavelengths are slowed by ``factor`` and the band
    between ``original/low_freq_factor`` and ``original/high_freq_factor`` blended smoothly."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    if scaling is None:
        return inv
    s, old = scaling, scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    long_waves, short_waves = wavelen > old / s.low_freq_factor, wavelen < old / s.high_freq_factor
    slowed = torch.where(long_waves, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * slowed / s.factor + smooth * slowed
    return torch.where(~short_waves & ~long_waves, blended, slowed)


def rope_cos_sin(seq: int, config: LlamaConfig, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    inv = llama3_inv_freq(config.dim_per_head, config.rope_theta, config.rope_scaling, dtype).to(device)
    angles = torch.outer(torch.arange(seq, dtype=dtype, device=device), inv)
    return angles.cos(), angles.sin()


class LlamaAttention(nn.Module):
    """Causal grouped-query attention: ``num_key_value_heads`` key/value heads shared by groups of query heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, d = config, config.dim_per_head
        self.config, self.n_heads, self.n_kv, self.head_dim = c, c.num_attention_heads, c.num_key_value_heads, d
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(bsz, seq, self.n_kv, self.head_dim)
        cos, sin = rope_cos_sin(seq, self.config, compute_dtype(x), x.device)
        q, k = apply_rope(q, cos, sin, interleave=False), apply_rope(k, cos, sin, interleave=False)
        return self.o_proj(self.core(q, k, v))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Core attention (Megatron's term): K/V heads repeated per group, QKᵀ, causal softmax, ·V. The
        ``"selective"`` recompute policy recomputes it in backward (its S×S probabilities dominate)."""
        seq = q.size(1)
        group = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) * self.head_dim ** -0.5
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1, dtype=compute_dtype(q)).type_as(q)
        return torch.einsum("bhst,bthd->bshd", probs, v).flatten(2)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The SwiGLU product silu(gate)·up (recomputed in backward under the ``"selective"`` policy)."""
        return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``(module, method, tag)`` recomputed under ``policy`` (``integrations.recompute``): "selective"
        the core attention and the SwiGLU product (Megatron's selective recompute); "full" the layer."""
        if policy == "full":
            yield self, "forward", "layer"
        elif policy == "selective":
            yield self.self_attn, "core", "core_attention"
            yield self.mlp, "act", "swiglu"


class LlamaBody(nn.Module):
    """transformers' ``LlamaModel`` part (``model.*`` names): embedding, some layers, maybe the final norm."""

    def __init__(self, config: LlamaConfig, layer_ids: range | list[int], embed: bool, norm: bool) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in layer_ids})
        if norm:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy (``labels[:, i]`` is token i+1) in ``compute_dtype``, -100 targets masked:
    the mean, or the sum over ``normalizer`` (``layers.head.lm_loss``)."""
    return shared_lm_loss(logits, labels, normalizer=normalizer)


def init_llama(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:
            nn.init.normal_(m.weight, 0.0, std)


class LlamaForCausalLM(nn.Module):
    """The whole model: ``model`` (embedding, layers, norm) and ``lm_head`` (absent when tied: the head
    is the embedding matrix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        with deferred_init():
            self.model = LlamaBody(config, range(config.num_hidden_layers), embed=True, norm=True)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_llama(self, config.initializer_range)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers.values():
            h = layer(h)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) without labels; the mean next-token loss with them."""
        logits = F.linear(self.model.norm(self.hidden(tokens)), self.head_weight())
        return logits if labels is None else lm_loss(logits, labels)

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
