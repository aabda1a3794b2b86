"""MoE routers: token -> (k expert ids, k gate weights), with pluggable scoring.

Every router is a module with a ``weight`` of shape (num_experts, hidden) (transformers' ``mlp.gate.weight``)
and ``forward(x)`` on flattened tokens (tokens, hidden) returning a ``Routing``. ``MoEBlock`` only reads
the ``Routing``, so a router with another scoring plugs in without touching dispatch, experts or combine:

- ``SoftmaxTopKRouter`` (Qwen3-MoE, Mixtral, OLMoE): softmax over all experts, top-k, optionally
  renormalised over the k (``norm_topk_prob``).
- ``GroupLimitedRouter`` (DeepSeek-V3, and V2's variants): sigmoid (or softmax) affinities, a selection-only
  bias (``e_score_correction_bias``, moved by auxiliary-loss-free balancing from the routed-token counts
  ``load`` it keeps, ``update_bias``), top-k inside the best expert groups (``group_limited_topk``) or
  inside the best devices (``balance.device_limited_mask``), gate weights the unbiased affinities
  renormalised and times ``routed_scaling_factor``.

``Router.balance_probs(scores)`` gives the per-expert probabilities a balance loss averages: the softmax
itself, or the sigmoid affinities normalised per token.

Precision: by default the logits are ``F.linear`` in the input dtype, the softmax and the selection run in
``compute_dtype`` and the gate weights come back in the input dtype. ``upcast=True`` (transformers'
DeepSeek-V3) casts the input and the weight to ``compute_dtype`` before the GEMM and returns the gate
weights in it (the combine casts them to the rows' dtype). Autograd then keeps those float32 copies; the
``"router"`` saver (``keep_input=True``) keeps the input as given instead and re-runs the casts and the GEMM
in B — or, when the input is the output of a recomputed RMSNorm (its ``rms_norm_source``), keeps nothing of
its own and rebuilds the input from what the norm keeps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .balance import bias_update, device_limited_mask
from .common import Elements, compute_dtype
from .norm import rms_norm

SCORINGS = ("sigmoid", "softmax")
SELECTIONS = ("noaux_tc", "group_limited_greedy", "greedy")  # transformers' ``topk_method`` values


class Routing(NamedTuple):
    weights: torch.Tensor  # (tokens, k) gate weights, input dtype
    indices: torch.Tensor  # (tokens, k) expert ids (int64)
    scores: torch.Tensor  # (tokens, num_experts) the scores the selection read (for balance losses/stats)


class _KeptInputLogits(torch.autograd.Function):
    """``F.linear`` in ``cdt`` keeping its input and weight as given (the ``"router"`` saver): eager autograd
    keeps the ``cdt`` casts of both (the input per token, the weight once per micro-batch). B re-runs the
    casts and the GEMM and differentiates them, so the gradients are bit-equal to eager's at the cost of one
    more router GEMM (tokens × hidden × experts).

    ``source`` (the input is the output of a recomputed RMSNorm, ``norm.RMSNorm``): keep the norm's input
    (which the norm keeps anyway: one storage) and weight instead of the input, and rebuild the input in B
    with the same ``norm.rms_norm`` call (bit-identical to the forward's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype, source: tuple | None
                ) -> torch.Tensor:
        if source is None:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(source[0], weight, source[1])
            ctx.eps, ctx.fused, ctx.x_shape = source[2], source[3], x.shape
        ctx.from_norm, ctx.cdt = source is not None, cdt
        return F.linear(x.to(cdt), weight.to(cdt))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.from_norm:
            norm_in, weight, norm_w = ctx.saved_tensors
            x = rms_norm(norm_in, norm_w, ctx.eps, ctx.fused).view(ctx.x_shape)
        else:
            x, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((x, weight), ctx.needs_input_grad)]
            out = F.linear(leaves[0].to(ctx.cdt), leaves[1].to(ctx.cdt))
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(got) if t.requires_grad else None for t in leaves), None, None)


class Router(nn.Module):
    """Base: the gate projection; subclasses define ``select(logits)``. ``upcast`` and ``keep_input``: see
    the module docstring."""

    cheap_weight_grad = True  # a (tokens x hidden x experts) GEMM, small next to the experts: computed during B

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, upcast: bool = False,
                 keep_input: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k = num_experts, top_k
        self.upcast, self.keep_input = upcast, keep_input
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor, source: tuple | None = None) -> Routing:
        """x (tokens, hidden) -> ``Routing``. ``source``: (input, weight, eps, fused) of the recomputed RMSNorm
        whose output ``x`` is (read by the ``"router"`` saver only)."""
        cdt = compute_dtype(x)
        if not self.upcast:
            weights, indices, scores = self.select(F.linear(x, self.weight).to(cdt))
            return Routing(weights.to(x.dtype), indices, scores)
        if self.keep_input and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            logits = _KeptInputLogits.apply(x, self.weight, cdt, source)
        else:
            logits = F.linear(x.to(cdt), self.weight.to(cdt))
        return Routing(*self.select(logits))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def balance_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """(tokens, experts) probabilities for a balance loss (``layers.balance``); softmax scores as is."""
        return scores

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """Its own tensors per token, never recomputed (the input is the MoE block's to count: other readers share
        it): the logits and probabilities and the chosen ids; with ``upcast`` the float32 affinities, gate
        weights, the balance losses' per-token terms and the ids the gate weights were gathered with."""
        if not self.upcast:
            return {"logits": self.num_experts, "probs": self.num_experts, "topk": 2 * self.top_k}
        e = Elements(self)
        return {"scores": e.compute(self.num_experts), "weights": e.compute(self.top_k),
                "balance_terms": e.compute(3), "topk_index": e.index(self.top_k)}

    def input_per_token(self, seq: int, norm_recomputed: bool) -> dict[str, float]:
        """What reading its input adds per token beyond the input as given: with ``upcast`` (and without the
        ``"router"`` saver) the compute-dtype copies of the input and, once per ``seq``-token sequence, of the
        weight; with the saver nothing (it keeps the input as given, or rebuilds it from a recomputed norm's
        input, ``norm_recomputed``). ``keeps_given_input`` says whether the input as given is kept."""
        e = Elements(self)
        if self.upcast and not self.keep_input and e.upcast:
            return {"router_input": e.compute(self.weight.size(1)),
                    "router_weight": e.compute(self.weight.numel()) / seq}
        return {}

    def keeps_given_input(self, norm_recomputed: bool) -> bool:
        """Whether the input tensor itself stays alive for B because of this router."""
        if not self.upcast:
            return True  # F.linear keeps it
        if self.keep_input:
            return not norm_recomputed
        return not Elements(self).upcast  # the compute-dtype cast of a float32 input is the input itself


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


