"""A flash-style causal core attention for MLA: for backward it keeps q, k, v, the output and one
log-sum-exp per head and query, and rebuilds the probabilities in B, one block of queries at a time.

This is the footprint the planner calls ``fused_attention`` (``planner/activations.py``) and what
DeepSeek-V3's production kernels keep; the eager core (``attention_core.eager_core``) keeps the S×S
probabilities (float32 and a model-dtype copy) and the mask instead.

Why not ``torch.nn.functional.scaled_dot_product_attention``: MLA's value head dim differs from its
query/key head dim (128 vs 192 at 671B), and PyTorch's CPU flash kernel requires them equal: SDPA
then falls back to its math backend, which saves the probabilities (checked with torch 2.13: "Flash
attention requires q,k,v to have the same last dimension"). Padding v to 192 would keep a third more
v and run a third more ·V work. This function takes any head dims, on any device.

Numerics: scores, the softmax and both products run in the compute dtype the caller gives
(``common.compute_dtype``: float64 for a float64 model, else float32), so a float64 model's logits equal
the eager core's and transformers' to rounding (not bit-equal: the ·V product sums in another order).
Blocks of ``QUERY_BLOCK`` queries bound the transient memory (block × seq scores per head) in F and B.
Packed rows (``documents``, ``layers.documents``): keys of other documents are masked like future ones;
every key block up to the query block is still scored (a kernel would skip the blocks outside a
document; here the saved tensors, not the FLOPs, are the point).
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 128
"""Queries per block: the forward and the backward hold one block's scores (block × keys per head) at a time."""


def _block_probs(q: torch.Tensor, k: torch.Tensor, start: int, scale: float, cdt: torch.dtype,
                 documents: torch.Tensor | None, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of queries ``start..start+len(q)`` against keys ``0..start+len(q)-1`` (the causal part), masked
    (with ``documents``: also every key of another document), and their probabilities: normalised by their
    own log-sum-exp, or by ``lse`` when given (B)."""
    rows, keys = q.size(1), k.size(1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(cdt), k.to(cdt)) * scale
    future = torch.arange(keys, device=q.device)[None, :] > torch.arange(start, start + rows, device=q.device)[:, None]
    if documents is not None:  # (batch, 1, rows, keys): a query's own document only
        own = documents[:, start:start + rows, None] == documents[:, None, :keys]
        future = (future | ~own).unsqueeze(1)
    scores = scores.masked_fill(future, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


class FlashCore(torch.autograd.Function):
    """Causal softmax attention ``(b, s, h, dqk) x2, (b, s, h, dv) -> (b, s, h, dv)`` keeping q, k, v, the
    output and the log-sum-exp (``(b, h, s)``, compute dtype) for B (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cdt: torch.dtype,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, heads, _ = q.shape
        v = v.contiguous()  # not a view of the k_nope|v buffer, which would then stay alive
        out = q.new_empty(bsz, seq, heads, v.size(-1))
        lse = torch.empty(bsz, heads, seq, dtype=cdt, device=q.device)
        for start in range(0, seq, QUERY_BLOCK):
            end = min(seq, start + QUERY_BLOCK)
            probs, lse[:, :, start:end] = _block_probs(q[:, start:end], k[:, :end], start, scale, cdt, documents)
            out[:, start:end] = torch.einsum("bhqk,bkhd->bqhd", probs, v[:, :end].to(cdt)).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, documents = ctx.saved_tensors
        cdt, scale = lse.dtype, ctx.scale
        grad = grad.to(cdt)
        # D_i = sum_d dO_i · O_i: the softmax backward's row term (dS = P ∘ (dP − D))
        rowdot = (grad * out.to(cdt)).sum(-1).transpose(1, 2)  # (b, h, s)
        dq, dk, dv = (torch.zeros(t.shape, dtype=cdt, device=t.device) for t in (q, k, v))
        for start in range(0, q.size(1), QUERY_BLOCK):
            end = min(q.size(1), start + QUERY_BLOCK)
            qb, gb = q[:, start:end].to(cdt), grad[:, start:end]
            kb, vb = k[:, :end].to(cdt), v[:, :end].to(cdt)
            probs, _ = _block_probs(qb, kb, start, scale, cdt, documents, lse[:, :, start:end])
            dv[:, :end] += torch.einsum("bhqk,bqhd->bkhd", probs, gb)
            dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", gb, vb) - rowdot[:, :, start:end].unsqueeze(-1))
            dq[:, start:end] = torch.einsum("bhqk,bkhd->bqhd", dscores, kb) * scale
            dk[:, :end] += torch.einsum("bhqk,bqhd->bkhd", dscores, qb) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cdt: torch.dtype,
               documents: torch.Tensor | None = None) -> torch.Tensor:
    """``attention_core.eager_core``'s contract -> (batch, seq, heads * dv), with the softmax in ``cdt``;
    ``documents`` (packed rows): attention inside each document only."""
    return FlashCore.apply(q, k, v, scale, cdt, documents).flatten(2)
