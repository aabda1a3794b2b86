"""ZeRO-1: each data-parallel rank keeps optimizer state for its shard of every parameter.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it partitions *whole parameters*
among ranks and expects every rank to hold the full all-reduced gradient (it is driven by DDP;
its only overlap mode is a DDP comm hook), then broadcasts each parameter from its owner. It
cannot consume reduce-scattered gradient shards: a reduce-scatter's output is a slice of every
parameter, not a set of whole parameters, and W writes gradients outside DDP's hooks anyway. Its
state dict is also consolidated on one rank (``consolidate_state_dict``), not sharded for DCP.

``ZeroOptimizer`` is the small flat-buffer version that fits ``GradSync(mode="zero1")``: the shard
of a parameter is chunk ``rank`` of its dim 0 (``layout.py``), so the wrapped optimizer (any
``torch.optim`` class, built by ``make_optimizer``) sees one small tensor per parameter — views
into one flat shard buffer per bucket — and its state is ``1/W`` of the unsharded state. After
stepping, one all-gather per bucket rebuilds the full parameters on every rank of the group.
``state_dict()`` names state by parameter FQN and holds ``Shard(0)`` DTensors, so DCP can load it
at another data-parallel size, or into a plain unsharded optimizer (``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .grad_sync import GradSync

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (what ZeRO-1 divides by the group size)."""
    total = 0
    for per_param in optimizer.state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


class ZeroOptimizer:
    """Sharded optimizer over the parameters of ``sync`` (a ``GradSync`` in ``"zero1"`` mode).

    Per step: ``sync.start()`` (at the stage's REDUCE op), ``sync.wait()``, then ``step()``:
    the wrapped optimizer updates this rank's shards and the full parameters are all-gathered.
    All parameters of the group must start equal on every rank (the shards are taken from them).
    """

    def __init__(self, sync: GradSync, make_optimizer: OptimizerFactory, *, names: Sequence[str] | None = None):
        if sync.mode != "zero1":
            raise ValueError(f"ZeroOptimizer needs a GradSync in mode 'zero1', got mode {sync.mode!r}")
        self.sync = sync
        self.params = sync.params
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.params))]
        if len(self.names) != len(self.params):
            raise ValueError(f"{len(self.names)} names for {len(self.params)} parameters")
        self._shard_bufs = sync.new_shards()
        self.shards = sync.shard_views(self._shard_bufs)  # the tensors the wrapped optimizer updates
        self.refresh_shards()
        self.optimizer = make_optimizer(self.shards)
        mine = {id(t) for g in self.optimizer.param_groups for t in g["params"]}
        if mine != {id(t) for t in self.shards}:
            raise ValueError("make_optimizer must build the optimizer over exactly the shard tensors it is given")
        self.gathers_posted = 0

    @classmethod
    def for_module(cls, module: nn.Module, sync: GradSync, make_optimizer: OptimizerFactory) -> ZeroOptimizer:
        """A ZeroOptimizer whose state is named by ``module``'s parameter FQNs (for checkpoints)."""
        by_id = {id(p): n for n, p in module.named_parameters()}
        missing = [i for i, p in enumerate(sync.params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"parameters {missing} of the GradSync are not parameters of the module")
        return cls(sync, make_optimizer, names=[by_id[id(p)] for p in sync.params])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Copy this rank's chunk of every parameter into the shards (after loading parameters)."""
        layout, rank = self.sync.layout, self.sync.rank
        for i, (p, shard) in enumerate(zip(self.params, self.shards)):
            slot = layout.slot_of[i][1]
            n, start = shard.shape[0], rank * slot.chunk_rows
            if n:
                rows = p.detach().reshape(slot.rows, slot.row_numel)[start: start + n]
                shard.copy_(rows.view_as(shard))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the module's local gradients (the next step accumulates from zero)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for s in self.shards:
            s.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shards from the reduced gradient shards, then all-gather the parameters."""
        if not self.sync.synced:
            raise RuntimeError("ZeroOptimizer.step() before the gradients were reduced: call sync.start() and "
                               "sync.wait() (the stage's REDUCE op) first")
        for shard, grad in zip(self.shards, self.sync.grad_shards()):
            shard.grad = grad
        self.optimizer.step()
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's shards into the full parameters on each rank of the group."""
        layout = self.sync.layout
        works = []
        fulls = []
        for b in range(len(layout.buckets)):
            full = layout.new_full(b, self.sync.device)
            works.append(_all_gather(full, self._shard_bufs[b], group=self.sync.group, async_op=True))
            fulls.append(full)
            self.gathers_posted += 1
        for b, (work, full) in enumerate(zip(works, fulls)):
            work.wait()
            for s, value in zip(layout.buckets[b].slots, layout.unpack(b, full)):
                self.params[s.index].copy_(value)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return optimizer_state_bytes(self.optimizer)

    # ----- checkpoints: FQN-named, Shard(0) DTensors (see checkpoint.py) -----------------------------
    def state_dict(self) -> dict[str, Any]:
        from .checkpoint import zero_state_dict

        return zero_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .checkpoint import load_zero_state_dict

        load_zero_state_dict(self, state)
