"""Data-parallel gradient synchronisation of one stage, launched by the schedule, not by hooks.

A pipeline stage's gradients are final after its last W (or BW) of the step on that rank; deferred
W writes ``.grad`` outside autograd, so DDP's hooks never see it. ``GradSync`` therefore works on
the final ``.grad`` values, once per step: ``start()`` packs them into flat buckets (layout in
``layout.py``) and posts one asynchronous collective per bucket; ``wait()`` completes them and
averages. Accumulation over micro-batches stays exact: autograd and W keep summing into ``.grad``
and the reduction runs once on the sum.

Modes:

* ``"allreduce"``: each bucket is all-reduced; after ``wait()`` every ``p.grad`` holds the average
  over the data-parallel replicas (DDP semantics).
* ``"zero1"``: each bucket is reduce-scattered; after ``wait()`` this rank holds only its shard
  (``grad_shards``: per parameter, chunk ``rank`` of dim 0 — the local part of a ``Shard(0)``
  DTensor) and ``p.grad`` is set to None, so nothing can read an un-reduced gradient by mistake.
  ``ZeroOptimizer`` steps those shards and all-gathers the parameters.

The collective sums over the group; ``divide_by`` turns the sum into the average the loss
convention needs (default: the group size, plain DDP). Take both from ``ParallelDims``
(``grad_group`` / ``stage_sync_groups``): mirrored DualPipe copies share one group of all copies x
replicas, so the copies are summed once and only the replicas averaged; expert weights reduce
over the expert-data-parallel group but divide by dp x ep (see ``mesh.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .layout import ShardLayout

MODES = ("allreduce", "zero1")
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def stage_params(module: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The trainable parameters of a stage module (or an iterable of parameters), each once, in order."""
    params = module.parameters() if isinstance(module, nn.Module) else module
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GradSync:
    """Bucketed asynchronous gradient reduction of one stage over a data-parallel ``group``.

    ``divide_by`` is what the summed gradient is divided by (default: the group size; use
    ``SyncGroup.divide_by`` from ``ParallelDims`` for mirrored stages and expert weights).
    """

    def __init__(self, module: nn.Module | Iterable[nn.Parameter], group: dist.ProcessGroup | None = None, *,
                 mode: str = "allreduce", bucket_bytes: int = DEFAULT_BUCKET_BYTES, divide_by: int | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown data-parallel mode {mode!r}; allowed: {', '.join(MODES)}")
        self.params = stage_params(module)
        if not self.params:
            raise ValueError("GradSync needs a module with at least one parameter that requires grad")
        self.group = group
        self.mode = mode
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.divide_by = self.world if divide_by is None else divide_by
        if self.divide_by < 1:
            raise ValueError(f"divide_by={self.divide_by} must be >= 1")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"a stage's parameters must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.layout = ShardLayout(self.params, self.world, bucket_bytes)
        # allreduce keeps its buckets (DDP does too); zero1 allocates them per step and frees them at
        # wait(), so between steps a rank holds only its gradient shard
        self._full = ([self.layout.new_full(b, self.device) for b in range(len(self.layout.buckets))]
                      if mode == "allreduce" else [])
        self._shard = ([torch.zeros(b.shard_numel, dtype=b.dtype, device=self.device) for b in self.layout.buckets]
                       if mode == "zero1" else [])
        self._works: list[dist.Work] = []
        self._state = "idle"  # idle -> started -> done
        self.collectives_posted = 0  # per instance, for tests and timelines

    @property
    def pending(self) -> bool:
        """True between ``start()`` and ``wait()``."""
        return self._state == "started"

    @property
    def synced(self) -> bool:
        """True after ``wait()`` until the next ``start()``: the reduced gradients are in place."""
        return self._state == "done"

    def begin_step(self) -> None:
        """Nothing to prepare before the stage's first F (same protocol as ``FSDPStageSync``)."""

    def start(self) -> None:
        """Post one asynchronous collective per bucket over the current ``.grad`` of every parameter."""
        if self._state == "started":
            raise RuntimeError("GradSync.start() called twice without wait(): one reduction per step")
        self._works = []
        if self.mode == "zero1":
            self._full = [self.layout.new_full(b, self.device) for b in range(len(self.layout.buckets))]
        for b, bucket in enumerate(self.layout.buckets):
            grads = [self.params[s.index].grad for s in bucket.slots]
            self.layout.pack(b, grads, self._full[b])
            if self.mode == "allreduce":
                self._works.append(dist.all_reduce(self._full[b], group=self.group, async_op=True))
            else:
                self._works.append(_reduce_scatter(self._shard[b], self._full[b], group=self.group, async_op=True))
            self.collectives_posted += 1
        if self.mode == "zero1":
            for p in self.params:
                p.grad = None  # the reduced gradient lives in grad_shards from now on
        self._state = "started"

    def wait(self) -> None:
        """Complete the collectives and average: ``p.grad`` (allreduce) or ``grad_shards`` (zero1) are final."""
        if self._state != "started":
            raise RuntimeError("GradSync.wait() without a pending start()")
        for work in self._works:
            work.wait()
        self._works = []
        for b in range(len(self.layout.buckets)):
            if self.mode == "allreduce":
                self._full[b].div_(self.divide_by)
                for s, g in zip(self.layout.buckets[b].slots, self.layout.unpack(b, self._full[b])):
                    p = self.params[s.index]
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
            else:
                self._shard[b].div_(self.divide_by)
        if self.mode == "zero1":
            self._full = []
        self._state = "done"

    def sync(self) -> None:
        """``start()`` then ``wait()``: the blocking form."""
        self.start()
        self.wait()

    def grad_shards(self) -> list[torch.Tensor]:
        """zero1: per parameter (in ``params`` order), this rank's reduced gradient chunk (views)."""
        if self.mode != "zero1":
            raise RuntimeError("grad_shards() is only defined in zero1 mode")
        return self.shard_views(self._shard)

    def shard_views(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter (in ``params`` order), this rank's chunk in the per-bucket ``(S,)`` buffers ``shards``."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for b, bucket in enumerate(self.layout.buckets):
            for s, v in zip(bucket.slots, self.layout.shard_views(b, shards[b], self.rank)):
                out[s.index] = v
        return out  # type: ignore[return-value]

    def new_shards(self) -> list[torch.Tensor]:
        """Zeroed per-bucket ``(S,)`` buffers shaped like this rank's shard of every bucket."""
        return [torch.zeros(b.shard_numel, dtype=b.dtype, device=self.device) for b in self.layout.buckets]
