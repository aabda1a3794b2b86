"""Multi-head Latent Attention (DeepSeek-V2/V3): low-rank Q and KV, decoupled RoPE key.

Queries go through a down/up projection pair (``q_lora_rank``); keys and values share one
compressed latent (``kv_lora_rank``) that is normalised and expanded per head. Position enters
only through a separate ``qk_rope_head_dim`` part: each head has its own rotary query part, while
the rotary key part is a single vector shared by all heads. Training-time form (no KV cache).

Rope scaling is YaRN as the released config and transformers define it (``YarnScaling``): blended
frequencies, cos/sin times ``attention_factor`` and the softmax scale times mscale². RoPE and the
softmax run in ``compute_dtype`` (float64 for a float64 model, else float32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.rope import apply_rope
from ..fp8.linear import FP8Linear
from ..fp8.quantize import quantize_tiles
from .config import DeepSeekV3Config
from .flash_core import flash_core
from .yarn import YarnScaling


class _RecomputedRMSNorm(torch.autograd.Function):
    """``F.rms_norm`` that keeps only its input (and the weight, a parameter) and re-runs the norm in B.

    Eager autograd keeps the float32 upcast, the normalised input and the reciprocal RMS (three copies
    for a bf16 input); this keeps the input, which the residual stream holds anyway. The backward
    differentiates the same ``F.rms_norm`` call, so its gradients are bit-equal to eager's. It owns no
    parameters of its own: the norm's weight gradient is computed in B, as the runtime expects of a
    ``cheap_weight_grad`` module."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.size(-1),), weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(need_x), weight.detach().requires_grad_(need_w)
            y = F.rms_norm(xd, (x.size(-1),), wd, ctx.eps)
        wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
        got = iter(torch.autograd.grad(y, wanted, grad) if wanted else ())
        return (next(got) if need_x else None), (next(got) if need_w else None), None


class RMSNorm(nn.Module):
    """RMSNorm; ``recompute`` (the ``"norm"`` memory saver) keeps only its input for B."""

    cheap_weight_grad = True  # its weight gradient is a cheap reduction: the runtime computes it during B

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.recompute = recompute
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            out = _RecomputedRMSNorm.apply(x, self.weight, self.eps)
            # how to rebuild this output from what the norm keeps: the router re-derives its input from it
            # in B instead of keeping the output too (``moe._RouterLogits``)
            out.rms_norm_source = (x, self.weight, self.eps)
            return out
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def eager_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention (einsum, softmax in ``compute_dtype``, einsum) -> (batch, seq, heads * dv)."""
    seq = q.size(1)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1, dtype=compute_dtype(q)).type_as(q)
    return torch.einsum("bhst,bthd->bshd", probs, v).flatten(2)


class _RecomputedCore(torch.autograd.Function):
    """The core attention keeping only q, k and v (the ``"attention"`` saver): the S×S probabilities and
    the mask are rebuilt in B. The forward and the backward are eager's own ops, so logits and
    gradients are bit-equal to the eager core; v is kept contiguous, so the k_nope|v buffer it was
    sliced from is not held."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v.contiguous())
        ctx.scale = scale
        return eager_core(q, k, v, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad)]
            out = eager_core(*leaves, ctx.scale)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(got) if t.requires_grad else None for t in leaves), None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision of RoPE, the attention softmax and the router: float64 for a float64 model
    (so it can be compared with a reference to 1e-12), float32 for fp32, bf16 and fp16 models."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling, dtype: torch.dtype) -> torch.Tensor:
    """YaRN's blend of interpolated (θ_i / factor) and extrapolated (θ_i) frequencies, per rotary pair.

    A pair that turns more than ``beta_fast`` times over the original context keeps its frequency, one
    that turns fewer than ``beta_slow`` times is interpolated, and a linear ramp over the pair index
    joins the two (the bounds rounded outwards when ``truncate``)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim)

    def pair_index(rotations: float) -> float:  # the pair whose wavelength fits ``rotations`` turns
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(yarn.beta_fast), pair_index(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return 1.0 / (yarn.factor * base) * ramp + 1.0 / base * extrapolated


def rope_angles(seq_len: int, dim: int, theta: float, device: torch.device, dtype: torch.dtype = torch.float32,
                yarn: YarnScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (seq_len, dim // 2), for positions 0..seq_len-1, in ``dtype``;
    with YaRN the frequencies are blended and cos/sin carry its ``attention_factor``."""
    if yarn is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))
        factor = 1.0
    else:
        inv_freq = yarn_inv_freq(dim, theta, yarn, dtype).to(device)
        factor = yarn.cos_sin_factor()
    angles = torch.outer(torch.arange(seq_len, dtype=dtype, device=device), inv_freq)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


