"""The MoE block: router -> dispatch -> experts -> combine, each piece replaceable; every MoE family's block.

- the router (``router.py``) gives each token k expert ids and gate weights (``Routing``);
- ``Dispatcher`` orders the (token, expert) pairs by expert (a stable sort, so a token's rows keep
  their order) and gathers one row per pair; ``combine`` gathers the expert outputs back per token and sums
  each token's k of them times their gate weights (a gather and a sum over k, deterministic on any device).
  With an EP group (``ep_group=``) the rows travel by the shared dispatcher's all-to-alls
  (``expert_parallel.py``: bounded waits, overlap points for DualPipe's F&B units), and the block's
  ``experts`` hold only that rank's share;
- ``Experts`` are one ``SwiGLUMLP`` per expert in a ``ModuleDict`` keyed by the *global* expert id, so
  the state-dict names are transformers' per-expert checkpoint names
  (``mlp.experts.7.gate_proj.weight``) and a shard's state dict is a subset of the full model's; they are
  weight kind ``"expert"`` (their gradients reduce over dp only);
- optional shared experts (DeepSeek's ``shared_experts``) are a dense ``SwiGLUMLP`` added to the output.

Options any family switches on (DeepSeek-V3 uses them all):

- ``recompute_product`` (the ``"swiglu"`` saver) is every expert's SwiGLU option; ``weight_before_down`` (the
  ``"combine"`` saver) sends each row's gate weight with it and scales the expert's SwiGLU product by it
  before the down-projection, so the combine is a plain sum that keeps no expert outputs (``savers.py``);
- balance losses, added in training through ``balance.AuxLoss`` on the gate weights (their gradient is
  injected in this layer's backward, whatever stage the layer is on): ``balance_coef`` times the Switch
  loss (``balance.switch_balance_loss`` on the router's ``balance_probs``; Qwen3-MoE), ``sequence_balance_coef``
  times DeepSeek-V3's sequence-wise loss and ``batch_balance_coef`` times the batch-wise loss over the EP
  group. ``last_balance_loss`` keeps the latest (detached) total for a model that reports it in its loss;
- ``capacity_factor`` > 0 drops the pairs beyond ``ceil(cf·T·K/N)`` per expert (``balance.capacity_keep``,
  in ``capacity_priority`` order): they travel nowhere and add nothing; ``dropped_pairs`` / ``routed_pairs``
  count them in training;
- ``fp8_dispatch``: the dispatched rows travel in E4M3 with 1×128 tile scales (the combine and every gradient
  in the model's dtype).

``moe_state.py`` sets and reads these on every MoE layer of a model (timeouts, the EP group, the balance
loss's gradient scale, the bias update, the dropped pairs).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.weight_kinds import set_weight_kind
from .balance import (
    PRIORITIES,
    AuxLoss,
    batch_balance_loss,
    capacity_keep,
    sequence_balance_loss,
    switch_balance_loss,
)
from .common import Elements, is_fp8
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
    ``combine`` brings the experts' outputs back and sums each token's, times their gate weights. ``keep``
    (tokens, k) drops pairs (capacity): they travel nowhere and add nothing. ``fp8``: the dispatched rows
    travel in E4M3 (their gradient in its own dtype). ``group`` and ``timeout`` may be replaced between
    steps (``moe_state.set_ep_group`` / ``set_timeout``)."""

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
        """Each dispatched row's gate weight (rows, 1) in ``dtype``, expert-major like ``dispatch``'s rows (the
        ``"combine"`` saver multiplies it in before the down-projection); differentiable, never FP8."""
        w = routing.weights.flatten()[plan.pair_of].to(dtype).unsqueeze(-1)
        return to_experts(all_to_all(w, plan.recv_splits, plan.send_splits, self.group, "dispatch", self.timeout),
                          plan)

    def combine(self, rows: torch.Tensor, routing: Routing, plan: DispatchPlan, weighted: bool = True
                ) -> torch.Tensor:
        """The experts' outputs (expert-major) back onto their tokens (tokens, dim): each token's k outputs (a
        dropped pair's zero) times their gate weights, summed over the k in choice order. ``weighted``
        False: the rows already carry their weights (the ``"combine"`` saver), a plain sum."""
        rows = all_to_all(from_experts(rows, plan), plan.send_splits, plan.recv_splits, self.group, "combine",
                          self.timeout)
        tokens, k = routing.indices.shape
        if plan.placed is not None:  # some pairs dropped: their expert output is zero
            full = rows.new_zeros(tokens * k, rows.size(-1)).index_copy(0, plan.placed, rows)
        else:
            full = rows[plan.unsort]
        per_token = full.view(tokens, k, -1)
        if weighted:
            per_token = per_token * routing.weights.unsqueeze(-1).type_as(rows)
        return per_token.sum(1)


