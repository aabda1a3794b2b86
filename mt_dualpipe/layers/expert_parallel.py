"""Expert parallelism: routed experts sharded over an EP group, (token, expert) rows moved by all-to-all.

The one dispatcher of the library; every MoE family's block (``moe.MoEBlock``) uses it.

- **Plan** (``plan_dispatch``): the (token, expert) pairs are sorted by global expert id, which is also by
  destination rank (rank r holds experts ``r * E/ep .. (r+1) * E/ep - 1``, ``local_expert_ids``); the
  ranks tell each other how many rows each local expert will get (a small all-to-all of counts), and the
  receiver regroups what arrives expert-major (for each local expert: rank 0's rows, then rank 1's, ...),
  so an expert sees its tokens in the order a single process holding the concatenated batch would:
  ep = N matches ep = 1. ``keep`` drops pairs beyond an expert's capacity (``balance.capacity_keep``):
  they do not travel, and their expert output is zero.
- **Exchange** (``all_to_all``): differentiable, its backward the reverse exchange. Every all-to-all is
  posted asynchronously, followed by ``runtime.overlap.overlap_point()`` and then a bounded wait: inside
  DualPipe's F&B unit the other micro-batch's side computes while the rows travel (forward and
  backward alike), and a partner rank that failed or hangs raises ``PipelineTimeoutError`` (or
  ``PipelineCommError``) naming the rank, the EP group size and the exchange after ``timeout`` seconds
  instead of blocking forever, so the fault reaches ``Rewind``'s agreement on every rank. On gloo a
  timed-out collective leaves the group out of step: give the layers a fresh group afterwards
  (``fresh_mesh_group``; the DeepSeek-V3 example's rebuild does).
- **FP8 dispatch** (``fp8=True``): the rows travel as E4M3 values plus one float32 scale per 1×128 tile
  (``pack_fp8``, about half the bytes of BF16) and are dequantised on arrival; their gradient comes back
  in its own dtype. With one EP rank they are still quantised, so ep = 1 and ep = N compute the same.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..fp8.quantize import E4M3, TILE, QTensor, dequantize, quantize_tiles
from ..runtime.errors import PipelineCommError, PipelineTimeoutError
from ..runtime.overlap import overlap_point

DEFAULT_TIMEOUT = 300.0  # seconds an expert all-to-all may wait: the pipeline's default timeout


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


def mesh_ep_group(dims: Any) -> dist.ProcessGroup | None:
    """The expert-parallel group MoE layers take from a mesh (``parallel.ParallelDims``): ``dims.group("ep")``,
    or None when ``ep`` is 1 (the experts are then all local and no all-to-all is posted)."""
    return dims.group("ep") if dims.ep > 1 else None


def fresh_mesh_group(dims: Any, dim: str) -> dist.ProcessGroup:
    """A new process group over the same ranks as ``dims.group(dim)`` (e.g. after a timed-out all-to-all left
    the old one out of step on gloo). Collective: ``new_group`` must be called by every rank for every group,
    in the same order, so each rank creates the groups along ``dim`` through every mesh coordinate and
    keeps its own."""
    axis = dims.mesh.mesh_dim_names.index(dim)
    grid = dims.mesh.mesh.movedim(axis, -1).reshape(-1, dims.mesh.mesh.shape[axis])
    me, mine = dist.get_rank(), None
    for ranks in grid.tolist():
        group = dist.new_group([int(r) for r in ranks])
        if me in ranks:
            mine = group
    if mine is None:  # pragma: no cover - every rank of the mesh lies on one line along each dim
        raise RuntimeError(f"rank {me} is not in the mesh {dims.mesh}")
    return mine


# ----- bounded, overlappable exchanges ----------------------------------------------------------------------
def _error(group: dist.ProcessGroup, what: str, exc: BaseException | None, timeout: float) -> PipelineCommError:
    text = str(exc).strip().splitlines()[0][:200] if exc is not None and str(exc).strip() else ""
    timed_out = exc is None or "imed out" in text
    how = f"waited more than {timeout:g}s for" if timed_out else "failed in"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (PipelineTimeoutError if timed_out else PipelineCommError)(
        f"rank {rank} (EP rank {ep_rank(group)} of an EP group of {ep_size(group)}): {how} the expert all-to-all "
        f"({what}); an EP partner is hung, failed or runs a different program"
        + (f" ({text})" if text else ""))


def _wait(work: Any, group: dist.ProcessGroup, what: str, timeout: float) -> None:
    """Wait for an all-to-all within the timeout; a failure becomes ``PipelineTimeoutError`` / ``PipelineCommError``."""
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo: RuntimeError("... Operation timed out!") or a closed connection
        raise _error(group, what, exc, timeout) from None
    if ok is False:
        raise _error(group, what, None, timeout)


def post_all_to_all(x: torch.Tensor, out_rows: list[int] | None, in_rows: list[int] | None,
                    group: dist.ProcessGroup, what: str, timeout: float) -> Callable[[], torch.Tensor]:
    """Post an asynchronous ``all_to_all_single`` of ``x``'s rows (``in_rows[r]`` to rank r, ``out_rows[r]``
    from it; None: equal splits); the returned callable waits (at most ``timeout`` s) and gives the rows."""
    rows = sum(out_rows) if out_rows is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    try:
        work = dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group, async_op=True)
    except RuntimeError as exc:
        raise _error(group, what, exc, timeout) from None

    def wait() -> torch.Tensor:
        _wait(work, group, what, timeout)
        return out

    return wait


def exchange(x: torch.Tensor, out_rows: list[int] | None, in_rows: list[int] | None,
             group: dist.ProcessGroup | None, what: str, timeout: float) -> torch.Tensor:
    """Post, let an F&B unit's other side run (``overlap_point``), wait: one all-to-all (no autograd)."""
    if ep_size(group) == 1:
        return x
    wait = post_all_to_all(x, out_rows, in_rows, group, what, timeout)
    overlap_point()
    return wait()


