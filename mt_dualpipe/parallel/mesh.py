"""One ``DeviceMesh`` for pipeline x data x expert x tensor parallelism, and its gradient groups.

Sizes and what reduces where
----------------------------
``world = pp * dp * ep * tp``. ``dp`` here is the number of *full model replicas that also
replicate the experts*; expert parallelism is a second data-parallel axis for the dense weights:
the ``ep`` ranks of one expert group run different micro-batches through the same dense layers
and each holds ``1/ep`` of the experts. Hence

* dense (non-expert) weights are replicated over ``dp x ep``: their gradients are summed over
  that ``dp * ep``-rank group (``ParallelDims.grad_group("dense")``);
* expert weights are sharded over ``ep`` and replicated over ``dp`` only: their gradients are
  summed over the ``dp``-rank "expert data parallel" group (``grad_group("expert")``).
* both are divided by ``dp * ep`` (``SyncGroup.divide_by``). Each rank's loss is the mean over its
  own tokens (the DDP convention); the global loss is the mean of the ``dp*ep`` ranks' losses. An
  expert's gradient on one rank already sums the contributions of all ``ep`` ranks' tokens (the
  all-to-all's backward brings them), so summing over the ``dp`` replicas and dividing by
  ``dp*ep`` is the global mean — dividing by ``dp`` would make expert gradients ``ep`` x too large.
  Megatron-core does the same (expert gradients summed over the expert-data-parallel group, scaled
  by ``1 / data_parallel_size``).
* with ``tp > 1`` each tp rank reduces its own tensor-parallel shard over the same groups at its
  tp coordinate; replicated (non-sharded) weights inside a tp block are DTensor's business.

Megatron-core counts the same layout as ``data_parallel_size = dp*ep`` with
``expert_data_parallel_size = dp`` (EP is carved out of DP); torchtitan likewise borrows its EP
dimension from the data-parallel (``dp_shard``) ranks. The planner (``planner/estimate.py``) uses
Megatron's convention: its ``dp`` is our ``dp*ep`` and its ``edp = dp/ep`` is our ``dp``.

Rank order
----------
Mesh dims are ``("pp", "dp", "ep", "tp")`` in row-major order: **pp outermost, tp innermost**.
Consecutive global ranks differ in tp first, then ep, so tensor-parallel collectives (every layer,
largest volume) and expert all-to-all (every MoE layer) stay on the fast intra-node links as
long as ``tp*ep`` fits in a node; data-parallel syncs (once per step, overlappable) come next; the
pipeline's point-to-point sends (one activation per micro-batch) are the lightest traffic and may
cross nodes. This is torchtitan's and Megatron's order, and the planner's: it lays data
parallelism innermost (tp = 1) and treats pipeline neighbours as ``dp`` ranks apart.

Mirrored stages (DualPipe)
--------------------------
A stage held by several pipeline ranks (DualPipe: pp rank r and P-1-r hold copies of the same
layers) must sum both copies' gradients once. ``stage_sync_groups`` builds, for such a stage, a
group spanning *all copies x the data-parallel replicas*: ranks ``{pp in holders} x dp (x ep for
dense)`` at this rank's other coordinates, dividing by ``dp*ep`` as without mirroring
(``SyncGroup.divide_by``): the copies are summed and the replicas averaged in one collective.
Each such stage gets a process group of its own, so the two stages a DualPipe rank
holds (both mirrored with the same peer) can be reduced in either order without their
collectives pairing up wrongly.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .device import BACKENDS, backend_for, try_import_musa
from .mesh_roles import canonical_order
from .weight_kinds import check_kind

DIMS = ("pp", "dp", "ep", "tp")
"""Mesh dimension names, outermost first."""



def default_device_type() -> str:
    """The accelerator this process should use: cuda, else musa (if ``torch_musa`` is installed), else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if try_import_musa() and torch.musa.is_available():
        return "musa"
    return "cpu"


def device_type_for_backend(backend: str) -> str:
    """The device type a backend runs on (inverse of ``device.backend_for``)."""
    for kind, name in BACKENDS.items():
        if name == backend:
            return kind
    raise ValueError(f"unknown backend {backend!r}; supported: {', '.join(BACKENDS.values())}")


