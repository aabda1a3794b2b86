"""Expert parallelism: routed experts sharded over an ``ep_group``; tokens travel by all-to-all.

Dispatch sorts the (token, expert) pairs by expert, tells every rank how many rows it will get
for each of its local experts (a small all-to-all of counts), then sends the rows. The receiver
regroups them expert-major (for each local expert: rank 0's rows, then rank 1's, ...), so an
expert sees its tokens in the same order as a single process holding the concatenated batch —
which is what makes ep=N results match ep=1. Combine is the exact reverse.

``all_to_all`` is differentiable (its backward is the reverse all-to-all); ``start_all_to_all``
is the non-blocking form used by the overlapped forward/backward. Both work on gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


def ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def ep_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class DispatchPlan:
    """Where each (token, expert) row goes and comes back; built once per MoE forward."""

    token_of: torch.Tensor  # (rows,) source token of each sorted row (rows = tokens * top-k)
    unsort: torch.Tensor  # (rows,) inverse permutation: sorted row -> (token, k) order
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    expert_rows: list[int]  # received rows per local expert
    regroup: torch.Tensor | None  # received (rank-major) -> expert-major row order; None when ep = 1
    ungroup: torch.Tensor | None


def plan_dispatch(indices: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None) -> DispatchPlan:
    """Sort the routed rows by expert and agree on split sizes with the other EP ranks (blocking)."""
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    size = ep_size(group)
    if size == 1:
        return DispatchPlan(order // indices.size(1), torch.argsort(order), [flat.numel()], [flat.numel()],
                            counts.tolist(), None, None)
    local = n_experts // size
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [src rank, local expert]
    per_src = recv_counts.view(size, local)
    recv_splits = per_src.sum(1).tolist()
    starts = torch.cumsum(torch.cat([per_src.new_zeros(1), per_src.flatten()]), 0)[:-1].view(size, local)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + per_src[s, e]), device=indices.device)
              for e in range(local) for s in range(size)]
    regroup = torch.cat(pieces) if pieces else indices.new_zeros(0)
    return DispatchPlan(order // indices.size(1), torch.argsort(order), counts.view(size, local).sum(1).tolist(),
                        recv_splits, per_src.sum(0).tolist(), regroup, torch.argsort(regroup))


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup,
              async_op: bool) -> tuple[torch.Tensor, object]:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group, async_op=async_op)
    return out, work


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup):
        ctx.out_rows, ctx.in_rows, ctx.group = out_rows, in_rows, group
        return _exchange(x, out_rows, in_rows, group, async_op=False)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.in_rows, ctx.out_rows, ctx.group, async_op=False)[0], None, None, None


def all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None):
    """Differentiable all-to-all of rows: send ``in_rows[r]`` rows to rank r, get ``out_rows[r]`` back."""
    if ep_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_rows, in_rows, group)


def start_all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                     group: dist.ProcessGroup | None) -> Callable[[], torch.Tensor]:
    """Post a non-blocking all-to-all (no autograd); the returned callable waits and gives the rows."""
    if ep_size(group) == 1:
        return lambda: x
    out, work = _exchange(x, out_rows, in_rows, group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out

    return wait
