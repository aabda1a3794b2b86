"""Causal core attention (softmax(q·kᵀ·scale)·v) in three memory footprints, one contract.

Every core takes per-head q, k (batch, seq, heads, d_qk) and v (batch, seq, heads, d_v), any head dims
(MLA's value head dim differs from its query/key one), and returns (batch, seq, heads * d_v). With
``documents`` (per token its document in the row, ``layers.documents.document_ids``: packed rows) a
query sees only the earlier keys of its own document, a block-diagonal causal mask; without, the plain
causal one (the same ops as before, bit for bit):

- ``"eager"``: einsum, softmax in ``compute_dtype``, einsum; autograd keeps the S×S probabilities;
- ``"recomputed"``: the same ops, keeping only q, k and a contiguous v; the probabilities and the mask
  are rebuilt in B (DeepSeek-V3's ``"attention"`` saver), so gradients are bit-equal to eager's;
- ``"flash"``: ``flash_core``, keeping q, k, v, the output and one log-sum-exp per head and query (what a
  production flash kernel keeps, and what the planner calls ``fused_attention``).
"""

from __future__ import annotations

import torch

from .common import compute_dtype
from .flash_core import flash_core

CORES = ("eager", "recomputed", "flash")


def hidden_keys(seq: int, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """True where query i may not see key j: the future (seq, seq), and with ``documents`` (batch, seq) also
    every key of another document (batch, 1, seq, seq), broadcast over the heads."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    if documents is None:
        return causal
    return causal | (documents[:, :, None] != documents[:, None, :]).unsqueeze(1)


def eager_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention (einsum, softmax in ``compute_dtype``, einsum) -> (batch, seq, heads * dv);
    with ``documents`` inside each document only."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    hidden = hidden_keys(q.size(1), documents, q.device)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1, dtype=compute_dtype(q)).type_as(q)
    return torch.einsum("bhst,bthd->bshd", probs, v).flatten(2)


class _RecomputedCore(torch.autograd.Function):
    """``eager_core`` keeping only q, k and v; v is kept contiguous, so a buffer it was sliced from (MLA's
    k_nope|v) is not held."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(q, k, v.contiguous(), documents)
        ctx.scale = scale
        return eager_core(q, k, v, scale, documents)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, documents = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad)]
            out = eager_core(*leaves, ctx.scale, documents)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(got) if t.requires_grad else None for t in leaves), None, None)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kind: str = "eager",
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """The core of footprint ``kind`` (``CORES``); without a gradient to keep anything for, the eager one.
    ``documents``: (batch, seq) document index per token (packed rows), or None (one sequence a row)."""
    if kind not in CORES:
        raise ValueError(f"core attention must be one of {', '.join(CORES)}, got {kind!r}")
    if kind == "eager" or not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return eager_core(q, k, v, scale, documents)
    if kind == "flash":
        return flash_core(q, k, v, scale, compute_dtype(q), documents)
    return _RecomputedCore.apply(q, k, v, scale, documents)