class GroupLimitedRouter(Router):
    """DeepSeek's routing (V3 report §2.1.2; V2's variants by ``selection``): s = sigmoid(u·e) (or the softmax,
    ``scoring``); the experts picked by ``selection``:

    - ``"noaux_tc"`` (V3): by s + bias inside the best ``topk_groups`` of ``n_groups`` groups, a group scored by
      the sum of its two best biased affinities;
    - ``"group_limited_greedy"`` (V2): by s inside the best groups, a group scored by its best affinity;
    - ``"greedy"``: plain top-k of s;

    and ``device_limit`` M > 0 confines the choice to the M best of ``device_groups`` contiguous expert
    devices instead of the groups. The gate weights are the chosen s, renormalised over the k
    (``norm_topk_prob``) and times ``route_scale``. The bias is a buffer (no gradient): ``update_bias`` moves it
    by ``bias_update_speed`` from the routed-token counts ``load`` (training forwards only) between steps."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, scoring: str = "sigmoid",
                 selection: str = "noaux_tc", n_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 norm_topk_prob: bool = True, device_groups: int = 1, device_limit: int = 0,
                 bias_update_speed: float = 0.0, upcast: bool = False, keep_input: bool = False) -> None:
        super().__init__(hidden, num_experts, top_k, upcast=upcast, keep_input=keep_input)
        if n_groups < 1 or num_experts % n_groups or not 0 < topk_groups <= n_groups:
            raise ValueError(f"n_group ({n_groups}) must divide n_routed_experts ({num_experts}) and topk_group "
                             f"({topk_groups}) must be in 1..n_group")
        if scoring not in SCORINGS or selection not in SELECTIONS:
            raise ValueError(f"scoring must be one of {SCORINGS} and selection one of {SELECTIONS}, got "
                             f"{scoring!r} and {selection!r}")
        self.scoring, self.selection = scoring, selection
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.route_scale, self.norm_topk_prob = route_scale, norm_topk_prob
        self.device_groups, self.device_limit = device_groups, device_limit
        self.bias_update_speed = bias_update_speed
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.register_buffer("load", torch.zeros(num_experts), persistent=False)  # routed pairs since the update

    def forward(self, x: torch.Tensor, source: tuple | None = None) -> Routing:
        routing = super().forward(x, source)
        if self.training and torch.is_grad_enabled():  # training forwards only, not evaluation
            self.load += torch.bincount(routing.indices.flatten(), minlength=self.num_experts).to(self.load.dtype)
        return routing

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids (tokens, k) by ``selection`` (the caller makes it gradient-free)."""
        if self.selection == "greedy" and not self.device_limit:
            return scores.topk(self.top_k, dim=-1).indices
        choice = scores + self.e_score_correction_bias.to(scores.dtype) if self.selection == "noaux_tc" else scores
        if self.device_limit:  # device-/node-limited routing takes the place of the expert groups
            keep = device_limited_mask(choice, self.device_groups, self.device_limit, self.top_k)
            return choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        group_score = "top2" if self.selection == "noaux_tc" else "max"
        return group_limited_topk(choice, self.top_k, self.n_groups, self.topk_groups, group_score)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        with torch.no_grad():
            indices = self.choose(scores)
        return chosen_weights(scores, indices, self.norm_topk_prob, self.route_scale), indices, scores

    def balance_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / scores.sum(-1, keepdim=True) if self.scoring == "sigmoid" else scores

    @torch.no_grad()
    def update_bias(self, speed: float | None = None) -> None:
        """Auxiliary-loss-free balancing: b_i += γ·sign(mean load − load_i) (γ ``speed`` or
        ``bias_update_speed``), then the counts restart. Sum ``load`` over every replica of the layer first,
        so all replicas move their bias identically."""
        gamma = self.bias_update_speed if speed is None else speed
        if self.load.sum() > 0 and gamma > 0:
            bias_update(self.e_score_correction_bias, self.load, gamma)
        self.load.zero_()

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, {self.scoring}, {self.selection}, "
                f"groups={self.topk_groups}/{self.n_groups}, route_scale={self.route_scale}")
