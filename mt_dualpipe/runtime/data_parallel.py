"""Data-parallel replicas of a pipeline: one gradient-sync object per local stage, built from a mesh.

A ``Pipeline`` given ``mesh=`` (``parallel.init_parallel``) runs its schedule on the mesh's ``pp``
group and reduces each stage's gradients over that stage's data-parallel group at the stage's
``REDUCE_GRAD`` op (``schedules.data_parallel``: right after the stage's last W/BW on the rank), so
the collective overlaps the rest of the pipeline's drain. What reduces and how is chosen here, once:

* the groups come from ``ParallelDims.stage_sync_groups``: a stage held by one pipeline rank
  reduces over dp; DualPipe's mirrored copies (the same stage in two chains, on ranks r and P-1-r)
  share one group over copies x dp, so the copies are summed once and the replicas averaged;
* ``dp_mode`` picks the sync object: ``GradSync`` all-reduce (DDP semantics), ``GradSync`` zero1
  (reduce-scatter; step with ``parallel.ZeroOptimizer``), or ``FSDPStageSync`` for stages the user
  wrapped with ``fully_shard`` (unsharded for the step, reduce-scattered after the last W).

Why not ``DistributedDataParallel``: its reducer is driven by autograd hooks, which a deferred W
(gradients written after B, outside that backward) does not go through in DDP's order, and it
reduces once per backward, i.e. per micro-batch and before W — wrong gradients, no error. Such
stages are refused with a message pointing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .errors import PipelineError

DP_MODES = ("allreduce", "zero1", "fsdp")
DP_BATCH = ("global", "local")


def rank_label(pp_rank: int, global_rank: int) -> str:
    """How errors name a rank: its pipeline rank, and its global rank when that differs."""
    if pp_rank == global_rank:
        return f"rank {pp_rank}"
    return f"pipeline rank {pp_rank} (global rank {global_rank})"


def refuse_wrapped(modules: Sequence[nn.Module], dp_mode: str | None, label: str) -> None:
    """DDP-wrapped stages (silently wrong under a split backward) and FSDP stages without ``dp_mode='fsdp'``."""
    from torch.distributed.fsdp import FSDPModule

    for i, m in enumerate(modules):
        if isinstance(m, DistributedDataParallel):
            raise PipelineError(
                f"{label}: stage module {i} is wrapped in DistributedDataParallel, whose reducer runs from autograd "
                "hooks once per backward (per micro-batch, before the deferred W): the pipeline's gradients would be "
                "wrong. Pass the bare module (ddp.module) and give the Pipeline mesh=init_parallel(pp=..., dp=...) "
                "with dp_mode='allreduce' (or 'zero1' / 'fsdp'): the schedule then reduces each stage's gradients "
                "after its last W")
        if isinstance(m, FSDPModule) and dp_mode != "fsdp":
            raise PipelineError(
                f"{label}: stage module {i} ({type(m).__name__}) is wrapped with fully_shard, which needs "
                f"dp_mode='fsdp' (got dp_mode={dp_mode!r}) and mesh=: FSDP's own hooks reshard after B, before W "
                "runs; the pipeline keeps the stage unsharded for the step and reduce-scatters after its last W")


def check_mesh(mesh: Any, num_pp_ranks: int | None = None) -> None:
    """A ``ParallelDims`` whose sizes agree with its device mesh and that this runtime supports."""
    sizes = (mesh.pp, mesh.dp, mesh.ep, mesh.tp)
    total = mesh.mesh.size()
    if total != mesh.pp * mesh.dp * mesh.ep * mesh.tp:
        raise PipelineError(f"the mesh has {total} ranks but pp*dp*ep*tp = {mesh.pp}*{mesh.dp}*{mesh.ep}*{mesh.tp} "
                            f"= {mesh.pp * mesh.dp * mesh.ep * mesh.tp}; build it with init_parallel")
    if tuple(mesh.mesh.shape) != sizes:
        raise PipelineError(f"the mesh's shape {tuple(mesh.mesh.shape)} is not (pp, dp, ep, tp) = {sizes}")
    if mesh.ep != 1 or mesh.tp != 1:
        raise PipelineError(f"Pipeline(mesh=) supports pp x dp meshes; got ep={mesh.ep}, tp={mesh.tp} (expert and "
                            "tensor parallel stages need per-parameter groups the pipeline does not build yet)")


def stage_holders(placement: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Per stage index, the pipeline ranks holding a copy of it: stage s of every chain is the same layers."""
    n = max(len(chain) for chain in placement)
    return [tuple(sorted({chain[s] for chain in placement if s < len(chain)})) for s in range(n)]


def _check_supported(module: nn.Module, dp_mode: str, where: str) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if dp_mode == "fsdp":
        if not isinstance(module, FSDPModule):
            raise PipelineError(f"{where}: dp_mode='fsdp' needs stage modules wrapped with fully_shard(module, "
                                f"mesh=dims.submesh('dp')); got a plain {type(module).__name__}")
        return
    sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise PipelineError(f"{where}: dp_mode={dp_mode!r} reduces plain tensors but the module has DTensor "
                            f"parameters {sharded[:3]}; use dp_mode='fsdp' for fully_shard modules")
    if not any(p.requires_grad for p in module.parameters()):
        raise PipelineError(f"{where}: dp_mode={dp_mode!r} needs at least one parameter that requires grad")


def build_syncs(mesh: Any, placement: Sequence[Sequence[int]], local: Sequence[tuple[int, int]],
                modules: Sequence[nn.Module], dp_mode: str, bucket_bytes: int,
                label: str) -> dict[tuple[int, int], Any]:
    """One sync object per local (chain, stage) whose group spans more than this rank (collective)."""
    from ..parallel import FSDPStageSync, GradSync

    groups = mesh.stage_sync_groups(stage_holders(placement), "dense")
    out: dict[tuple[int, int], Any] = {}
    for (c, s), module in zip(local, modules):
        g = groups[s]
        where = f"{label}, stage (chain {c}, stage {s})"
        _check_supported(module, dp_mode, where)
        if len(g.ranks) == 1 and dp_mode != "fsdp":
            continue
        if dp_mode == "fsdp":
            out[(c, s)] = FSDPStageSync(module, bucket_bytes=bucket_bytes, divide_by=g.divide_by)
        else:
            out[(c, s)] = GradSync(module, g.group, mode=dp_mode, bucket_bytes=bucket_bytes, divide_by=g.divide_by)
    return out


def replica_slice(values: Sequence[Any], replica: int, replicas: int, dim: int, what: str) -> tuple:
    """This replica's contiguous share of every tensor of a global batch (None stays None)."""
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        if v.dim() <= dim or v.shape[dim] % replicas:
            size = "no such dim" if v.dim() <= dim else f"{v.shape[dim]} rows"
            raise PipelineError(f"{what} of shape {tuple(v.shape)}: a global batch of {size} along batch_dim={dim} "
                                f"does not split over the dp={replicas} data-parallel replicas; use a batch size "
                                f"divisible by {replicas} (or dp_batch='local' and pass each replica's own batch)")
        n = v.shape[dim] // replicas
        out.append(v.narrow(dim, replica * n, n))
    return tuple(out)
