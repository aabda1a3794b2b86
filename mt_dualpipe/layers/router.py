"""MoE routers: token -> (k expert ids, k gate weights), with pluggable scoring.

Every router is a module with a ``weight`` of shape (num_experts, hidden) (transformers' ``mlp.gate.weight``)
and ``forward(x)`` on flattened tokens (tokens, hidden) returning a ``Routing``. ``MoEBlock`` only reads
the ``Routing``, so a router with another scoring plugs in without touching dispatch, experts or combine:

- ``SoftmaxTopKRouter`` (Qwen3-MoE, Mixtral, OLMoE): softmax over all experts, top-k, optionally
  renormalised over the k (``norm_topk_prob``).
- DeepSeek-V3's sigmoid scores with a selection-only bias, group-limited top-k and ``routed_scaling_factor``
  fit the same interface (``scores`` would carry the sigmoid scores the balance losses read); it is not
  ported here yet (``integrations/deepseek_v3/moe.py`` ``Gate``).

The logits are ``F.linear`` in the input dtype; the softmax and the selection run in ``compute_dtype``;
the gate weights come back in the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .common import compute_dtype


class Routing(NamedTuple):
    weights: torch.Tensor  # (tokens, k) gate weights, input dtype
    indices: torch.Tensor  # (tokens, k) expert ids (int64)
    scores: torch.Tensor  # (tokens, num_experts) the scores the selection read (for balance losses/stats)


class Router(nn.Module):
    """Base: the gate projection; subclasses define ``select(logits)``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        weights, indices, scores = self.select(logits.to(compute_dtype(x)))
        return Routing(weights.to(x.dtype), indices, scores)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        return {"logits": self.num_experts, "probs": self.num_experts, "topk": 2 * self.top_k}


class SoftmaxTopKRouter(Router):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool = False) -> None:
        super().__init__(hidden, num_experts, top_k)
        self.norm_topk_prob = norm_topk_prob

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = logits.softmax(dim=-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices, probs

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
