"""Multi-head Latent Attention (DeepSeek-V2/V3): low-rank Q and KV, decoupled RoPE key.

Queries go through a down/up projection pair (``q_lora_rank``; 0: one projection); keys and values share
one compressed latent (``kv_lora_rank``) that is normalised and expanded per head. Position enters only
through a separate ``qk_rope_head_dim`` part: each head has its own rotary query part, while the rotary key
part is a single vector shared by all heads. Training-time form (no KV cache).

The forward is written as ``latents`` (the down-projections) and ``attend`` (``expand``: norms,
up-projections and RoPE; then ``core``), the two regions the ``"selective"`` recompute policy
distinguishes: it keeps the latents and rebuilds q, k, v and the core in B (DeepSeek-V3 report §3.2.3).
Memory options: ``norm_recompute`` (the latents' RMSNorms keep only their inputs; ``fused_norm``: one
``F.rms_norm`` in the input dtype, ``layers.norm``), ``core`` (``"eager"``,
``"recomputed"`` or ``"flash"``: ``attention_core``) and ``share_fp8_input`` (with FP8 linears, one 1×128
E4M3 copy of the input for both down-projections: any linear with ``quantize_input`` and an ``xq`` argument).

Module names are the Hugging Face checkpoint's (transformers' ``DeepseekV3Attention``: ``q_a_proj``,
``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``).
RoPE (``RopeSpec``: plain or YaRN) and the softmax run in ``compute_dtype``. ``forward(x, position_ids=None)``:
with position ids, packed documents (``layers.documents``); ``attend`` and ``expand`` take them too.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_core import CORES, core_attention
from .common import Elements, compute_dtype, is_fp8
from .documents import check_position_ids, document_ids
from .norm import RMSNorm
from .rope import RopeSpec, apply_rope, cos_sin


class MLAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, *, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, rope: RopeSpec, softmax_scale: float, eps: float = 1e-6,
                 rope_interleave: bool = True, norm_recompute: bool = False, fused_norm: bool = False,
                 core: str = "eager", share_fp8_input: bool = False) -> None:
        super().__init__()
        if core not in CORES:
            raise ValueError(f"core attention must be one of {', '.join(CORES)}, got {core!r}")
        self.n_heads, self.nope, self.rope, self.v_dim = heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank, self.rope_spec, self.interleave = kv_lora_rank, rope, rope_interleave
        self.softmax_scale, self.core_kind, self.share_fp8_input = softmax_scale, core, share_fp8_input
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps, norm_recompute, fused_norm)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps, norm_recompute, fused_norm)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden); ``position_ids`` (batch, seq): packed documents
        (``layers.documents``: RoPE by position id, attention inside each document), None: 0..seq-1."""
        return self.o_proj(self.attend(*self.latents(x), position_ids))

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (normed) -> the down projections' outputs: the query latent (``q_a_proj``'s output; x itself
        without ``q_lora_rank``) and ``kv_a_proj_with_mqa``'s output (the kv latent and the shared rotary key, one
        buffer). With FP8 linears and ``share_fp8_input`` x is quantised once for both."""
        lora = hasattr(self, "q_a_proj")
        if self.share_fp8_input and lora and hasattr(self.q_a_proj, "quantize_input") \
                and hasattr(self.kv_a_proj_with_mqa, "quantize_input") and x.numel():
            xq = self.q_a_proj.quantize_input(x)
            return self.q_a_proj(x, xq), self.kv_a_proj_with_mqa(x, xq)
        return (self.q_a_proj(x) if lora else x), self.kv_a_proj_with_mqa(x)

    def attend(self, q_latent: torch.Tensor, kv: torch.Tensor, position_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The latents -> the attention output before ``o_proj``: ``expand`` and the core (the region
        ``"selective"`` recomputes)."""
        documents = None if position_ids is None else document_ids(position_ids)
        return self.core(*self.expand(q_latent, kv, position_ids), documents)

    def project(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x -> per-head q, k (RoPE applied) and v: ``expand`` of ``latents``."""
        return self.expand(*self.latents(x), position_ids)

    def expand(self, q_latent: torch.Tensor, kv: torch.Tensor, position_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections: q and kv latents -> per-head q, k (RoPE applied) and v, with the latents'
        RMSNorms and RoPE of the rotary parts (by ``position_ids`` when given)."""
        bsz, seq, _ = kv.shape
        if position_ids is not None:
            check_position_ids(position_ids, (bsz, seq), "MLAttention")
        q = self.q_b_proj(self.q_a_layernorm(q_latent)) if hasattr(self, "q_a_proj") else self.q_proj(q_latent)
        q_nope, q_pe = q.view(bsz, seq, self.n_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        cos, sin = cos_sin(seq, self.rope, self.rope_spec, compute_dtype(kv), kv.device, position_ids)
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin, self.interleave)  # one rotary key for all heads
        kv_up = self.kv_b_proj(self.kv_a_layernorm(latent))
        k_nope, v = kv_up.view(bsz, seq, self.n_heads, -1).split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return q, k, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal softmax attention -> (batch, seq, heads * v_head_dim), before the output projection;
        ``documents``: the packed rows' block-diagonal mask."""
        return core_attention(q, k, v, self.softmax_scale, self.core_kind, documents)

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """Per token, in activation-dtype elements (``common.Elements``), for one sequence per micro-batch: the
        down-projections' input (one storage, or each FP8 down-projection's E4M3 copy, one shared with
        ``share_fp8_input``), RoPE's cos/sin, the query latent's norm and ``q_b_proj``'s input,
        ``kv_a_proj_with_mqa``'s output (the kv norm reads a view of it; a float32 copy of the latent in a
        low-precision model) with the kv norm's and
        ``kv_b_proj``'s input, the core's (eager: q, k, the k_nope|v buffer ·V reads, the probabilities, also in the
        activation dtype when it differs, and the causal mask; ``"recomputed"``: q, k, v; ``"flash"``: q, k, v and
        one log-sum-exp per head) and ``o_proj``'s input. ``"selective"`` (``attend`` recomputed) keeps the input, the
        two latents, ``o_proj``'s input (and a flash core's log-sum-exp); ``"full"``: nothing (the enclosing block
        keeps its input). The attention norm before it is the block's."""
        if policy == "full":
            return {}
        e = Elements(self)
        lora = hasattr(self, "q_a_proj")
        down = self.q_a_proj if lora else self.q_proj
        hidden, heads, dqk, dv = down.in_features, self.n_heads, self.nope + self.rope, self.v_dim
        if is_fp8(down) and is_fp8(self.kv_a_proj_with_mqa):
            x = e.fp8(hidden) * (1 if self.share_fp8_input and lora else 2)
        else:
            x = e.linear_input(down, hidden) if is_fp8(down) or is_fp8(self.kv_a_proj_with_mqa) else float(hidden)
        kept: dict[str, float] = {"input": x, "o_proj_input": e.linear_input(self.o_proj, heads * dv)}
        flash = self.core_kind == "flash"
        if policy == "selective":
            q_lora = self.q_a_proj.out_features if lora else 0
            kept["latents"] = q_lora + self.kv_lora_rank + self.rope
            return {**kept, "lse": e.compute(heads)} if flash else kept
        kept["rope"] = e.compute(self.rope)
        if lora:
            q_lora = self.q_a_proj.out_features
            kept["q_a_layernorm"] = sum(self.q_a_layernorm.saved_per_token(policy, seq).values())
            kept["q_b_proj_input"] = e.linear_input(self.q_b_proj, q_lora)
        lat = self.kv_lora_rank
        if self.kv_a_layernorm.recompute:
            kept["kv"] = lat + self.rope
        else:
            kept["kv"] = e.compute(lat) if e.upcast else lat + self.rope
            kept["kv_a_layernorm"] = e.compute(lat + 1)
        kept["kv_b_proj_input"] = e.linear_input(self.kv_b_proj, lat)
        if self.core_kind == "eager":
            kept.update(qk=heads * 2 * dqk, v=heads * (dv + self.nope),
                        probs=heads * seq * (e.compute(1) + (1 if e.upcast else 0)), mask=e.bools(seq))
        else:
            kept.update(qkv=heads * (2 * dqk + dv))
            if flash:
                kept["lse"] = e.compute(heads)
        return kept