class Experts(nn.ModuleDict):
    """Experts ``ids`` (global ids; all of them without expert parallelism), each a SwiGLU MLP
    (``recompute_product``, ``selective``: ``SwiGLUMLP``'s options)."""

    def __init__(self, hidden: int, intermediate: int, ids: Iterable[int], recompute_product: bool = False,
                 selective: bool = True) -> None:
        super().__init__({str(i): SwiGLUMLP(hidden, intermediate, recompute_product=recompute_product,
                                            selective=selective) for i in ids})

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
    """``gate`` (the router), ``experts.<id>`` and ``shared_experts``: the checkpoint's names under ``mlp``.
    The keyword options are the module docstring's; ``selective`` False: the ``"selective"`` recompute policy
    leaves the experts' SwiGLU products alone (DeepSeek-V3's selective recomputes MLA only)."""

    def __init__(self, hidden: int, intermediate: int, router: Router, *, shared_intermediate: int = 0,
                 ep_group: dist.ProcessGroup | None = None, balance_coef: float = 0.0,
                 sequence_balance_coef: float = 0.0, batch_balance_coef: float = 0.0,
                 capacity_factor: float = 0.0, capacity_priority: str = "position", fp8_dispatch: bool = False,
                 recompute_product: bool = False, weight_before_down: bool = False, selective: bool = True) -> None:
        super().__init__()
        if capacity_priority not in PRIORITIES:
            raise ValueError(f"capacity_priority {capacity_priority!r} is not supported; choose one of {PRIORITIES}")
        self.gate = router
        self.weight_before_down = weight_before_down
        self.balance_coef = float(balance_coef)
        self.sequence_balance_coef, self.batch_balance_coef = float(sequence_balance_coef), float(batch_balance_coef)
        self.capacity_factor, self.capacity_priority = float(capacity_factor), capacity_priority
        self.aux_loss_scale = 1.0  # the balance loss's gradient per backward (1/M when losses are averaged)
        self.last_balance_loss: torch.Tensor | None = None
        self.dropped_pairs = self.routed_pairs = 0  # (token, expert) pairs dropped / routed since the last reset
        self.num_experts = router.num_experts
        self.experts = Experts(hidden, intermediate, local_expert_ids(router.num_experts, ep_group), recompute_product,
                               selective)
        set_weight_kind(self.experts, "expert")  # sharded over ep: gradients reduce over dp only
        self.shared_experts = SwiGLUMLP(hidden, shared_intermediate, recompute_product=recompute_product,
                                        selective=selective) if shared_intermediate else None
        self.dispatcher = Dispatcher(router.num_experts, ep_group, fp8=fp8_dispatch)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.flatten(0, -2)
        routing = self.gate(flat, getattr(h, "rms_norm_source", None))
        training = self.training and torch.is_grad_enabled()
        if training:
            routing = self._attach_balance_loss(routing, h.size(0) if h.dim() > 2 else 1)
        keep = None
        if self.capacity_factor > 0:
            keep = capacity_keep(routing.indices, routing.weights, self.num_experts, self.capacity_factor,
                                 self.capacity_priority)
            if training:
                self.dropped_pairs += int((~keep).sum())
                self.routed_pairs += keep.numel()
        rows, plan = self.dispatcher.dispatch(flat, routing, keep)
        if self.weight_before_down:  # the "combine" saver: no expert output is kept for the combine
            row_w = self.dispatcher.row_weights(routing, plan, rows.dtype)
            out = self.dispatcher.combine(self.experts.run(rows, plan.expert_rows, row_w), routing, plan, False)
        else:
            out = self.dispatcher.combine(self.experts.run(rows, plan.expert_rows), routing, plan)
        out = out.view(h.shape)
        return out if self.shared_experts is None else out + self.shared_experts(h)

    def _attach_balance_loss(self, routing: Routing, batch: int) -> Routing:
        """The configured balance losses (Switch, sequence-wise over ``batch`` sequences, batch-wise over the EP
        group), summed and injected through ``AuxLoss`` on the gate weights."""
        scores, indices, k = routing.scores, routing.indices, self.gate.top_k
        terms = []
        if self.balance_coef > 0:
            terms.append(self.balance_coef * switch_balance_loss(self.gate.balance_probs(scores), indices))
        if self.sequence_balance_coef > 0:
            terms.append(self.sequence_balance_coef * sequence_balance_loss(scores, indices, batch, k))
        if self.batch_balance_coef > 0:
            terms.append(self.batch_balance_coef * batch_balance_loss(scores, indices, k, self.dispatcher.group))
        if not terms:
            return routing
        loss = functools.reduce(operator.add, terms)
        self.last_balance_loss = loss.detach()
        return routing._replace(weights=AuxLoss.apply(routing.weights, loss, self.aux_loss_scale))

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """Nothing of its own: each expert's SwiGLU declares ``"selective"``; the router and dispatch are
        never recomputed (they count loads and, with EP, talk to other ranks)."""
        return iter(())

    def saved_per_token(self, policy: str, seq: int, *, norm_recomputed: bool = False,
                        experts_recomputed: bool = False) -> dict[str, float]:
        """Per token, in activation-dtype elements (``common.Elements``): the router's input as the router and the
        shared experts keep it (the input is a norm's output, ``norm_recomputed`` when that norm keeps only its
        own input), the router's own tensors, the dispatch index and the dispatched rows (the experts' inputs: one
        buffer, or each expert's E4M3 copy with FP8 linears), k times one expert's per-row activations past its
        input and the shared experts', and the combine's: the unsort index with the weights and the gathered
        outputs, or with ``weight_before_down`` the rows' gate weights and their index. ``"full"``: nothing (the
        enclosing layer is recomputed and keeps its input) unless ``experts_recomputed``: then the experts and
        the shared experts are the recomputed regions (each keeps its input as given) and the rest stays."""
        if policy == "full" and not experts_recomputed:
            return {}
        e = Elements(self)
        k, hidden = self.gate.top_k, self.gate.weight.size(1)
        expert = next(iter(self.experts.values()), None)
        shared = self.shared_experts
        kept: dict[str, float] = dict(self.gate.input_per_token(seq, norm_recomputed))
        given = self.gate.keeps_given_input(norm_recomputed)
        if shared is not None and (experts_recomputed or not is_fp8(shared.gate_proj)):
            given = True  # the shared experts keep the same tensor as their input
        elif shared is not None:
            kept["shared_input"] = e.fp8(hidden)
        if given:
            kept["norm_output"] = hidden
        kept.update(self.gate.saved_per_token(policy, seq))
        rows = hidden if experts_recomputed or expert is None else e.linear_input(expert.gate_proj, hidden)
        kept.update(dispatch_index=e.index(k), dispatched_rows=k * rows)
        if not experts_recomputed:
            inner = "none" if policy == "full" else policy
            per_row = sum(v for n, v in expert.saved_per_token(inner, seq).items() if n != "input") if expert else 0
            if self.weight_before_down and expert is not None and not expert.recompute_product:
                per_row += expert.gate_proj.out_features  # the unscaled product, for the gate weight's gradient
            kept["expert_activations"] = k * per_row
            if shared is not None:
                kept["shared_experts"] = sum(v for n, v in shared.saved_per_token(inner, seq).items() if n != "input")
        if self.weight_before_down:
            kept.update(pair_index=e.index(k), combine_index=e.index(k), row_weights=k)
        else:
            kept.update(combine_index=e.index(k), weights=k, expert_out=k * hidden)
        return kept
