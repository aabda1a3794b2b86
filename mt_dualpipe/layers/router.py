"""MoE routers: token -> (k expert ids, k gate weights), with pluggable scoring.

Every router is a module with a ``weight`` of shape (num_experts, hidden) (transformers' ``mlp.gate.weight``)
and ``forward(x)`` on flattened tokens (tokens, hidden) returning a ``Routing``. ``MoEBlock`` only reads
the ``Routing``, so a router with another scoring plugs in without touching dispatch, experts or combine:

- ``SoftmaxTopKRouter`` (Qwen3-MoE, Mixtral, OLMoE): softmax over all experts, top-k, optionally
  renormalised over the k (``norm_topk_prob``).
- ``SigmoidGroupLimitedRouter`` (DeepSeek-V3, ``topk_method="noaux_tc"``): sigmoid affinities, a
  selection-only bias (``e_score_correction_bias``, moved by auxiliary-loss-free balancing), top-k inside
  the best expert groups (``group_limited_topk``), gate weights the unbiased affinities renormalised and
  times ``routed_scaling_factor``. DeepSeek-V3's own ``Gate`` (``models/deepseek_v3/moe.py``) is a
  ``Router`` too: it selects with the same ``group_limited_topk`` and adds what its runtime needs
  (device-limited routing, the router-input saver, load counting, DeepSeek-V2's scorings).

``Router.balance_probs(scores)`` gives the per-expert probabilities a balance loss averages: the softmax
itself, or the sigmoid affinities normalised per token.

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

    cheap_weight_grad = True  # a (tokens x hidden x experts) GEMM, small next to the experts: computed during B

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

    def balance_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """(tokens, experts) probabilities for a balance loss (``layers.balance``); softmax scores as is."""
        return scores

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        return {"logits": self.num_experts, "probs": self.num_experts, "topk": 2 * self.top_k}


def chosen_weights(scores: torch.Tensor, indices: torch.Tensor, renormalise: bool, scale: float = 1.0
                   ) -> torch.Tensor:
    """The gate weights of the chosen experts: their scores, renormalised over the k when asked, times
    ``scale`` (DeepSeek's ``routed_scaling_factor``); the choice itself carries no gradient."""
    weights = scores.gather(1, indices)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale


def group_limited_topk(choice: torch.Tensor, top_k: int, n_groups: int, topk_groups: int,
                       group_score: str = "top2") -> torch.Tensor:
    """Expert ids (tokens, k): the experts split into ``n_groups`` equal groups, each scored by the sum of
    its two best ``choice`` values (``"top2"``, DeepSeek-V3) or its best (``"max"``, DeepSeek-V2), the
    ``topk_groups`` best groups kept, top-k inside them. One group: plain top-k."""
    if n_groups <= 1:
        return choice.topk(top_k, dim=-1).indices
    grouped = choice.view(choice.size(0), n_groups, -1)
    if group_score == "top2":
        score = grouped.topk(2, dim=-1).values.sum(-1)
    elif group_score == "max":
        score = grouped.amax(dim=-1)
    else:
        raise ValueError(f"group_score must be 'top2' or 'max', got {group_score!r}")
    best = score.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1).topk(top_k, dim=-1).indices


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


class SigmoidGroupLimitedRouter(Router):
    """DeepSeek-V3's routing (report §2.1.2): s = sigmoid(u·e); experts picked by s + bias inside the best
    ``topk_groups`` of ``n_groups`` groups; gate weights s of the picked experts, renormalised over the k
    (``norm_topk_prob``) and times ``route_scale``. The bias is a buffer (no gradient): auxiliary-loss-free
    balancing moves it between steps."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, n_groups: int = 1, topk_groups: int = 1,
                 route_scale: float = 1.0, norm_topk_prob: bool = True) -> None:
        super().__init__(hidden, num_experts, top_k)
        if n_groups < 1 or num_experts % n_groups or not 0 < topk_groups <= n_groups:
            raise ValueError(f"n_group ({n_groups}) must divide n_routed_experts ({num_experts}) and topk_group "
                             f"({topk_groups}) must be in 1..n_group")
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.route_scale, self.norm_topk_prob = route_scale, norm_topk_prob
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        with torch.no_grad():
            choice = scores + self.e_score_correction_bias.to(scores.dtype)
            indices = group_limited_topk(choice, self.top_k, self.n_groups, self.topk_groups)
        return chosen_weights(scores, indices, self.norm_topk_prob, self.route_scale), indices, scores

    def balance_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / scores.sum(-1, keepdim=True)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, groups={self.topk_groups}/{self.n_groups}, "
                f"route_scale={self.route_scale}")