class MLA(nn.Module):
    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        c = config
        self.n_heads, self.nope, self.rope, self.v_dim = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank, self.theta = c.kv_lora_rank, c.rope_theta
        self.yarn, self.interleave = c.rope_scaling, c.rope_interleave
        if c.q_lora_rank:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps, c.saves("norm"))
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.n_heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps, c.saves("norm"))
        self.recompute_core = c.saves("attention")
        self.flash = c.core_attention == "flash"
        self.share_fp8_input = c.saves("mla_input")
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.softmax_scale = c.softmax_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.attend(*self.latents(x)))

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (normed) -> the down projections' outputs: the query latent (``wq_a``'s output; x itself
        without ``q_lora_rank``) and ``wkv_a``'s output (the kv latent and the shared rotary key, one
        buffer). They are what the ``"selective"`` recompute policy keeps of the projections. With FP8
        linears and the ``"mla_input"`` saver x is quantised once for both (one E4M3 copy kept for dW)."""
        if self.share_fp8_input and hasattr(self, "wq_a") and isinstance(self.wq_a, FP8Linear) \
                and isinstance(self.wkv_a, FP8Linear) and x.numel():
            xq = quantize_tiles(x.detach().reshape(-1, x.shape[-1]))
            return self.wq_a(x, xq), self.wkv_a(x, xq)
        return (self.wq_a(x) if hasattr(self, "wq_a") else x), self.wkv_a(x)

    def attend(self, q_latent: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """The latents -> the attention output before ``wo``: the up-projections (``expand``) and the
        core. This is the region ``"selective"`` recomputes in backward (DeepSeek-V3 report §3.2.3): the
        latents are kept, q, k, v and the core's probabilities are rebuilt from them in B."""
        return self.core(*self.expand(q_latent, kv))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x -> per-head q, k (RoPE applied) and v: ``expand`` of ``latents``."""
        return self.expand(*self.latents(x))

    def expand(self, q_latent: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections: q and kv latents -> per-head q, k (RoPE applied) and v, with the latents'
        RMSNorms and RoPE of the rotary parts."""
        bsz, seq, _ = kv.shape
        q = self.wq_b(self.q_norm(q_latent)) if hasattr(self, "wq_a") else self.wq(q_latent)
        q_nope, q_pe = q.view(bsz, seq, self.n_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        cdt = compute_dtype(kv)
        cos, sin = rope_angles(seq, self.rope, self.theta, kv.device, cdt, self.yarn)
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin, self.interleave)  # one rotary key for all heads
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, self.n_heads, -1).split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return q, k, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention -> (batch, seq, heads * v_head_dim), before the output projection:
        ``core_attention="flash"`` keeps q, k, v, the output and a log-sum-exp (``flash_core``); else the
        eager core, keeping q, k and v only with the ``"attention"`` saver."""
        if self.flash and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return flash_core(q, k, v, self.softmax_scale, compute_dtype(q))
        if self.recompute_core and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _RecomputedCore.apply(q, k, v, self.softmax_scale)
        return eager_core(q, k, v, self.softmax_scale)
