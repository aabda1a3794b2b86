"""Causal grouped-query attention with optional per-head q/k RMSNorm (Qwen3) and any ``RopeSpec``.

Parameter names are transformers' (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
``k_norm``), so a family's state-dict key is the checkpoint name. The projections are plain
``nn.Linear`` (``defer_weight_grads`` swaps them for ``DeferredLinear`` in a pipeline stage).
RoPE and the softmax run in ``compute_dtype``. ``core``: ``"eager"`` (autograd keeps the S×S
probabilities), ``"recomputed"`` (the ``"attention"`` saver: q, k, v kept, the core re-run in B) or
``"flash"`` (``attention_core``); ``norm_recompute``: the q/k RMSNorms keep only their inputs (``"norm"``).
``forward(x, position_ids=None)``: with position ids, packed documents (``layers.documents``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .attention_core import CORES, core_attention
from .common import compute_dtype
from .documents import check_position_ids, document_ids
from .norm import RMSNorm
from .rope import RopeSpec, apply_rope, cos_sin


class GQAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope: RopeSpec, *,
                 qk_norm: bool = False, eps: float = 1e-6, bias: bool = False, core: str = "eager",
                 norm_recompute: bool = False) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        if core not in CORES:
            raise ValueError(f"core attention must be one of {', '.join(CORES)}, got {core!r}")
        self.core_kind = core
        self.heads, self.kv_heads, self.head_dim, self.rope = heads, kv_heads, head_dim, rope
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, norm_recompute) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, norm_recompute) if qk_norm else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden). ``position_ids`` (batch, seq): packed documents
        (``layers.documents``), RoPE by position id and attention inside each document; None: 0..seq-1."""
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        documents = None
        if position_ids is not None:
            check_position_ids(position_ids, (bsz, seq), "GQAttention")
            documents = document_ids(position_ids)
        cos, sin = cos_sin(seq, self.head_dim, self.rope, compute_dtype(x), x.device, position_ids)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.core(q, k, v, documents))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Core attention: K/V repeated per group, QKᵀ·d^-½, causal softmax (``compute_dtype``), ·V, in the
        footprint ``core`` chose (``attention_core``); ``documents``: the packed rows' block-diagonal mask."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        return core_attention(q, k, v, self.head_dim ** -0.5, self.core_kind, documents)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``"selective"``: the core attention (its S×S probabilities dominate), as Megatron does."""
        if policy == "selective" and self.core_kind == "eager":
            yield self, "core", "core_attention"

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        """Elements kept per token (approximate, eager autograd): the projections' input, the q/k norms'
        (per head: input, normalised input, 1/rms), the rotated q, k and v, the core output, and unless
        ``"selective"`` recomputes the core, the per-group repeated k/v and the probabilities; ``"full"``
        nothing (the layer keeps its input)."""
        if policy == "full":
            return {}
        d, h, kv = self.head_dim, self.heads, self.kv_heads
        kept = {"qkv_input": self.q_proj.in_features, "q": h * d, "k": kv * d, "v": kv * d, "core_out": h * d}
        if self.q_norm is not None and self.q_norm.recompute:
            kept.update(q_norm=h * d, k_norm=kv * d)
        elif self.q_norm is not None:
            kept.update(q_norm=2 * h * d + h, k_norm=2 * kv * d + kv)
        if self.core_kind == "recomputed":  # q and the per-group repeated k and v
            return {**kept, "k_repeated": 2 * h * d}
        if self.core_kind == "flash":  # the repeated k, v, the output and one log-sum-exp per head
            return {**kept, "k_repeated": 2 * h * d, "core_out_kept": h * d, "lse": 2 * h}
        if policy == "selective":
            return kept
        return {**kept, "k_repeated": 2 * h * d, "probs": h * seq}
