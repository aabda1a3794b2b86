"""Expert-load balancing for MoE routers: the losses, the strategies, and the autograd trick that adds a loss
from inside a layer.

A balance loss is computed where the routing happens (any pipeline stage), but must reach the step's
total loss without travelling through the stage outputs. ``AuxLoss`` does it: an identity on the gate
weights whose backward also hands the loss its gradient (``scale``: 1.0 when each micro-batch's loss is
backpropagated as is, 1/M when the runtime averages M micro-batches), so the loss is differentiated as
part of the same backward, in B, wherever the layer lives.

``switch_balance_loss`` is the Switch Transformer / transformers (``load_balancing_loss_func``) form for
softmax routers: N·Σ_i f_i·P_i with f_i the fraction of (token, slot) pairs routed to expert i (out of
T tokens: Σ_i f_i = K) and P_i the mean router probability.

The strategies, as plain tensor formulas for a top-k mixture of experts.

Notation: T tokens, N routed experts, each token sends to K of them; s (T, N) are the router
affinities, ``indices`` (T, K) the chosen experts (column 0 the best choice), ``load_i`` how many
(token, expert) pairs chose expert i.

* **auxiliary-loss-free bias** (DeepSeek-V3 §2.1.2): a bias b picks experts but never weights them;
  after each step ``b_i += γ·sign(mean(load) − load_i)`` (``bias_update``).
* **sequence-wise balance loss** (DeepSeek-V3 eq. 17-20): per sequence of length S,
  ``f_i = N/(K·S)·#{t in seq: i chosen}``, ``P_i = mean_t s'_{t,i}`` with s' = s normalised per
  token, loss ``α·Σ_i f_i P_i`` averaged over sequences (``sequence_balance_loss``).
* **batch-wise auxiliary loss** (Switch / GShard): the same ``Σ_i f_i P_i`` with f and P over the
  whole batch *across the expert-parallel ranks*: the counts are all-reduced (no gradient), P is
  each rank's own mean, so the mean of the ranks' losses is the global-batch loss when the ranks
  hold equal token counts (``batch_balance_loss``). 1 when perfectly balanced.
* **device-/node-limited routing** (DeepSeek-V2 §2.2.1, V3 §2.1.2): the experts are split into D
  contiguous devices (EP ranks or nodes); a device scores the sum of its ⌈K/M⌉ highest affinities,
  only the M best devices stay eligible, so a token reaches at most M of them
  (``device_limited_mask``).
* **capacity factor with dropping** (GShard): each expert takes at most
  ``C = ceil(cf·T·K/N)`` pairs; pairs are served in priority order and the rest dropped (their
  expert output is zero, the token keeps its residual and its other experts). Priority
  ``"position"``: every token's first choice before any second choice, earlier tokens first
  (GShard); ``"score"``: higher gate weight first (batch-prioritised routing). cf = 0 keeps every
  pair (DeepSeek-V3's default, ``capacity_keep``).

``STRATEGIES`` names the combinations the demo and ``benchmarks/balancing.py`` select by name; each
maps to a family config's MoE fields (``DeepSeekV3Config``'s names).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class AuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward also gives ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def switch_balance_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """N·Σ_i f_i·P_i for one layer's tokens: ``probs`` (T, N) router probabilities (differentiated),
    ``indices`` (T, K) the chosen experts (counted, not differentiated). Equal to transformers'
    ``load_balancing_loss_func`` on one layer's logits without an attention mask."""
    tokens, n_experts = probs.shape
    counts = torch.bincount(indices.flatten(), minlength=n_experts).to(probs.dtype)
    return n_experts * (counts / tokens * probs.mean(0)).sum()

PRIORITIES = ("position", "score")

# name -> DeepSeekV3Config overrides. The keys not listed keep the config's values.
STRATEGIES: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's recipe: bias update γ plus the tiny sequence-wise loss α (today's default).
    "aux_free": dict(bias_update_speed=1e-3, balance_loss_weight=1e-4, batch_balance_loss_weight=0.0,
                     device_limit=0, capacity_factor=0.0),
    # Sequence-wise auxiliary loss only, at a weight that matters (no bias update).
    "seq_aux": dict(bias_update_speed=0.0, balance_loss_weight=1e-2, batch_balance_loss_weight=0.0,
                    device_limit=0, capacity_factor=0.0),
    # Switch/GShard batch-wise auxiliary loss over the batch on all EP ranks.
    "batch_aux": dict(bias_update_speed=0.0, balance_loss_weight=0.0, batch_balance_loss_weight=1e-2,
                      device_limit=0, capacity_factor=0.0),
    # The V3 recipe with each token confined to 1 of 2 devices (as on 2 EP ranks; replaces the groups).
    "device_limited": dict(bias_update_speed=1e-3, balance_loss_weight=1e-4, batch_balance_loss_weight=0.0,
                           device_groups=2, device_limit=1, capacity_factor=0.0),
    # GShard: batch loss plus capacity 1.0 with dropping in position priority.
    "capacity": dict(bias_update_speed=0.0, balance_loss_weight=0.0, batch_balance_loss_weight=1e-2,
                     device_limit=0, capacity_factor=1.0, capacity_priority="position"),
    # No balancing at all (the baseline the others are judged against).
    "none": dict(bias_update_speed=0.0, balance_loss_weight=0.0, batch_balance_loss_weight=0.0,
                 device_limit=0, capacity_factor=0.0),
}


