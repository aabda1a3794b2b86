"""Expert parallelism for ``MoEBlock``: the experts sharded over a process group, rows moved by all-to-all.

``EPDispatch`` has ``LocalDispatch``'s two methods. ``dispatch`` orders this rank's (token, expert) pairs
by global expert id (so by destination rank), exchanges the per-expert row counts, sends each rank the
rows of its experts (a differentiable ``all_to_all_single``) and regroups what arrives (ordered by source
rank, then expert) expert-major for ``Experts.run``; ``combine`` undoes the regrouping, sends the outputs
back and scatters them, weighted, onto their tokens. Rank r holds experts
``r * E/ep .. (r+1) * E/ep - 1`` (``local_expert_ids``); their parameters are marked ``"expert"``
(``parallel.weight_kinds``), so a mesh's gradient sync reduces them over dp only.

Not yet: a bounded wait with a named timeout (DeepSeek-V3's dispatcher has one), FP8 dispatch, capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .router import Routing


def ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def ep_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def local_expert_ids(num_experts: int, group: dist.ProcessGroup | None) -> range:
    size = ep_size(group)
    if num_experts % size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel group size ({size})")
    local = num_experts // size
    return range(ep_rank(group) * local, (ep_rank(group) + 1) * local)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``send[r]`` rows of ``x`` (in rank order) to rank r and receive ``recv[r]`` from it; differentiable."""
    return _AllToAll.apply(x, send, recv, group)


@dataclass
class EPPlan:
    token_of: torch.Tensor  # (pairs,) source token of each sent row, rows ordered by global expert
    pair_of: torch.Tensor  # (pairs,) index into routing.weights.flatten() of each sent row
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    regroup: torch.Tensor  # received rows (rank-major) -> expert-major order
    expert_rows: list[int]  # rows per local expert after regrouping


class EPDispatch:
    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        self.num_experts, self.group = num_experts, group
        self.size = ep_size(group)
        self.local = len(local_expert_ids(num_experts, group))

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, EPPlan]:
        flat = routing.indices.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).view(self.size, self.local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)  # [src rank, local expert]
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        rows = all_to_all(x[order // routing.indices.size(1)], send, recv, self.group)
        expert_of_row = torch.repeat_interleave(torch.arange(self.local).repeat(self.size), recv_counts.flatten())
        regroup = expert_of_row.argsort(stable=True)
        plan = EPPlan(order // routing.indices.size(1), order, send, recv, regroup, recv_counts.sum(0).tolist())
        return rows[regroup.to(rows.device)], plan

    def combine(self, rows: torch.Tensor, routing: Routing, plan: EPPlan, tokens: int) -> torch.Tensor:
        back = torch.empty_like(plan.regroup)
        back[plan.regroup] = torch.arange(plan.regroup.numel())
        rows = all_to_all(rows[back.to(rows.device)], plan.recv, plan.send, self.group)
        w = routing.weights.flatten()[plan.pair_of].unsqueeze(-1).to(rows.dtype)
        return rows.new_zeros(tokens, rows.size(-1)).index_add(0, plan.token_of, rows * w)