@dataclass(frozen=True)
class SyncGroup:
    """A process group that averages one kind of gradient: summed over ``ranks``, divided by ``divide_by``."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]      # global ranks, sorted
    divide_by: int              # dp * ep: the ranks whose losses the global loss averages


@dataclass
class ParallelDims:
    """Sizes, this rank's coordinates and the groups of one pp x dp x ep x tp mesh (see module docs)."""

    pp: int
    dp: int
    ep: int
    tp: int
    mesh: DeviceMesh
    backend: str
    _dense: SyncGroup = field(repr=False)
    _expert: SyncGroup = field(repr=False)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    def coord(self, dim: str) -> int:
        """This rank's index along ``dim`` (one of pp, dp, ep, tp)."""
        return self.mesh.get_local_rank(_check_dim(dim))

    def submesh(self, dim: str) -> DeviceMesh:
        """The 1-D sub-mesh of ``dim`` through this rank (e.g. for ``fully_shard`` or tensor parallel)."""
        return self.mesh[_check_dim(dim)]

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of ``dim`` through this rank (pp, dp, ep or tp)."""
        return self.mesh.get_group(_check_dim(dim))

    def grad_group(self, kind: str = "dense") -> SyncGroup:
        """The data-parallel group gradients of ``kind`` weights average over: dense -> dp x ep, expert -> dp."""
        return self._dense if check_kind(kind) == "dense" else self._expert

    def stage_sync_groups(self, holders: Sequence[Sequence[int]], kind: str = "dense") -> dict[int, SyncGroup]:
        """Gradient groups per stage, given ``holders[stage]`` = the pp ranks that hold a copy of it.

        Collective: every rank of the mesh must call it with the same ``holders``. A stage held by
        one pp rank reduces over ``grad_group(kind)``; a stage held by several (DualPipe's mirrored
        stages: ``holders[s] = (s, P-1-s)``) gets its own group over all copies x the replicas,
        with the same ``divide_by`` (copies are summed, replicas averaged). Returns the
        groups of the stages this rank holds.
        """
        base = self.grad_group(kind)
        me = self.coord("pp")
        out: dict[int, SyncGroup] = {}
        for stage, pps in enumerate(holders):
            pps = tuple(sorted(pps))
            if len(set(pps)) != len(pps) or not pps or any(not 0 <= p < self.pp for p in pps):
                raise ValueError(f"stage {stage}: holders {list(pps)} must be distinct pipeline ranks in "
                                 f"[0, {self.pp})")
            if len(pps) == 1:
                if pps[0] == me:
                    out[stage] = base
                continue
            mine = _new_groups(self.mesh.mesh, pps, _replicated_dims(kind))
            if me in pps and mine is not None:
                out[stage] = SyncGroup(mine.group, mine.ranks, base.divide_by)
        return out


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}; allowed: {', '.join(DIMS)}")
    return dim


def _replicated_dims(kind: str) -> tuple[int, ...]:
    """Mesh axes a weight of ``kind`` is replicated over (its gradient reduces over them)."""
    return (1, 2) if kind == "dense" else (1,)


def _new_groups(grid: torch.Tensor, pps: tuple[int, ...], reduce_axes: tuple[int, ...]) -> SyncGroup | None:
    """Process groups spanning pp ranks ``pps`` x the mesh axes ``reduce_axes`` (1 = dp, 2 = ep), one
    per coordinate of the other axes; every rank creates every group (``new_group`` is collective,
    so all ranks must loop in the same order). Returns this rank's group (divide_by unset) or None."""
    rank = dist.get_rank()
    sub = grid[list(pps)]                                     # (len(pps), dp, ep, tp)
    keep = [a for a in (1, 2, 3) if a not in reduce_axes]     # axes whose coordinate is fixed per group
    mine: SyncGroup | None = None
    for fixed in itertools.product(*(range(grid.shape[a]) for a in keep)):
        index: list[object] = [slice(None)] * 4
        for a, v in zip(keep, fixed):
            index[a] = v
        ranks = tuple(sorted(int(r) for r in sub[tuple(index)].reshape(-1).tolist()))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = SyncGroup(group, ranks, 0)
    return mine


def _grad_group(grid: torch.Tensor, kind: str, divide_by: int) -> SyncGroup:
    """This rank's plain (one pipeline rank) gradient group for ``kind``, built collectively."""
    mine = None
    for p in range(grid.shape[0]):
        got = _new_groups(grid, (p,), _replicated_dims(kind))
        mine = got or mine
    if mine is None:  # pragma: no cover - every rank sits at some pp coordinate
        raise RuntimeError(f"rank {dist.get_rank()} is in no {kind} gradient group")
    return SyncGroup(mine.group, mine.ranks, divide_by)


