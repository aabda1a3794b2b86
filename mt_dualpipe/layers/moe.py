"""The MoE block: router -> dispatch -> experts -> combine, each piece replaceable.

- the router (``router.py``) gives each token k expert ids and gate weights (``Routing``);
- ``Dispatcher`` orders the (token, expert) pairs by expert (a stable sort, so a token's rows keep
  their order) and gathers one row per pair; ``combine`` scatters the expert outputs, times their gate
  weights, back onto their tokens. With an EP group (``ep_group=``) the rows travel by the shared
  dispatcher's all-to-alls (``expert_parallel.py``: bounded waits, overlap points for DualPipe's F&B
  units, FP8 rows), and the block's ``experts`` hold only that rank's share;
- ``Experts`` are one ``SwiGLUMLP`` per expert in a ``ModuleDict`` keyed by the *global* expert id, so
  the state-dict names are transformers' per-expert checkpoint names
  (``mlp.experts.7.gate_proj.weight``) and a shard's state dict is a subset of the full model's;
- optional shared experts (DeepSeek, Qwen2-MoE) are a dense ``SwiGLUMLP`` added to the output;
- ``recompute_product`` (the ``"swiglu"`` saver) is every expert's SwiGLU option; ``weight_before_down`` (the
  ``"combine"`` saver) sends each row's gate weight with it and scales the expert's SwiGLU product by it before
  the down-projection, so the combine is a plain sum that keeps no expert outputs (``savers.py``);
- ``balance_coef`` > 0 adds the Switch load-balancing loss (``balance.switch_balance_loss`` on the router's
  ``balance_probs``) times the coefficient in training, through ``balance.AuxLoss`` on the gate weights:
  its gradient is injected in this layer's backward, whatever stage the layer is on. ``last_balance_loss``
  keeps the latest (detached) value for a model that reports it in its loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.weight_kinds import set_weight_kind
from .balance import AuxLoss, switch_balance_loss
from .expert_parallel import (
    DEFAULT_TIMEOUT,
    DispatchPlan,
    all_to_all,
    ep_size,
    from_experts,
    local_expert_ids,
    plan_dispatch,
    to_experts,
)
from .mlp import SwiGLUMLP
from .router import Router, Routing


class Dispatcher:
    """Moves each (token, expert) row to its expert and the outputs back: the shared dispatcher
    (``expert_parallel.py``) with an EP group (all-to-alls, bounded and overlappable), or all on this process.

    ``dispatch`` gives the rows ordered by local expert (``plan.expert_rows`` per expert) and the plan;
    ``combine`` scatters the experts' outputs, times their gate weights, back onto their tokens. ``keep``
    (tokens, k) drops pairs (capacity): they travel nowhere and add nothing. ``fp8``: the dispatched rows
    travel in E4M3 (their gradient in its own dtype)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, fp8: bool = False) -> None:
        self.num_experts, self.group, self.timeout, self.fp8 = num_experts, group, timeout, fp8

    @property
    def communicates(self) -> bool:
        """Whether rows leave this process (an EP group of more than one rank)."""
        return ep_size(self.group) > 1

    def dispatch(self, x: torch.Tensor, routing: Routing, keep: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, DispatchPlan]:
        plan = plan_dispatch(routing.indices, self.num_experts, self.group, self.timeout, keep)
        rows = all_to_all(x[plan.token_of], plan.recv_splits, plan.send_splits, self.group, "dispatch",
                          self.timeout, self.fp8)
        return to_experts(rows, plan), plan

    def row_weights(self, routing: Routing, plan: DispatchPlan, dtype: torch.dtype) -> torch.Tensor:
        """Each dispatched row's gate weight (rows, 1), expert-major like ``dispatch``'s rows (the
        ``"combine"`` saver multiplies it in before the down-projection); differentiable."""
        w = routing.weights.flatten()[plan.pair_of].unsqueeze(-1).to(dtype)
        return to_experts(all_to_all(w, plan.recv_splits, plan.send_splits, self.group, "dispatch", self.timeout),
                          plan)

    def combine(self, rows: torch.Tensor, routing: Routing | None, plan: DispatchPlan, tokens: int) -> torch.Tensor:
        """The experts' outputs back onto their tokens, times their gate weights (``routing`` None: the rows
        already carry them, a plain sum)."""
        rows = all_to_all(from_experts(rows, plan), plan.send_splits, plan.recv_splits, self.group, "combine",
                          self.timeout)
        if routing is not None:
            rows = rows * routing.weights.flatten()[plan.pair_of].unsqueeze(-1).to(rows.dtype)
        return rows.new_zeros(tokens, rows.size(-1)).index_add(0, plan.token_of, rows)


