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
* ``"allreduce_bf16"``: the same, with each bucket sent as bfloat16 (half the bytes of float32
  gradients, what DDP's ``bf16_compress_hook`` does) and written back in the gradient's dtype.
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

from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import DEFAULT_BUCKET_BYTES, ShardLayout
from .modes import DP_MODES
from .stage_sync import GroupUse, SyncInfo, get_mode, group_ranks, stage_params
from .tensor_parallel import like_param, local_tensor

MODES = tuple(m.name for m in DP_MODES.values() if not m.needs_fully_shard)
"""The ``DP_MODES`` that ``GradSync`` itself runs: all but those of ``fully_shard`` stages (``fsdp.py``)."""

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ReductionState:
    """The ``idle -> started -> done`` state every sync object behind a ``REDUCE_GRAD`` keeps
    (the ``pending`` / ``synced`` half of ``stage_sync.StageGradSync``)."""

    _state = "idle"

    @property
    def pending(self) -> bool:
        """True between ``start()`` and ``wait()``."""
        return self._state == "started"

    @property
    def synced(self) -> bool:
        """True after ``wait()`` until the next ``start()``: the reduced gradients are in place."""
        return self._state == "done"


class GradSync(_ReductionState):
    """Bucketed asynchronous gradient reduction of one stage over a data-parallel ``group``.

    ``divide_by`` is what the summed gradient is divided by (default: the group size; use
    ``SyncGroup.divide_by`` from ``ParallelDims`` for mirrored stages and expert weights).
    """

    def __init__(self, module: nn.Module | Iterable[nn.Parameter], group: dist.ProcessGroup | None = None, *,
                 mode: str = "allreduce", bucket_bytes: int = DEFAULT_BUCKET_BYTES, divide_by: int | None = None,
                 key: tuple[Hashable, ...] = ("grad",)):
        spec = get_mode(mode)
        if spec.name not in MODES:
            raise ValueError(f"GradSync runs modes {', '.join(MODES)}, got {mode!r}: dp mode 'fsdp' reduces "
                             "fully_shard stages with parallel.FSDPStageSync")
        self._scatter = spec.reduces_by == "reduce_scatter"  # else all-reduce
        self.wire_dtype = getattr(torch, spec.wire_dtype) if spec.wire_dtype else None
        self.params = stage_params(module)
        if not self.params:
            raise ValueError("GradSync needs a module with at least one parameter that requires grad")
        self.group = group
        self.key = tuple(key)  # names its group for resilience.regroup (unique within the pipeline rank)
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
        if not spec.tensor_parallel and any(isinstance(p, DTensor) for p in self.params):
            raise ValueError(f"GradSync mode {mode!r} shards plain parameters; tensor-parallel (DTensor) parameters "
                             "reduce with mode 'allreduce'")
        self.layout = ShardLayout([local_tensor(p) for p in self.params], self.world, bucket_bytes)  # tp: local shard
        # allreduce keeps its buckets (DDP does too); zero1 allocates them per step and frees them at
        # wait(), so between steps a rank holds only its gradient shard
        self._full = ([self.layout.new_full(b, self.device) for b in range(len(self.layout.buckets))]
                      if not self._scatter else [])
        self._shard = ([torch.zeros(b.shard_numel, dtype=b.dtype, device=self.device) for b in self.layout.buckets]
                       if self._scatter else [])
        self._wire: list[torch.Tensor] = []  # allreduce_bf16: the buckets as sent, for the step
        self._works: list[dist.Work] = []
        self._state = "idle"  # idle -> started -> done
        self.collectives_posted = 0  # per instance, for tests and timelines

    def begin_step(self) -> None:
        """Before the stage's first F: a reduction that a failed step left pending is abandoned (the
        caller replaces its group, ``resilience.regroup``); nothing else to prepare."""
        self._works = []
        self._state = "idle"

    def start(self) -> None:
        """Post one asynchronous collective per bucket over the current ``.grad`` of every parameter."""
        if self._state == "started":
            raise RuntimeError("GradSync.start() called twice without wait(): one reduction per step")
        self._works, self._wire = [], []
        if self._scatter:
            self._full = [self.layout.new_full(b, self.device) for b in range(len(self.layout.buckets))]
        for b, bucket in enumerate(self.layout.buckets):
            grads = [local_tensor(self.params[s.index].grad) for s in bucket.slots]
            self.layout.pack(b, grads, self._full[b])
            if self._scatter:
                self._works.append(_reduce_scatter(self._shard[b], self._full[b], group=self.group, async_op=True))
            else:
                wire = self._full[b] if self.wire_dtype is None else self._full[b].to(self.wire_dtype)
                self._wire.append(wire)
                self._works.append(dist.all_reduce(wire, group=self.group, async_op=True))
            self.collectives_posted += 1
        if self._scatter:
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
            if not self._scatter:
                if self._wire[b] is not self._full[b]:  # back from the wire dtype, then averaged
                    self._full[b].copy_(self._wire[b])
                self._full[b].div_(self.divide_by)
                for s, g in zip(self.layout.buckets[b].slots, self.layout.unpack(b, self._full[b])):
                    p = self.params[s.index]
                    if p.grad is None:
                        p.grad = like_param(p, g.clone())
                    else:
                        local_tensor(p.grad).copy_(g)
            else:
                self._shard[b].div_(self.divide_by)
        if self._scatter:
            self._full = []
        self._wire = []
        self._state = "done"

    def sync(self) -> None:
        """``start()`` then ``wait()``: the blocking form."""
        self.start()
        self.wait()

    def grad_shards(self) -> list[torch.Tensor]:
        """zero1: per parameter (in ``params`` order), this rank's reduced gradient chunk (views)."""
        if not self._scatter:
            raise RuntimeError(f"grad_shards() is only defined in a reduce-scatter mode (zero1), not {self.mode!r}")
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

    # ----- the rest of stage_sync.StageGradSync --------------------------------------------------------
    def reduced_shards(self) -> list[torch.Tensor]:
        """zero1 after ``wait()``: this rank's reduced chunks (``.grad`` is None then); else nothing."""
        if not self._scatter or not self.synced:
            return []
        return [g for g in self.grad_shards() if g is not None]

    def process_groups(self) -> list[GroupUse]:
        return [GroupUse(self.key, group_ranks(self.group))]

    def replace_group(self, key: tuple[Hashable, ...], group: dist.ProcessGroup) -> None:
        if tuple(key) == self.key:
            _check_same_ranks(self.group, group, self.key)
            self.group = group

    def describe(self) -> SyncInfo:
        return SyncInfo(self.mode, len(self.params), sum(p.numel() for p in self.params), len(self.layout.buckets),
                        tuple(self.process_groups()), self.divide_by)


def _check_same_ranks(old: dist.ProcessGroup | None, new: dist.ProcessGroup, key: tuple) -> None:
    """A replacement group must span the ranks of the one it replaces (rank indices and chunks depend on them)."""
    if group_ranks(old) != group_ranks(new):
        raise ValueError(f"group {key}: a replacement must span ranks {list(group_ranks(old))}, got "
                         f"{list(group_ranks(new))}")


class TiedSync(_ReductionState):
    """The gradient of weights tied across pipeline stages (a shared embedding / LM head), summed once per step.

    ``copies[i]`` are this rank's copies of tied weight ``i`` (one per local stage holding it; the
    same ``Parameter`` object may appear in several stages and counts once). The tie is reduced
    like a late bucket of its stages: each local holder stage's ``StageSync`` calls ``arrive``
    at its REDUCE_GRAD, and when the last of them has (all their W ran, so every local copy's
    gradient is final) the copies are summed into the first one, the *representative*, and its
    reduction over ``group`` (the pipeline ranks holding a copy x the data-parallel replicas,
    ``ParallelDims.stage_sync_groups``) is posted. ``group=None``: every copy is on this rank and
    no replica exists, only the local sum runs. After ``wait()`` every copy's ``.grad`` holds the
    total (allreduce mode), or the representative's shard is in ``sync.grad_shards()`` and every
    copy's ``.grad`` is None (zero1). An optimizer steps the representative only and copies
    it into the other copies (``copy_to_copies``): the copies are one weight, stepped once.
    """

    def __init__(self, copies: Sequence[Sequence[nn.Parameter]], stages: Iterable[tuple[int, int]],
                 group: dist.ProcessGroup | None, *, mode: str = "allreduce", divide_by: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, names: Sequence[str] | None = None):
        self.copies = [list({id(p): p for p in c}.values()) for c in copies]
        if not self.copies or any(not c for c in self.copies):
            raise ValueError("TiedSync needs at least one copy of every tied weight")
        self.reps = [c[0] for c in self.copies]
        self.names = tuple(names) if names is not None else tuple(str(i) for i in range(len(self.reps)))
        if len(self.names) != len(self.reps):
            raise ValueError(f"{len(self.names)} names for {len(self.reps)} tied weights")
        self.stages = frozenset(stages)
        self.mode = mode
        self.sync = (GradSync(self.reps, group, mode=mode, bucket_bytes=bucket_bytes, divide_by=divide_by,
                              key=("tie", *self.names)) if group is not None else None)
        self._all_reduce = get_mode(mode).reduces_by == "all_reduce"
        if self.sync is None and not self._all_reduce:
            raise ValueError(f"a tie without a group has nothing to shard: mode must be 'allreduce', got {mode!r}")
        self._arrived: set[tuple[int, int]] = set()
        self._state = "idle"

    @property
    def collectives_posted(self) -> int:
        return self.sync.collectives_posted if self.sync is not None else 0

    def begin_step(self) -> None:
        """Forget last step's arrivals (called by every holder stage; idempotent before the first arrival)."""
        self._arrived = set()
        self._state = "idle"
        if self.sync is not None:
            self.sync.begin_step()

    def arrive(self, stage: tuple[int, int]) -> None:
        """Holder ``stage``'s gradients are final; post the reduction once every local holder arrived."""
        if stage not in self.stages:
            raise ValueError(f"stage {stage} holds no copy of this tie (holders: {sorted(self.stages)})")
        self._arrived.add(stage)
        if self._arrived == self.stages and self._state == "idle":
            self.start()

    @torch.no_grad()
    def start(self) -> None:
        """Sum the local copies into the representative and post its reduction (the late bucket)."""
        for rep, copies in zip(self.reps, self.copies):
            for other in copies[1:]:
                if other.grad is None:
                    continue
                if rep.grad is None:
                    rep.grad = other.grad.clone()
                else:
                    rep.grad.add_(other.grad)
                other.grad = None
        if self.sync is not None:
            self.sync.start()
        self._state = "started"

    @torch.no_grad()
    def wait(self) -> None:
        """Complete the reduction (once, whichever holder stage asks first) and hand the total to every copy."""
        if self._state == "done":
            return
        if self._state != "started":
            missing = sorted(self.stages - self._arrived)
            raise RuntimeError(f"TiedSync.wait() before every holder stage reached its REDUCE_GRAD; missing {missing}")
        if self.sync is not None:
            self.sync.wait()
        if self._all_reduce:
            for rep, copies in zip(self.reps, self.copies):
                for other in copies[1:]:
                    other.grad = None if rep.grad is None else rep.grad.clone()
        self._state = "done"

    @torch.no_grad()
    def copy_to_copies(self) -> None:
        """After the representative was stepped: make every other local copy equal to it."""
        for rep, copies in zip(self.reps, self.copies):
            for other in copies[1:]:
                other.copy_(rep)

    # ----- the rest of stage_sync.StageGradSync: the representative's GradSync, when there is one -----------
    def reduced_shards(self) -> list[torch.Tensor]:
        return self.sync.reduced_shards() if self.sync is not None else []

    def process_groups(self) -> list[GroupUse]:
        return self.sync.process_groups() if self.sync is not None else []

    def replace_group(self, key: tuple[Hashable, ...], group: dist.ProcessGroup) -> None:
        if self.sync is not None:
            self.sync.replace_group(key, group)

    def describe(self) -> SyncInfo:
        if self.sync is not None:
            return self.sync.describe()
        return SyncInfo(self.mode, len(self.reps), sum(p.numel() for p in self.reps), 0, (), 1)


class StageSync(_ReductionState):
    """Everything one stage reduces at its REDUCE_GRAD: one ``GradSync`` per weight kind, and its ties.

    ``parts``: e.g. the dense weights over copies x dp x ep and the expert weights over copies x dp
    (``weight_kinds``, ``ParallelDims.stage_sync_groups(holders, kind)``), posted together;
    ``ties``: the ``TiedSync`` objects this stage holds a copy of, told that this stage is done
    (the last local holder posts the tie). Same protocol as ``GradSync``: ``begin_step``,
    ``start``, ``wait``.
    """

    def __init__(self, stage: tuple[int, int], parts: Sequence[GradSync] = (), ties: Sequence[TiedSync] = (),
                 mode: str | None = None):
        self.stage = stage
        self.parts = list(parts)
        self.ties = list(ties)
        modes = {p.mode for p in self.parts} | ({mode} if mode is not None else set())
        if len(modes) > 1:  # (a tie without replicas all-reduces locally in any mode)
            raise ValueError(f"a stage's parts reduce in one mode, got {sorted(modes)}")
        self.mode = modes.pop() if modes else "allreduce"
        self._state = "idle"

    @property
    def collectives_posted(self) -> int:
        """Collectives this stage's own parts posted (a tie's are counted on its ``TiedSync``)."""
        return sum(p.collectives_posted for p in self.parts)

    def begin_step(self) -> None:
        for p in self.parts:
            p.begin_step()
        for t in self.ties:
            t.begin_step()
        self._state = "idle"

    def start(self) -> None:
        if self._state == "started":
            raise RuntimeError("StageSync.start() called twice without wait(): one reduction per step")
        for p in self.parts:
            p.start()
        for t in self.ties:
            t.arrive(self.stage)
        self._state = "started"

    def wait(self) -> None:
        if self._state != "started":
            raise RuntimeError("StageSync.wait() without a pending start()")
        for p in self.parts:
            p.wait()
        for t in self.ties:
            t.wait()
        self._state = "done"

    # ----- the rest of stage_sync.StageGradSync: the parts', then the ties' ------------------------------
    def _members(self) -> list[GradSync | TiedSync]:
        return [*self.parts, *self.ties]

    def reduced_shards(self) -> list[torch.Tensor]:
        return [g for m in self._members() for g in m.reduced_shards()]

    def process_groups(self) -> list[GroupUse]:
        return [u for m in self._members() for u in m.process_groups()]

    def replace_group(self, key: tuple[Hashable, ...], group: dist.ProcessGroup) -> None:
        for m in self._members():
            m.replace_group(key, group)

    def describe(self) -> SyncInfo:
        infos = [p.describe() for p in self.parts]
        return SyncInfo(self.mode, sum(i.num_params for i in infos), sum(i.numel for i in infos),
                        sum(i.buckets for i in infos), tuple(self.process_groups()),
                        max((i.divide_by for i in infos), default=1))
