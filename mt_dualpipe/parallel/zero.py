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

``PipelineOptimizer`` is the one object a pipeline rank steps (``Pipeline.build_optimizer``): a
``ZeroOptimizer`` per reduced group in zero1 mode (each weight kind over its own group, a tie's
state over its copies x replicas), one plain optimizer otherwise, tied copies kept equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .grad_sync import GradSync, TiedSync
from .stage_sync import get_mode
from .zero_state import load_zero_state_dict, zero_state_dict

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in ``optimizer.state``: moments, step counters (what ZeRO-1 and FSDP divide
    by the group size). A DTensor state (FSDP2's, stepping sharded parameters) counts its local shard:
    its ``numel()`` is the global size."""
    total = 0
    for per_param in optimizer.state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


class ZeroOptimizer:
    """Sharded optimizer over the parameters of ``sync`` (a ``GradSync`` in ``"zero1"`` mode).

    Per step: ``sync.start()`` (at the stage's REDUCE op), ``sync.wait()``, then ``step()``:
    the wrapped optimizer updates this rank's shards and the full parameters are all-gathered.
    All parameters of the group must start equal on every rank (the shards are taken from them).
    """

    def __init__(self, sync: GradSync, make_optimizer: OptimizerFactory, *, names: Sequence[str] | None = None):
        if not get_mode(sync.mode).zero_optimizer:
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
        self.step_shards()
        self.gather_params()

    @torch.no_grad()
    def step_shards(self) -> None:
        """The local half of ``step``: update this rank's shards (no communication)."""
        if not self.sync.synced:
            raise RuntimeError("ZeroOptimizer.step() before the gradients were reduced: call sync.start() and "
                               "sync.wait() (the stage's REDUCE op) first")
        for shard, grad in zip(self.shards, self.sync.grad_shards()):
            shard.grad = grad
        self.optimizer.step()

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's shards into the full parameters on each rank of the group."""
        self.finish_gather(self.post_gather())

    def post_gather(self) -> list[tuple[Any, torch.Tensor]]:
        """Post one asynchronous all-gather per bucket; ``finish_gather`` completes them."""
        layout = self.sync.layout
        pending = []
        for b in range(len(layout.buckets)):
            full = layout.new_full(b, self.sync.device)
            pending.append((_all_gather(full, self._shard_bufs[b], group=self.sync.group, async_op=True), full))
            self.gathers_posted += 1
        return pending

    @torch.no_grad()
    def finish_gather(self, pending: list[tuple[Any, torch.Tensor]]) -> None:
        layout = self.sync.layout
        for b, (work, full) in enumerate(pending):
            work.wait()
            for s, value in zip(layout.buckets[b].slots, layout.unpack(b, full)):
                self.params[s.index].copy_(value)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return optimizer_state_bytes(self.optimizer)

    # ----- checkpoints: FQN-named, Shard(0) DTensors (see zero_state.py) -----------------------------
    def state_dict(self) -> dict[str, Any]:
        return zero_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_zero_state_dict(self, state)


class PipelineOptimizer:
    """One optimizer for every stage a pipeline rank holds (``Pipeline.build_optimizer``), in every dp mode.

    ``params``: ``(name, parameter, sync)`` per trainable parameter (tied weights once, by their
    representative), ``sync`` the ``GradSync`` that reduces it or None. In ``"zero1"`` mode each
    ``GradSync`` (one per stage and weight kind, one per tie) gets a ``ZeroOptimizer``: the state
    of each kind is sharded over that kind's own group. Every other parameter (allreduce, fsdp,
    or nothing to reduce) goes to one plain optimizer built by ``factory``. ``ties``: the
    ``TiedSync`` objects; after each step their other local copies are set equal to the
    representative, so a tied weight is stepped once and its copies never drift. A rank whose stages
    hold no trainable parameter (``runtime/data_parallel.py``: pass-through stages) gets one that
    steps nothing, so one training loop runs on every rank.

    ``state_dict()`` has ``get_optimizer_state_dict``'s structure with parameters named by the
    pipeline's names (``stage<s>.<fqn>``, ``tied.<fqn>``); ZeRO-1 state is ``Shard(0)`` DTensors
    over its group (``checkpoint.py``), so DCP can reshard it.
    """

    def __init__(self, params: Sequence[tuple[str, torch.Tensor, GradSync | None]], factory: OptimizerFactory,
                 mode: str, ties: Sequence[TiedSync] = ()):
        self.mode = mode
        self.ties = list(ties)
        self.zero: list[ZeroOptimizer] = []
        zero = get_mode(mode).zero_optimizer
        by_sync: dict[int, tuple[GradSync, list[tuple[str, torch.Tensor]]]] = {}
        plain: list[tuple[str, torch.Tensor]] = []
        for name, p, sync in params:
            if zero and sync is not None:
                by_sync.setdefault(id(sync), (sync, []))[1].append((name, p))
            else:
                plain.append((name, p))
        for sync, named in by_sync.values():
            index = {id(p): n for n, p in named}
            self.zero.append(ZeroOptimizer(sync, factory, names=[index[id(p)] for p in sync.params]))
        # one order on every rank: each step all-gathers over its own group, and DualPipe's rank P-1-r
        # lists the mirrored stages the other way round (blocking collectives in two orders deadlock)
        self.zero.sort(key=lambda z: z.names[0])
        self.plain = factory([p for _, p in plain]) if plain else None
        by_id = {id(p): n for n, p in plain}
        # a torch optimizer numbers its state in param_groups order, whatever order it was given
        self.plain_names = ([by_id[id(p)] for g in self.plain.param_groups for p in g["params"]]
                            if self.plain is not None else [])
        # none at all on a rank whose stages hold nothing trainable (pass-through stages): it steps nothing
        self.optimizers = [z.optimizer for z in self.zero] + ([self.plain] if self.plain is not None else [])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every wrapped optimizer's groups (set ``lr`` here: it reaches all of them)."""
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        """Step every part; ZeRO-1 all-gathers are all posted before any is waited for, so ranks that
        list their groups in different orders (DualPipe's two mirrored stages) cannot wait on each other."""
        for z in self.zero:
            z.step_shards()
        pending = [z.post_gather() for z in self.zero]
        for z, p in zip(self.zero, pending):
            z.finish_gather(p)
        if self.plain is not None:
            self.plain.step()
        for t in self.ties:
            t.copy_to_copies()

    def refresh_shards(self) -> None:
        """Every ZeRO-1 part re-takes its shards from the (restored) parameters (``stage_sync.RetakesParameters``)."""
        for z in self.zero:
            z.refresh_shards()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for z in self.zero:
            z.zero_grad(set_to_none)
        if self.plain is not None:
            self.plain.zero_grad(set_to_none)
        for t in self.ties:
            for copies in t.copies:
                for p in copies[1:]:
                    if set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (all its shards and its plain state)."""
        return sum(optimizer_state_bytes(o) for o in self.optimizers)

    def _plain_state_dict(self) -> dict[str, Any]:
        assert self.plain is not None
        sd = self.plain.state_dict()
        names = self.plain_names
        return {"state": {names[i]: v for i, v in sd["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}

    def state_dict(self) -> dict[str, Any]:
        """FQN-named state of every part (ZeRO-1 shards as DTensors), one dict."""
        parts = [z.state_dict() for z in self.zero] + ([self._plain_state_dict()] if self.plain is not None else [])
        return {"state": {k: v for sd in parts for k, v in sd["state"].items()},
                "param_groups": [g for sd in parts for g in sd["param_groups"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (same pipeline layout; DCP reshards the ZeRO-1 DTensors)."""
        groups = list(state["param_groups"])
        for z in self.zero:
            n = len(z.optimizer.param_groups)
            z.load_state_dict({"state": state["state"], "param_groups": groups[:n]})
            groups = groups[n:]
        if self.plain is not None:
            index = {n: i for i, n in enumerate(self.plain_names)}
            missing = [n for n in self.plain_names if n not in state["state"]]
            if missing and self.plain.state:
                raise KeyError(f"optimizer state for parameter {missing[0]!r} is missing from the state dict")
            self.plain.load_state_dict({
                "state": {index[n]: v for n, v in state["state"].items() if n in index},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]})
