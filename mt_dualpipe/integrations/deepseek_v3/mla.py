"""Multi-head Latent Attention (DeepSeek-V2/V3): low-rank Q and KV, decoupled RoPE key.

Queries go through a down/up projection pair (``q_lora_rank``); keys and values share one
compressed latent (``kv_lora_rank``) that is normalised and expanded per head. Position enters
only through a separate ``qk_rope_head_dim`` part: each head has its own rotary query part, while
the rotary key part is a single vector shared by all heads. Training-time form (no KV cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DeepSeekV3Config


class RMSNorm(nn.Module):
    cheap_weight_grad = True  # its weight gradient is a cheap reduction: the runtime computes it during B

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_angles(seq_len: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (seq_len, dim // 2), for positions 0..seq_len-1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the last dim; x is (batch, seq, heads, dim)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


class MLA(nn.Module):
    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        c = config
        self.n_heads, self.nope, self.rope, self.v_dim = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank, self.theta = c.kv_lora_rank, c.rope_theta
        if c.q_lora_rank:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.n_heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.softmax_scale = c.qk_head_dim ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_pe = q.view(bsz, seq, self.n_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        cos, sin = rope_angles(seq, self.rope, self.theta, x.device)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)  # one rotary key for all heads
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, self.n_heads, -1).split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        scores = torch.einsum("bshd,bthd->bhst", q, k) * self.softmax_scale
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bhst,bthd->bshd", probs, v)
        return self.wo(out.flatten(2))