def backward_name(what: str) -> str:
    return f"backward of the {what}"


# ----- FP8 rows -------------------------------------------------------------------------------------------
def fp8_row_bytes(dim: int) -> int:
    """Bytes one dispatched row takes in FP8: ``dim`` E4M3 values plus one float32 scale per 1×128 tile."""
    return dim + 4 * -(-dim // TILE)


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rows quantised to E4M3 in 1×128 tiles, as uint8 rows ``[values | float32 scales]`` (one all-to-all)."""
    q = quantize_tiles(x)
    return torch.cat([q.data.view(torch.uint8), q.scale.contiguous().view(torch.uint8)], dim=1)


def unpack_fp8(packed: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``pack_fp8`` packed, dequantised to ``dtype``."""
    data = packed[:, :dim].contiguous().view(E4M3)
    scale = packed[:, dim:].contiguous().view(torch.float32)
    return dequantize(QTensor(data, scale, "tile")).to(dtype)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None,
                what: str, timeout: float, fp8: bool) -> torch.Tensor:
        ctx.out_rows, ctx.in_rows, ctx.group, ctx.what, ctx.timeout = out_rows, in_rows, group, what, timeout
        if not fp8:
            return exchange(x, out_rows, in_rows, group, what, timeout)
        packed = exchange(pack_fp8(x.detach()), out_rows, in_rows, group, what, timeout)
        return unpack_fp8(packed, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = exchange(grad, ctx.in_rows, ctx.out_rows, ctx.group, backward_name(ctx.what), ctx.timeout)
        return back, None, None, None, None, None, None


def all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None,
               what: str = "exchange", timeout: float = DEFAULT_TIMEOUT, fp8: bool = False) -> torch.Tensor:
    """Differentiable all-to-all of rows: send ``in_rows[r]`` rows to rank r, get ``out_rows[r]`` back (the
    backward sends the gradient the other way). ``what`` ("dispatch", "combine") names it in a timeout
    error; ``fp8``: the rows travel as E4M3 + tile scales, quantised even with one EP rank."""
    if ep_size(group) == 1 and not fp8:
        return x
    return _AllToAll.apply(x, out_rows, in_rows, group, what, timeout, fp8)


# ----- the dispatch plan ------------------------------------------------------------------------------------
@dataclass
class DispatchPlan:
    """Where each (token, expert) row goes and comes back; built once per MoE forward."""

    token_of: torch.Tensor  # (rows,) source token of each sorted row (rows = tokens * top-k, less dropped)
    unsort: torch.Tensor | None  # (rows,) inverse permutation: sorted row -> (token, k) order (None when dropping)
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    expert_rows: list[int]  # received rows per local expert
    regroup: torch.Tensor | None  # received (rank-major) -> expert-major row order; None when ep = 1
    ungroup: torch.Tensor | None
    placed: torch.Tensor | None = None  # with dropping: flat (token*k + j) position of each sorted row
    pair_of: torch.Tensor | None = None  # flat (token*k + j) position of each sorted row
    row_weights: Any = None  # the received rows' gate weights when a block applies them before the down-projection


def plan_dispatch(indices: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None,
                  timeout: float = DEFAULT_TIMEOUT, keep: torch.Tensor | None = None) -> DispatchPlan:
    """Sort the routed rows by expert and agree on split sizes with the other EP ranks (one all-to-all of
    counts, overlappable like the rows'). ``keep`` (tokens, k) bool: only those pairs travel."""
    flat = indices.flatten()
    placed = None
    if keep is not None and not bool(keep.all()):
        placed = keep.flatten().nonzero().squeeze(1)
        order = placed[torch.argsort(flat[placed], stable=True)]
        placed, flat = order, flat[order]
        counts = torch.bincount(flat, minlength=n_experts)
        unsort = None
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts)
        unsort = torch.argsort(order)
    token_of = order // indices.size(1)
    size = ep_size(group)
    if size == 1:
        return DispatchPlan(token_of, unsort, [order.numel()], [order.numel()], counts.tolist(), None, None, placed,
                            order)
    local = n_experts // size
    recv_counts = exchange(counts, None, None, group, "dispatch counts", timeout)  # [src rank, local expert]
    per_src = recv_counts.view(size, local)
    recv_splits = per_src.sum(1).tolist()
    starts = torch.cumsum(torch.cat([per_src.new_zeros(1), per_src.flatten()]), 0)[:-1].view(size, local)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + per_src[s, e]), device=indices.device)
              for e in range(local) for s in range(size)]
    regroup = torch.cat(pieces) if pieces else indices.new_zeros(0)
    return DispatchPlan(token_of, unsort, counts.view(size, local).sum(1).tolist(),
                        recv_splits, per_src.sum(0).tolist(), regroup, torch.argsort(regroup), placed, order)


def to_experts(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Received rows (rank-major) -> expert-major, as ``Experts.run`` takes them."""
    return rows if plan.regroup is None else rows[plan.regroup.to(rows.device)]


def from_experts(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Expert-major outputs -> rank-major, ready for the combine's all-to-all."""
    return rows if plan.ungroup is None else rows[plan.ungroup.to(rows.device)]
