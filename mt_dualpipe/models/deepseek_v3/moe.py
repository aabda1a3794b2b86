"""DeepSeekMoE: shared + routed experts, sigmoid gating, group-limited top-k, two balancing terms.

Routing (report §2.1.2; other ``topk_method`` / ``scoring_func`` values in ``Gate``): affinities
s = sigmoid(u·e); a per-expert bias b is added *only to pick*
experts (groups scored by the sum of their two best biased affinities, the best
``n_limited_groups`` kept, top-k inside them); the gate weights are the unbiased affinities of the
chosen experts, normalised to sum 1 and scaled by ``route_scale``. After each optimizer step
``update_expert_bias`` moves b by γ·sign(mean load − load) (auxiliary-loss-free balancing).
A small sequence-wise balance loss α·Σ f_i P_i is added through ``AuxLoss``, which leaves the
forward value untouched and injects the loss gradient in backward, so it reaches the total loss
from any pipeline stage without travelling through the stage outputs. The other strategies
(batch-wise loss, device-/node-limited routing, capacity with dropping) are config switches; their
formulas are in ``layers/balance.py``.

The forward is written as four pieces — ``route``, dispatch, ``run_experts``, combine — so the
overlapped forward/backward can interleave them with another micro-batch's pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...layers.balance import (
    AuxLoss,
    batch_balance_loss,
    bias_update,
    capacity_keep,
    device_limited_mask,
    sequence_balance_loss,
)
from ...layers.common import compute_dtype
from ...layers.expert_parallel import DEFAULT_TIMEOUT, DispatchPlan, all_to_all, ep_rank, ep_size, plan_dispatch
from ...layers.mlp import SwiGLUMLP
from ...layers.norm import rms_norm
from ...layers.router import Router, Routing, chosen_weights, group_limited_topk
from ...parallel.weight_kinds import set_weight_kind
from .config import DeepSeekV3Config


def set_aux_loss_scale(module: nn.Module | Sequence[nn.Module], scale: float) -> int:
    """Gradient the balance loss receives per backward, for every MoE layer under ``module`` (a model,
    a stage or a list of stages): 1.0 when each micro-batch loss is backpropagated as is (the DualPipe
    convention), 1/M when the runtime divides losses by M micro-batches. Returns the layers set."""
    mods = module if isinstance(module, nn.Module) else nn.ModuleList(module)
    layers = moe_layers(mods)
    for m in layers:
        m.aux_loss_scale = float(scale)
    return len(layers)


def mlp(dim: int, inter_dim: int, recompute_product: bool = False) -> SwiGLUMLP:
    """DeepSeek-V3's SwiGLU (dense FFN, each routed expert, the shared experts): the shared layer's, whose
    product the ``"selective"`` policy leaves alone (DeepSeek-V3's selective recomputes MLA only)."""
    return SwiGLUMLP(dim, inter_dim, recompute_product=recompute_product, selective=False)


class RowWeights:
    """The received rows' gate weights (the ``"combine"`` saver) and, after the experts' backward, their
    gradient: the hand-off between the router's autograd graph and the experts' (which may be separate
    graphs: the overlapped F&B's pieces are joined by detached leaves)."""

    def __init__(self, value: torch.Tensor, tracked: bool) -> None:
        self.value = value
        self.tracked = tracked  # the router side waits for a gradient
        self.grad: torch.Tensor | None = None


class _SendRowWeightGrad(torch.autograd.Function):
    """Router side: identity on the dispatched rows that also gives ``row_w`` the gradient the experts
    left on ``box``. The rows' gradient comes out of the experts' backward, after ``_TakeRowWeights``
    has filled ``box``, so the order holds within one graph and across pieces."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, row_w: torch.Tensor, box: RowWeights) -> torch.Tensor:
        ctx.box = box
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box, ctx.box = ctx.box, None
        got, box.grad = box.grad, None
        return grad, got, None


class _TakeRowWeights(torch.autograd.Function):
    """Expert side: (rows, the box's weights) as outputs tied to the received rows, so the weights' gradient
    is stored in the box before the rows' gradient leaves this node. Keeps nothing for backward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, box: RowWeights) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.box = box
        return rows.view_as(rows), box.value.view_as(box.value)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor, grad_w: torch.Tensor):
        box, ctx.box = ctx.box, None
        box.grad = grad_w
        return grad_rows, None


class _RouterLogits(torch.autograd.Function):
    """``F.linear`` of the router in ``cdt`` keeping its input and weight as given (the ``"router"``
    saver): eager autograd keeps the float32 casts of both (the input per token, the weight once per
    micro-batch). B re-runs the casts and the GEMM and differentiates them, so the gradients are
    bit-equal to eager's at the cost of one more router GEMM (tokens × dim × experts).

    ``source`` (the input is the output of a recomputed RMSNorm, ``layers.norm.RMSNorm``): keep the norm's input
    (which the norm keeps anyway: one storage) and the norm weight instead of the input, and rebuild
    the input in B with the same ``layers.norm.rms_norm`` call (bit-identical to the forward's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype, source: tuple | None) -> torch.Tensor:
        if source is None:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(source[0], weight, source[1])
            ctx.eps, ctx.fused, ctx.x_shape = source[2], source[3], x.shape
        ctx.from_norm, ctx.cdt = source is not None, cdt
        return F.linear(x.to(cdt), weight.to(cdt))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
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


class Gate(Router):
    """The router: affinities, expert choice (``config.topk_method``) and gate weights; a shared-layer
    ``Router`` (``layers/router.py``), so it also drives ``layers.MoEBlock`` (tested).

    Scores are computed in ``compute_dtype`` (float32, or float64 for a float64 model) from the
    input and weight cast to it, as transformers does, and so are the gate weights it returns.
    ``bias`` is the selection-only correction of auxiliary-loss-free balancing (HF name
    ``e_score_correction_bias``); only ``noaux_tc`` uses it.
    """

    cheap_weight_grad = True  # a (tokens x dim x experts) GEMM, small next to the experts: computed during B

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config.dim, config.n_routed_experts, config.n_activated_experts)
        self.topk, self.n_groups, self.topk_groups = (config.n_activated_experts, config.n_expert_groups,
                                                      config.n_limited_groups)
        self.route_scale, self.norm_topk_prob = config.route_scale, config.norm_topk_prob
        self.scoring_func, self.topk_method = config.scoring_func, config.topk_method
        self.device_groups, self.device_limit = config.device_groups, config.device_limit
        self.keep_input = config.saves("router")
        if not self.weight.is_meta:  # a gate built on its own must not route on uninitialised memory
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default; the model re-inits it
        # Selection-only bias (not trained by gradients) and the routed-token count since the last update.
        self.register_buffer("bias", torch.zeros(config.n_routed_experts))
        self.register_buffer("load", torch.zeros(config.n_routed_experts), persistent=False)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids (tokens, k): top-k inside the best groups (no gradient flows through the choice)."""
        if self.topk_method == "greedy" and not self.device_limit:
            return scores.topk(self.topk, dim=-1).indices
        choice = scores + self.bias if self.topk_method == "noaux_tc" else scores
        if self.device_limit:  # device-/node-limited routing takes the place of the expert groups
            keep = device_limited_mask(choice, self.device_groups, self.device_limit, self.topk)
            return choice.masked_fill(~keep, float("-inf")).topk(self.topk, dim=-1).indices
        group_score = "top2" if self.topk_method == "noaux_tc" else "max"
        return group_limited_topk(choice, self.topk, self.n_groups, self.topk_groups, group_score)

    def forward(self, x: torch.Tensor, source: tuple | None = None) -> Routing:
        """x (tokens, dim) -> gate weights (tokens, k), expert ids (tokens, k), affinities (tokens, experts).
        ``source``: (input, weight, eps, fused) of the recomputed RMSNorm whose output ``x`` is (``"router"``
        saver)."""
        counting = self.training and torch.is_grad_enabled()  # training forwards only, not evaluation
        cdt = compute_dtype(x)
        if self.keep_input and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            logits = _RouterLogits.apply(x, self.weight, cdt, source)
        else:
            logits = F.linear(x.to(cdt), self.weight.to(cdt))
        weights, indices, scores = self.select(logits)
        if counting:
            self.load += torch.bincount(indices.flatten(), minlength=self.load.numel()).to(self.load.dtype)
        return Routing(weights, indices, scores)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Router.select``: affinities (sigmoid or softmax), the choice, the chosen affinities renormalised
        (``norm_topk_prob``) and times ``route_scale``."""
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        with torch.no_grad():
            indices = self.choose(scores)
        return chosen_weights(scores, indices, self.norm_topk_prob, self.route_scale), indices, scores

    def balance_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / scores.sum(-1, keepdim=True) if self.scoring_func == "sigmoid" else scores


class MoE(nn.Module):
    """Shared experts plus the local shard of the routed experts (all of them when ``ep_group`` is None)."""

    def __init__(self, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        size = ep_size(ep_group)
        if config.n_routed_experts % size:
            raise ValueError(f"n_routed_experts ({config.n_routed_experts}) must be divisible by the expert-parallel "
                             f"group size ({size})")
        self.ep_group, self.n_experts, self.topk = ep_group, config.n_routed_experts, config.n_activated_experts
        self.balance_weight, self.bias_update_speed = config.balance_loss_weight, config.bias_update_speed
        self.batch_balance_weight = config.batch_balance_loss_weight
        self.capacity_factor, self.capacity_priority = config.capacity_factor, config.capacity_priority
        self.fp8_dispatch = config.fp8_dispatch
        if config.device_limit and size > 1 and size % config.device_groups:
            raise ValueError(f"device-limited routing over {config.device_groups} devices needs an EP group whose "
                             f"size is a multiple of it, got {size}")
        local = config.n_routed_experts // size
        self.first_expert = ep_rank(ep_group) * local
        self.gate = Gate(config)
        # Keys are global expert ids, so a shard's state dict is a subset of the full model's.
        swiglu = config.saves("swiglu")
        self.experts = nn.ModuleDict({str(i): mlp(config.dim, config.moe_inter_dim, swiglu)
                                      for i in range(self.first_expert, self.first_expert + local)})
        set_weight_kind(self.experts, "expert")  # sharded over ep: gradients reduce over dp only
        self.shared_experts = mlp(config.dim, config.n_shared_experts * config.moe_inter_dim, swiglu) \
            if config.n_shared_experts else None
        self.weight_before_down = config.saves("combine")
        self.balance_loss_sum = 0.0  # detached sum of the balance loss values seen since the last reset
        self.balance_loss_count = 0
        self.dropped_pairs = 0  # (token, expert) pairs dropped by the capacity since the last reset
        self.routed_pairs = 0
        self.aux_loss_scale = 1.0  # gradient of the balance loss per backward (``set_aux_loss_scale``)
        self.ep_timeout = DEFAULT_TIMEOUT  # seconds an expert all-to-all may wait (``set_timeout``)

    # ----- the four pieces -----------------------------------------------------------------------------
    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan, torch.Tensor]:
        """h (batch, seq, dim) -> (gate weights with the balance losses attached, ids, plan, rows to send)."""
        flat = h.flatten(0, 1)
        weights, indices, scores = self.gate(flat, getattr(h, "rms_norm_source", None))
        if self.training and torch.is_grad_enabled():
            weights = self._attach_balance_losses(weights, indices, scores, h.size(0))
        keep = None
        if self.capacity_factor > 0:
            keep = capacity_keep(indices, weights, self.n_experts, self.capacity_factor, self.capacity_priority)
            if self.training and torch.is_grad_enabled():
                self.dropped_pairs += int((~keep).sum())
                self.routed_pairs += keep.numel()
        plan = plan_dispatch(indices, self.n_experts, self.ep_group, self.ep_timeout, keep=keep)
        rows = flat[plan.token_of]
        if self.weight_before_down:
            rows = self._send_row_weights(weights, plan, rows)
        return weights, indices, plan, rows

    def _send_row_weights(self, weights: torch.Tensor, plan: DispatchPlan, rows: torch.Tensor) -> torch.Tensor:
        """The ``"combine"`` saver: each dispatched row's gate weight, in the rows' dtype (the one the eager
        combine multiplies in), sent to the rows' EP ranks and left on ``plan.row_weights`` for
        ``run_experts``. The experts may run in another autograd graph than the router (the overlapped
        F&B's pieces are joined by detached leaves), so they get a leaf; ``_RowWeightGrad`` on the rows
        hands the leaf's gradient back to the router's graph when the rows' gradient arrives, which is
        after the experts' backward (it produces the rows' gradient)."""
        row_w = all_to_all(weights.flatten()[plan.pair_of].to(rows.dtype).unsqueeze(-1), plan.recv_splits,
                           plan.send_splits, self.ep_group, "dispatch", self.ep_timeout)
        tracked = torch.is_grad_enabled() and row_w.requires_grad
        plan.row_weights = RowWeights(row_w.detach() if tracked else row_w, tracked)
        return _SendRowWeightGrad.apply(rows, row_w, plan.row_weights) if tracked else rows

    def _attach_balance_losses(self, weights: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor,
                               batch: int) -> torch.Tensor:
        """α·sequence-wise + α_b·batch-wise loss, injected through ``AuxLoss`` (value sums are recorded)."""
        total = None
        if self.balance_weight > 0:
            total = self.balance_weight * sequence_balance_loss(scores, indices, batch, self.topk)
        if self.batch_balance_weight > 0:
            term = self.batch_balance_weight * batch_balance_loss(scores, indices, self.topk, self.ep_group)
            total = term if total is None else total + term
        if total is None:
            return weights
        self.balance_loss_sum += float(total.detach())
        self.balance_loss_count += 1
        return AuxLoss.apply(weights, total, self.aux_loss_scale)

    def run_experts(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Received rows (rank-major) -> expert outputs in the same order; with the ``"combine"`` saver
        (``plan.row_weights``) each output is already scaled by its gate weight."""
        box, row_weights = plan.row_weights, None
        if box is not None and box.tracked and torch.is_grad_enabled():
            rows, row_weights = _TakeRowWeights.apply(rows, box)
        elif box is not None:
            row_weights = box.value
        if plan.regroup is not None:
            rows = rows[plan.regroup]
            row_weights = row_weights[plan.regroup] if row_weights is not None else None
        outs = []
        w_chunks = row_weights.split(plan.expert_rows) if row_weights is not None else [None] * len(plan.expert_rows)
        for expert, chunk, w in zip(self.experts.values(), rows.split(plan.expert_rows), w_chunks):
            outs.append((expert(chunk) if w is None else expert(chunk, w)) if chunk.size(0) else chunk)
        out = torch.cat(outs) if outs else rows
        return out[plan.ungroup] if plan.ungroup is not None else out

    def shared(self, h: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(h) if self.shared_experts is not None else None

    @staticmethod
    def combine(rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan, shared: torch.Tensor | None,
                shape: torch.Size) -> torch.Tensor:
        """Returned rows (sorted by expert) -> weighted sum over each token's k experts (+ shared). With the
        ``"combine"`` saver the rows already carry their gate weights: a plain sum, which keeps only the
        unsort index for backward (the weights' gradient reaches them through ``plan.row_weights``)."""
        weighted = plan.row_weights is not None
        if plan.placed is not None:  # some pairs dropped: their expert output is zero
            full = rows.new_zeros(weights.numel(), rows.size(-1)).index_copy(0, plan.placed, rows)
            per_token = full.view(weights.size(0), weights.size(1), -1)
        else:
            per_token = rows[plan.unsort].view(weights.size(0), weights.size(1), -1)
        y = per_token.sum(1) if weighted else (per_token * weights.unsqueeze(-1).type_as(rows)).sum(1)
        y = y.view(shape)
        return y if shared is None else y + shared

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Route, dispatch, experts, combine. With the ``"combine"`` saver the gate weights travel with the
        rows and scale each expert's SwiGLU output before its down-projection (exact: w·W2 p = W2(w·p))."""
        weights, _, plan, rows = self.route(h)
        rows = all_to_all(rows, plan.recv_splits, plan.send_splits, self.ep_group, "dispatch", self.ep_timeout,
                          self.fp8_dispatch)
        rows = self.run_experts(rows, plan)
        rows = all_to_all(rows, plan.send_splits, plan.recv_splits, self.ep_group, "combine", self.ep_timeout)
        return self.combine(rows, weights, plan, self.shared(h), h.shape)


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_timeout(module: nn.Module | Sequence[nn.Module], seconds: float) -> int:
    """Bound every expert all-to-all wait of the MoE layers under ``module`` (a model, a stage or a list
    of stages) to ``seconds``; returns how many layers changed. Keep it at most the pipeline's timeout,
    so ``Rewind``'s agreement, which waits the pipeline's timeout + 60 s, outlasts it. The bound is
    each layer's own ``ep_timeout`` (instance state: two models in one process do not share it)."""
    seconds = float(seconds)
    if not seconds > 0:
        raise ValueError(f"the expert all-to-all timeout must be positive, got {seconds!r}")
    layers = moe_layers(module if isinstance(module, nn.Module) else nn.ModuleList(module))
    for m in layers:
        m.ep_timeout = seconds
    return len(layers)


def set_ep_group(module: nn.Module | Sequence[nn.Module], group: dist.ProcessGroup | None) -> int:
    """Point every MoE layer under ``module`` (a module or a list of stage modules) at ``group``, e.g. a
    fresh group over the same ranks after a failed all-to-all; returns how many layers changed. The
    group must have the size the experts were sharded for."""
    mods = module if isinstance(module, nn.Module) else nn.ModuleList(module)
    layers = moe_layers(mods)
    for m in layers:
        if ep_size(group) != ep_size(m.ep_group):
            raise ValueError(f"the new EP group has {ep_size(group)} ranks, the experts are sharded over "
                             f"{ep_size(m.ep_group)}")
        m.ep_group = group
    return len(layers)


def mark_expert_weights(module: nn.Module | Sequence[nn.Module]) -> int:
    """Mark the routed-expert parameters of every MoE layer under ``module`` as weight kind "expert"
    (``mt_dualpipe.parallel.set_weight_kind``), whatever the EP size: the pipeline then reduces their
    gradients over the expert-data-parallel group (dp) instead of dp x ep. ``MoE.__init__`` marks its
    own; call this again after anything that replaces Parameter objects (loading a checkpoint onto
    the meta device, FP8 conversion). Returns the parameters marked."""
    mods = module if isinstance(module, nn.Module) else nn.ModuleList(module)
    params = [p for m in moe_layers(mods) for p in m.experts.parameters()]
    set_weight_kind(params, "expert")
    return len(params)


@torch.no_grad()
def update_expert_bias(module: nn.Module, speed: float | None = None) -> None:
    """Auxiliary-loss-free balancing: b_i += γ·sign(mean load − load_i), then reset the counts.

    Call after the optimizer step, once the loads of every replica of a layer have been summed
    (``stages.sync_expert_load`` on a mesh, ``sync_replicas(..., what="load")`` without one), so all
    replicas move their bias identically.
    """
    for moe in moe_layers(module):
        gate = moe.gate
        gamma = speed if speed is not None else moe.bias_update_speed
        if gate.load.sum() > 0 and gamma > 0:
            bias_update(gate.bias, gate.load, gamma)
        gate.load.zero_()


def dropped_fraction(module: nn.Module, reset: bool = True) -> tuple[int, int]:
    """(dropped, routed) (token, expert) pairs over the MoE layers since the last reset (capacity only)."""
    layers = moe_layers(module)
    out = (sum(m.dropped_pairs for m in layers), sum(m.routed_pairs for m in layers))
    if reset:
        for m in layers:
            m.dropped_pairs = m.routed_pairs = 0
    return out


def max_violation(module: nn.Module) -> float:
    """Mean over MoE layers of max(load)/mean(load) − 1 (0 = perfectly balanced), from the current counts."""
    vals = [float(m.gate.load.max() / m.gate.load.mean() - 1) for m in moe_layers(module) if m.gate.load.sum() > 0]
    return sum(vals) / len(vals) if vals else 0.0
