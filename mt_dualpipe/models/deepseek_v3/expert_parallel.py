"""Expert parallelism: routed experts sharded over an ``ep_group``; tokens travel by all-to-all.

Dispatch sorts the (token, expert) pairs by expert, tells every rank how many rows it will get
for each of its local experts (a small all-to-all of counts), then sends the rows. The receiver
regroups them expert-major (for each local expert: rank 0's rows, then rank 1's, ...), so an
expert sees its tokens in the same order as a single process holding the concatenated batch —
which is what makes ep=N results match ep=1. Combine is the exact reverse.

``all_to_all`` is differentiable (its backward is the reverse all-to-all); ``start_all_to_all``
is the non-blocking form used by the overlapped forward/backward. Both work on gloo.

Every wait is bounded by the MoE layer's ``ep_timeout`` seconds (``moe.set_timeout`` changes it; default
300 s, the pipeline's default): an all-to-all whose partner rank failed or hangs raises
``PipelineTimeoutError`` naming the rank, the EP group size and the exchange (dispatch counts,
dispatch, combine, or the backward of one) instead of blocking forever, so a fault on one rank
reaches ``Rewind``'s agreement on every rank. On gloo a timed-out collective leaves the group out
of step (the late partner's next all-to-all matches the abandoned one): after such a failure give
the MoE layers a fresh EP group (``moe.set_ep_group``), as the example's rebuild does.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...fp8.quantize import E4M3, TILE, QTensor, dequantize, quantize_tiles
from ...runtime.errors import PipelineCommError, PipelineTimeoutError

DEFAULT_TIMEOUT = 300.0


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
    placed: torch.Tensor | None = None  # with dropping: flat (token*k + j) position of each sorted row
    pair_of: torch.Tensor | None = None  # flat (token*k + j) position of each sorted row (``placed`` when dropping)
    row_weights: Any = None  # ``moe.RowWeights``: the received rows' gate weights ("combine" memory saver)


def plan_dispatch(indices: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None,
                  timeout: float = DEFAULT_TIMEOUT, keep: torch.Tensor | None = None) -> DispatchPlan:
    """Sort the routed rows by expert and agree on split sizes with the other EP ranks (blocking).
    ``keep`` (tokens, k) bool: only those pairs travel (capacity dropping); the rest come back as zero."""
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
    recv_counts = torch.empty_like(counts)
    work = dist.all_to_all_single(recv_counts, counts, group=group, async_op=True)  # [src rank, local expert]
    _wait(work, group, "dispatch counts", timeout)
    per_src = recv_counts.view(size, local)
    recv_splits = per_src.sum(1).tolist()
    starts = torch.cumsum(torch.cat([per_src.new_zeros(1), per_src.flatten()]), 0)[:-1].view(size, local)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + per_src[s, e]), device=indices.device)
              for e in range(local) for s in range(size)]
    regroup = torch.cat(pieces) if pieces else indices.new_zeros(0)
    return DispatchPlan(token_of, unsort, counts.view(size, local).sum(1).tolist(),
                        recv_splits, per_src.sum(0).tolist(), regroup, torch.argsort(regroup), placed, order)


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


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup,
              what: str, timeout: float) -> Callable[[], torch.Tensor]:
    """Post the all-to-all; the returned callable waits (bounded) and gives the received rows."""
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    try:
        work = dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group, async_op=True)
    except RuntimeError as exc:
        raise _error(group, what, exc, timeout) from None

    def wait() -> torch.Tensor:
        _wait(work, group, what, timeout)
        return out

    return wait


def backward_name(what: str) -> str:
    return f"backward of the {what}"


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup,
                what: str, timeout: float):
        ctx.out_rows, ctx.in_rows, ctx.group, ctx.what, ctx.timeout = out_rows, in_rows, group, what, timeout
        return _exchange(x, out_rows, in_rows, group, what, timeout)()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _exchange(grad, ctx.in_rows, ctx.out_rows, ctx.group, backward_name(ctx.what), ctx.timeout)
        return back(), None, None, None, None, None


def all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None,
               what: str = "exchange", timeout: float = DEFAULT_TIMEOUT):
    """Differentiable all-to-all of rows: send ``in_rows[r]`` rows to rank r, get ``out_rows[r]`` back.
    ``what`` ("dispatch", "combine") names it in a timeout error."""
    if ep_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_rows, in_rows, group, what, timeout)


def start_all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                     group: dist.ProcessGroup | None, what: str = "exchange",
                     timeout: float = DEFAULT_TIMEOUT) -> Callable[[], torch.Tensor]:
    """Post a non-blocking all-to-all (no autograd); the returned callable waits (at most ``timeout``
    seconds) and gives the rows. ``what`` names it in a timeout error."""
    if ep_size(group) == 1:
        return lambda: x
    return _exchange(x, out_rows, in_rows, group, what, timeout)


# ----- FP8 dispatch ---------------------------------------------------------------------------------------
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


class _FP8AllToAll(torch.autograd.Function):
    """Dispatch in FP8: quantise, send ``[values | scales]`` bytes, dequantise on arrival. Backward sends
    the gradient back in its own dtype (straight through the quantisation), as the combine does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None,
                what: str, timeout: float):
        ctx.out_rows, ctx.in_rows, ctx.group, ctx.what, ctx.timeout = out_rows, in_rows, group, what, timeout
        packed = pack_fp8(x.detach())
        if ep_size(group) > 1:
            packed = _exchange(packed, out_rows, in_rows, group, what, timeout)()
        return unpack_fp8(packed, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ep_size(ctx.group) == 1:
            return grad, None, None, None, None, None
        back = _exchange(grad, ctx.in_rows, ctx.out_rows, ctx.group, backward_name(ctx.what), ctx.timeout)
        return back(), None, None, None, None, None


def fp8_all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup | None,
                   what: str = "dispatch", timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """``all_to_all`` of 2-D rows sent as E4M3 + tile scales (about half the bytes of BF16); with one EP
    rank the rows are still quantised and dequantised, so ep=1 and ep=N compute the same values."""
    return _FP8AllToAll.apply(x, out_rows, in_rows, group, what, timeout)