class Experts(nn.ModuleDict):
    """Experts ``ids`` (global ids; all of them without expert parallelism), each a SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int, ids: Iterable[int], recompute_product: bool = False) -> None:
        super().__init__({str(i): SwiGLUMLP(hidden, intermediate, recompute_product=recompute_product) for i in ids})

    def run(self, rows: torch.Tensor, expert_rows: list[int], row_weights: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Rows ordered by expert (``expert_rows`` per local expert) -> their outputs in the same order;
        ``row_weights`` (rows, 1) scale each row's SwiGLU product (the ``"combine"`` saver)."""
        chunks = rows.split(expert_rows)
        weights = row_weights.split(expert_rows) if row_weights is not None else [None] * len(chunks)
        outs = [expert(chunk, w) if chunk.size(0) else chunk
                for expert, chunk, w in zip(self.values(), chunks, weights)]
        return torch.cat(outs) if outs else rows


class MoEBlock(nn.Module):
    """``gate`` (the router) and ``experts.<id>`` (+ ``shared_expert``): transformers' names under ``mlp``."""

    def __init__(self, hidden: int, intermediate: int, router: Router, *, shared_intermediate: int = 0,
                 ep_group: dist.ProcessGroup | None = None, balance_coef: float = 0.0,
                 recompute_product: bool = False, weight_before_down: bool = False) -> None:
        super().__init__()
        self.gate = router
        self.weight_before_down = weight_before_down
        self.balance_coef = float(balance_coef)
        self.aux_loss_scale = 1.0  # the balance loss's gradient per backward (1/M when losses are averaged)
        self.last_balance_loss: torch.Tensor | None = None
        self.num_experts = router.num_experts
        self.experts = Experts(hidden, intermediate, local_expert_ids(router.num_experts, ep_group), recompute_product)
        self.shared_expert = SwiGLUMLP(hidden, shared_intermediate, recompute_product=recompute_product) \
            if shared_intermediate else None
        self.dispatcher = Dispatcher(router.num_experts, ep_group)
        if self.dispatcher.communicates:
            set_weight_kind(self.experts, "expert")  # sharded over ep: gradients reduce over dp only

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.flatten(0, -2)
        routing = self.gate(flat)
        if self.balance_coef > 0 and self.training and torch.is_grad_enabled():
            loss = self.balance_coef * switch_balance_loss(self.gate.balance_probs(routing.scores), routing.indices)
            self.last_balance_loss = loss.detach()
            routing = routing._replace(weights=AuxLoss.apply(routing.weights, loss, self.aux_loss_scale))
        rows, plan = self.dispatcher.dispatch(flat, routing)
        if self.weight_before_down:  # the "combine" saver: no expert output is kept for the combine
            row_w = self.dispatcher.row_weights(routing, plan, rows.dtype)
            out = self.dispatcher.combine(self.experts.run(rows, plan.expert_rows, row_w), None, plan, flat.size(0))
        else:
            out = self.dispatcher.combine(self.experts.run(rows, plan.expert_rows), routing, plan, flat.size(0))
        out = out.view(h.shape)
        return out if self.shared_expert is None else out + self.shared_expert(h)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """Nothing of its own: each expert's SwiGLU declares ``"selective"``; the router and dispatch are
        never recomputed (they count loads and, with EP, talk to other ranks)."""
        return iter(())

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        """Per token: the router's, its k dispatched rows with their expert outputs, and k times one
        expert's per-row activations (the whole subtree: ``saved_elements_per_token`` does not descend)."""
        if policy == "full":
            return {}
        k = self.gate.top_k
        expert = next(iter(self.experts.values()), None)
        rows = sum(expert.saved_per_token(policy, seq).values()) if expert is not None else 0
        hidden = self.gate.weight.size(1)
        shared = sum(self.shared_expert.saved_per_token(policy, seq).values()) if self.shared_expert else 0
        kept = {**self.gate.saved_per_token(policy, seq), "dispatched_rows": k * hidden,
                "expert_activations": k * rows, "shared_expert": shared}
        if self.weight_before_down:
            return {**kept, "row_weights": k}
        return {**kept, "expert_out": k * hidden}