def _init_default_group(backend: str) -> None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("torch.distributed is not initialised and RANK/WORLD_SIZE are not set: launch with "
                           "torchrun or call torch.distributed.init_process_group first")
    dist.init_process_group(backend)


def init_parallel(pp: int = 1, dp: int = 1, ep: int = 1, tp: int = 1, *, backend: str | None = None,
                  mesh: DeviceMesh | None = None) -> ParallelDims:
    """Build the ``(pp, dp, ep, tp)`` device mesh (pp outermost, tp innermost) and its gradient groups.

    Collective over the default process group; initialises it from the environment (torchrun) with
    ``backend`` when it is not initialised yet. ``backend=None`` picks gloo / nccl / mccl from the
    device this process uses (``device.backend_for``); when the default group already
    exists its backend must agree with ``backend``.

    ``mesh=``: a ``DeviceMesh`` the user built, read by its dimension names (``mesh_roles``:
    torchtitan's and Megatron's); the sizes come from it and the runtime's mesh spans the same ranks.
    """
    if mesh is not None:
        return from_device_mesh(mesh)
    sizes = {"pp": pp, "dp": dp, "ep": ep, "tp": tp}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"parallel sizes must be positive integers, got {bad}")
    current = dist.get_backend() if dist.is_initialized() else None
    if backend is None:  # the initialised group's backend when it is a plain one, else the device's
        backend = current if current in BACKENDS.values() else backend_for(default_device_type())
    device_type = device_type_for_backend(backend)
    if current is None:
        _init_default_group(backend)
    elif current != backend and f":{backend}" not in current:  # "cpu:gloo,cuda:nccl" serves both
        raise ValueError(f"backend {backend!r} requested but the default process group uses {current!r}")
    world = dist.get_world_size()
    need = math.prod(sizes.values())
    if world != need:
        raise ValueError(f"world size {world} != pp*dp*ep*tp = {pp}*{dp}*{ep}*{tp} = {need}")
    return _dims_on(init_device_mesh(device_type, (pp, dp, ep, tp), mesh_dim_names=DIMS), backend)


def _dims_on(mesh: DeviceMesh, backend: str) -> ParallelDims:
    """``ParallelDims`` of a ``(pp, dp, ep, tp)``-named mesh: its sizes and gradient groups (collective)."""
    pp, dp, ep, tp = (int(n) for n in mesh.mesh.shape)
    return ParallelDims(pp, dp, ep, tp, mesh, backend, _grad_group(mesh.mesh, "dense", dp * ep),
                        _grad_group(mesh.mesh, "expert", dp * ep))


def from_device_mesh(mesh: DeviceMesh) -> ParallelDims:
    """The runtime's ``(pp, dp, ep, tp)`` mesh over the ranks of a user's ``mesh``, by its dimension names.

    Collective over the world. The user's mesh is kept as it is (its process groups, what
    ``fully_shard`` was given); the runtime builds its own mesh over the same ranks, pp outermost,
    each role's axes in the user's order, and its gradient groups on that.
    """
    if not dist.is_initialized():
        raise RuntimeError("a DeviceMesh needs torch.distributed initialised; build it after init_process_group")
    roles = canonical_order(mesh.mesh_dim_names, tuple(mesh.mesh.shape))
    order = [a for axes in roles.axes for a in axes]
    order += [a for a in range(mesh.mesh.dim()) if a not in order]  # cp of size 1
    grid = mesh.mesh.permute(order).reshape(roles.pp, roles.dp, roles.ep, roles.tp)
    world = dist.get_world_size()
    if sorted(int(r) for r in grid.reshape(-1).tolist()) != list(range(world)):
        shown = ", ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names or (), tuple(mesh.mesh.shape)))
        raise ValueError(f"the mesh ({shown}) spans {grid.numel()} ranks but the world has {world}: pass the whole "
                         "mesh (the pipeline's gradient groups are built over every rank)")
    own = DeviceMesh(mesh.device_type, grid, mesh_dim_names=DIMS)
    return _dims_on(own, dist.get_backend())
