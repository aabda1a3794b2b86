"""FSDP2 (``fully_shard``) stage modules inside a split-backward pipeline.

FSDP2 reshards a module's parameters and reduce-scatters its gradients in a post-backward hook
that fires when autograd reaches the module's *inputs* — i.e. at the end of B. With a split
backward W runs later and needs the unsharded parameters (its gradients accumulate into them),
so under FSDP's defaults W crashes on freed storage ("data is not allocated yet"), and a
reduce-scatter at B's end would miss W's contributions anyway. ``FSDPStageSync`` keeps a stage
unsharded for the whole step and moves the reduction to the stage's REDUCE op:

* ``begin_step()`` (before the stage's first F of the step): public FSDP2 switches
  ``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``, ``set_is_last_backward(False)``, then ``unshard()`` on
  every FSDP module of the stage. FSDP's own hooks now only accumulate into the unsharded
  parameters' ``.grad`` (B's and W's contributions alike).
* ``start()`` (after the stage's last W/BW of the step): take the accumulated unsharded
  gradients, ``reshard()`` every FSDP module, and post bucketed asynchronous reduce-scatters
  with FSDP2's own dim-0 chunking (``layout.py``) over each parameter's mesh.
* ``wait()``: complete them and write ``grad / divide_by`` into the sharded ``DTensor`` parameters'
  ``.grad`` (accumulating like FSDP does), so any optimizer built on the sharded parameters steps.

FSDP2 has no public call that runs its post-backward reduction outside autograd
(``torch.distributed.pipelining`` reaches into private per-group state for that), so the
reduce-scatter here is done with public collectives on the DTensor placement FSDP exposes.
Limits (checked where visible): a 1-D shard mesh with ``Shard(0)`` placements (no HSDP, no
``shard_placement_fn``), and no ``MixedPrecisionPolicy(reduce_dtype=...)`` different from the
parameter dtype (FSDP would move the gradient into a private buffer this helper cannot see).
Mirrored DualPipe stages (pipeline ranks r and P-1-r hold copies of the same layers, each copy
sharded over its own dp mesh) must sum both copies' gradients once: pass ``group=`` the process
group over *all copies x the dp replicas* (``ParallelDims.stage_sync_groups``, what the Pipeline
builds) and ``divide_by=dp``. The copies then hold the same dim-0 shard at the same dp
coordinate, but a reduce-scatter over the larger group cannot hand one chunk to two ranks, so the
bucket is all-reduced over ``group`` and each rank keeps its own chunk (twice a reduce-scatter's
traffic, on mirrored stages only).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .layout import DEFAULT_BUCKET_BYTES, ShardLayout
from .stage_sync import GroupUse, SyncInfo, group_ranks

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module in ``module``'s tree (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FSDPStageSync:
    """Unshard-for-the-step / reduce-after-last-W driver of one ``fully_shard``-wrapped stage module
    (dp mode ``"fsdp"``; implements ``stage_sync.StageGradSync``)."""

    mode = "fsdp"

    def __init__(self, module: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, divide_by: int | None = None,
                 group: dist.ProcessGroup | None = None, key: tuple[Hashable, ...] = ("fsdp",)):
        if not isinstance(module, FSDPModule):
            raise TypeError(f"FSDPStageSync needs a module wrapped with fully_shard, got {type(module).__name__}")
        self.module = module
        self.fsdp = fsdp_modules(module)
        sharded = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not sharded:
            raise ValueError("FSDPStageSync needs at least one parameter that requires grad")
        meshes = {id(p.device_mesh): p.device_mesh for _, p in sharded if isinstance(p, DTensor)}
        plain = [n for n, p in sharded if not isinstance(p, DTensor)]
        if plain or len(meshes) != 1:
            raise ValueError(f"every parameter must be an FSDP2-sharded DTensor on one mesh; plain: {plain}, "
                             f"meshes: {len(meshes)}")
        self.mesh = next(iter(meshes.values()))
        wrong = [n for n, p in sharded if isinstance(p, DTensor) and tuple(p.placements) != (Shard(0),)]
        if self.mesh.ndim != 1 or wrong:
            raise ValueError(f"only a 1-D mesh with Shard(0) placements is supported (no HSDP / shard_placement_fn); "
                             f"mesh ndim {self.mesh.ndim}, other placements: {wrong}")
        self.names = [n for n, _ in sharded]
        shard_group = self.mesh.get_group()
        self.world = dist.get_world_size(shard_group)  # the shard count: FSDP's dim-0 chunking
        self.rank = dist.get_rank(shard_group)
        shard_ranks = set(dist.get_process_group_ranks(shard_group))
        if group is not None and set(dist.get_process_group_ranks(group)) == shard_ranks:
            group = None  # the same ranks: reduce-scatter over the shard mesh itself
        self.group = shard_group if group is None else group
        self.reduce_world = dist.get_world_size(self.group)
        if self.reduce_world % self.world or not shard_ranks <= set(dist.get_process_group_ranks(self.group)):
            raise ValueError(f"group= (ranks {dist.get_process_group_ranks(self.group)}) must contain the shard mesh's "
                             f"ranks {sorted(shard_ranks)} and be a multiple of its size {self.world}: the "
                             "mirrored copies x the data-parallel replicas")
        self.divide_by = self.world if divide_by is None else divide_by
        if self.divide_by < 1:
            raise ValueError(f"divide_by={self.divide_by} must be >= 1")
        self.bucket_bytes = bucket_bytes
        self.key = tuple(key)  # names its group for resilience.regroup (unique within the pipeline rank)
        self._pending: tuple[ShardLayout, list[torch.Tensor], list[dist.Work]] | None = None
        self._fulls: list[torch.Tensor] = []
        self._synced = False
        self.collectives_posted = 0
        self.buckets = 0  # buckets of the last reduction (the layout is made from the unsharded gradients)

    @property
    def pending(self) -> bool:
        """True between ``start()`` and ``wait()``."""
        return self._pending is not None

    @property
    def synced(self) -> bool:
        """True after ``wait()`` until the next step: the sharded parameters' ``.grad`` are final."""
        return self._synced

    def begin_step(self) -> None:
        """Before the stage's first F of the step: keep everything unsharded until ``start()``.

        A reduction that a failed step left pending is abandoned (its group is replaced by
        ``resilience.regroup`` before the step is retried)."""
        self._pending, self._fulls, self._synced = None, [], False
        root = self.module
        root.set_reshard_after_forward(False)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
        root.set_is_last_backward(False)
        handles = [m.unshard(async_op=True) for m in self.fsdp]
        for h in handles:
            if h is not None:
                h.wait()

    def _unsharded_grads(self) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        got = dict(self.module.named_parameters())
        out: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        for n in self.names:
            p = got[n]
            if isinstance(p, DTensor):
                raise RuntimeError(f"parameter {n!r} is sharded at the stage's REDUCE op: begin_step() must run "
                                   "before the stage's first F of the step")
            out.append((n, p, p.grad))
            p.grad = None
        return out

    def start(self) -> None:
        """After the stage's last W: reshard and post the reduce-scatters of the accumulated gradients."""
        if self._pending is not None:
            raise RuntimeError("start() called twice without wait(): one reduction per step")
        unsharded = self._unsharded_grads()
        layout = ShardLayout([p for _, p, _ in unsharded], self.world, self.bucket_bytes)
        fulls, shards, works = [], [], []
        for b, bucket in enumerate(layout.buckets):
            full = layout.new_full(b, unsharded[0][1].device)
            layout.pack(b, [unsharded[s.index][2] for s in bucket.slots], full)
            fulls.append(full)
            if self.reduce_world == self.world:
                shard = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=full.device)
                works.append(_reduce_scatter(shard, full, group=self.group, async_op=True))
            else:  # mirrored copies: sum over copies x replicas, then keep this rank's chunk (a view)
                works.append(dist.all_reduce(full, group=self.group, async_op=True))
                shard = full.view(self.world, bucket.shard_numel)[self.rank]
            shards.append(shard)
            self.collectives_posted += 1
        for m in self.fsdp:
            m.reshard()
        self._pending = (layout, shards, works)
        self.buckets = len(layout.buckets)
        self._fulls = fulls  # keep the inputs alive until the collectives are done
        self._synced = False

    @torch.no_grad()
    def wait(self) -> None:
        """Complete the reduce-scatters; the sharded parameters' ``.grad`` hold the averaged gradient."""
        if self._pending is None:
            raise RuntimeError("wait() without a pending start()")
        layout, shards, works = self._pending
        for w in works:
            w.wait()
        self._pending, self._fulls = None, []
        params = dict(self.module.named_parameters())
        for b, bucket in enumerate(layout.buckets):
            shards[b].div_(self.divide_by)
            for s, local in zip(bucket.slots, layout.shard_views(b, shards[b], self.rank)):
                p = params[self.names[s.index]]
                assert isinstance(p, DTensor)  # resharded at start(): FSDP's Shard(0) parameter again
                if p.to_local().shape != local.shape:
                    raise RuntimeError(f"parameter {self.names[s.index]!r}: FSDP's local shard is "
                                       f"{tuple(p.to_local().shape)} but dim-0 chunking gives {tuple(local.shape)}")
                grad = DTensor.from_local(local.to(p.dtype, copy=True), self.mesh, [Shard(0)], run_check=False,
                                          shape=p.shape, stride=p.stride())
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        self._synced = True

    def end_step(self) -> None:
        """Give FSDP its defaults back (reshard after forward/backward, gradient sync on), e.g. for eval."""
        root = self.module
        root.set_reshard_after_forward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        root.set_is_last_backward(True)

    # ----- the rest of stage_sync.StageGradSync ----------------------------------------------------------
    def reduced_shards(self) -> list[torch.Tensor]:
        """Nothing: the reduced shards are the sharded parameters' own ``.grad`` (DTensors)."""
        return []

    def process_groups(self) -> list[GroupUse]:
        """The group the reduction posts on (FSDP's own all-gathers run on the mesh it was given: a limit)."""
        return [GroupUse(self.key, group_ranks(self.group))]

    def replace_group(self, key: tuple[Hashable, ...], group: dist.ProcessGroup) -> None:
        if tuple(key) == self.key:
            if group_ranks(group) != group_ranks(self.group):
                raise ValueError(f"group {self.key}: a replacement must span ranks {list(group_ranks(self.group))}, "
                                 f"got {list(group_ranks(group))}")
            self.group = group

    def describe(self) -> SyncInfo:
        params = dict(self.module.named_parameters())
        numel = sum(params[n].numel() for n in self.names)
        return SyncInfo(self.mode, len(self.names), numel, self.buckets, tuple(self.process_groups()), self.divide_by)