def strategy_overrides(name: str) -> dict[str, Any]:
    """Config overrides of the strategy ``name`` (one of ``STRATEGIES``)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown expert-balancing strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return dict(STRATEGIES[name])


def bias_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """Auxiliary-loss-free step in place: ``b_i += γ·sign(mean(load) − load_i)``; returns ``bias``."""
    return bias.add_(gamma * torch.sign(load.float().mean() - load.float()).to(bias.dtype))


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, topk: int) -> torch.Tensor:
    """Σ_i f_i·P_i per sequence, averaged over sequences (DeepSeek-V3 eq. 17-20, without α)."""
    n_experts = scores.size(-1)
    seq = scores.size(0) // batch
    probs = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, n_experts).mean(1)
    hits = torch.zeros(batch, n_experts, dtype=scores.dtype, device=scores.device).scatter_add_(
        1, indices.view(batch, -1), torch.ones(batch, seq * topk, dtype=scores.dtype, device=scores.device))
    f = hits * (n_experts / (topk * seq))
    return (f * probs).sum(-1).mean()


def batch_balance_loss(scores: torch.Tensor, indices: torch.Tensor, topk: int,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Σ_i f_i·P_i with f over all tokens of every rank in ``group`` and P this rank's mean (no α).

    ``f_i = N/(K·T_all)·load_i`` (load and T_all summed over the group), ``P_i = mean_t s'_{t,i}``.
    """
    n_experts = scores.size(-1)
    counts = torch.bincount(indices.flatten(), minlength=n_experts).to(torch.float64)
    tokens = torch.tensor([float(scores.size(0))], dtype=torch.float64, device=counts.device)
    if group is not None and dist.get_world_size(group) > 1:
        both = torch.cat([counts, tokens])
        dist.all_reduce(both, group=group)
        counts, tokens = both[:-1], both[-1:]
    f = (counts * (n_experts / (topk * float(tokens)))).to(scores.dtype)
    probs = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return (f * probs).sum()


def device_limited_mask(choice: torch.Tensor, n_devices: int, limit: int, topk: int) -> torch.Tensor:
    """(T, N) bool: True for the experts on each token's ``limit`` best devices.

    A device's score is the sum of its ⌈topk/limit⌉ highest ``choice`` values (the biased affinities
    when the bias is used); experts ``d·N/D .. (d+1)·N/D − 1`` live on device d.
    """
    tokens, n_experts = choice.shape
    per_device = n_experts // n_devices
    best = math.ceil(topk / limit)
    device_score = choice.view(tokens, n_devices, per_device).topk(best, dim=-1).values.sum(-1)
    chosen = device_score.topk(limit, dim=-1).indices
    keep = torch.zeros(tokens, n_devices, dtype=torch.bool, device=choice.device).scatter_(1, chosen, True)
    return keep.repeat_interleave(per_device, dim=1)


def expert_capacity(tokens: int, topk: int, n_experts: int, capacity_factor: float) -> int:
    """GShard's per-expert capacity ``ceil(cf·T·K/N)``."""
    return math.ceil(capacity_factor * tokens * topk / n_experts)


def capacity_keep(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity_factor: float,
                  priority: str = "position") -> torch.Tensor:
    """(T, K) bool: which (token, choice) pairs fit their expert's capacity, served in ``priority`` order.

    ``capacity_factor`` 0 keeps all. ``"position"``: pair (t, k) ranks by (k, t); ``"score"``: by
    descending gate weight (ties by (k, t)).
    """
    if priority not in PRIORITIES:
        raise ValueError(f"capacity priority {priority!r} is not supported; choose one of {PRIORITIES}")
    tokens, topk = indices.shape
    if capacity_factor <= 0:
        return torch.ones_like(indices, dtype=torch.bool)
    cap = expert_capacity(tokens, topk, n_experts, capacity_factor)
    # Priority order over the flattened (t, k) pairs: k-major, then token position.
    order = torch.arange(tokens * topk, device=indices.device).view(tokens, topk).t().flatten()  # t*K+k, k-major
    if priority == "score":
        w = weights.detach().flatten()[order]
        order = order[torch.argsort(-w, stable=True)]
    experts = indices.flatten()[order]
    by_expert = torch.argsort(experts, stable=True)  # rows grouped by expert, priority kept inside
    sorted_experts = experts[by_expert]
    starts = torch.searchsorted(sorted_experts, sorted_experts, right=False)
    rank_in_expert = torch.arange(sorted_experts.numel(), device=indices.device) - starts
    keep = torch.zeros(tokens * topk, dtype=torch.bool, device=indices.device)
    keep[order[by_expert]] = rank_in_expert < cap
    return keep.view(tokens, topk)
