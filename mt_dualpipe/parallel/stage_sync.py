"""The contract of a stage's gradient sync, and the data-parallel modes, each defined once.

A pipeline stage reduces its gradients at its ``REDUCE_GRAD`` op (``schedules/data_parallel.py``
places it after the stage's last W/BW on the rank). What runs there is a *stage sync*: an object
that the executor, the optimizer, the checkpoint code and resilience ask the same questions.
``StageGradSync`` is that question list, as a ``typing.Protocol``:

* the step: ``begin_step()`` before the stage's first F (a reduction a failed step left pending is
  dropped), ``start()`` at REDUCE_GRAD (post the collectives, asynchronously), ``wait()`` before
  the step returns; ``pending`` / ``synced`` say where it is, ``collectives_posted`` counts;
* what it holds after a sharding reduce: ``reduced_shards()`` — this rank's reduced gradient
  chunks where ``.grad`` was emptied (ZeRO-1), for a gradient-norm check that must see them;
* its process groups: ``process_groups()`` lists each collective group it posts on, as
  ``GroupUse(key, ranks)``; ``replace_group(key, group)`` swaps one for a fresh group over the same
  ranks (``resilience.regroup``: bounded waits, a rebuild after a failed step);
* its identity: ``mode`` (a key of ``DP_MODES``) and ``describe()`` (``SyncInfo``: what it reduces,
  over which ranks, divided by what), what a log line or a test reads.

``GradSync`` (all-reduce, ZeRO-1), ``StageSync`` (a stage's weight kinds and its ties),
``TiedSync`` (weights tied across stages) and ``FSDPStageSync`` (``fully_shard`` stages) implement
it; ``tests/parallel/test_stage_sync.py`` checks each against the protocol. Parameters are re-taken
after a restore by the optimizer that caches them (``RetakesParameters``: ``ZeroOptimizer``,
``PipelineOptimizer``), not by the sync, which holds nothing of a parameter between steps.

``DP_MODES`` (``modes.py``, re-exported here) lists the data-parallel modes and what each can run.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from .modes import DP_MODES, DataParallelMode, get_mode, mode_for_zero_stage

__all__ = ["DP_MODES", "DataParallelMode", "GroupUse", "RetakesParameters", "StageGradSync", "SyncInfo", "get_mode",
           "group_ranks", "mode_for_zero_stage", "stage_params"]


@dataclass(frozen=True)
class GroupUse:
    """One process group a sync posts collectives on: a key unique within the pipeline rank, and its ranks.

    Ranks are global and sorted; two ranks holding the same (key, ranks) share the group, which is how
    ``resilience.regroup`` matches fresh groups across ranks.
    """

    key: tuple[Hashable, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class SyncInfo:
    """What one stage sync reduces: its mode, its parameters and buckets, its groups, its divisor."""

    mode: str
    num_params: int
    numel: int
    buckets: int
    groups: tuple[GroupUse, ...]
    divide_by: int


@runtime_checkable
class StageGradSync(Protocol):
    """What the executor, the optimizer, checkpoints and resilience may ask of a stage's gradient sync."""

    mode: str

    @property
    def pending(self) -> bool:
        """True between ``start()`` and ``wait()``."""
        ...

    @property
    def synced(self) -> bool:
        """True after ``wait()`` until the next ``begin_step()``/``start()``."""
        ...

    @property
    def collectives_posted(self) -> int:
        """Collectives this object posted so far (per instance; tests and timelines read it)."""
        ...

    def begin_step(self) -> None:
        """Before the stage's first F: drop a reduction a failed step left pending, prepare the step."""
        ...

    def start(self) -> None:
        """At REDUCE_GRAD: post the reduction of the stage's final gradients (asynchronous)."""
        ...

    def wait(self) -> None:
        """Complete the reduction: the reduced gradients (or shards) are in place."""
        ...

    def reduced_shards(self) -> list[torch.Tensor]:
        """After ``wait()``: the reduced gradient chunks this rank holds where ``.grad`` was emptied."""
        ...

    def process_groups(self) -> list[GroupUse]:
        """Every process group this object posts collectives on (nested objects' included)."""
        ...

    def replace_group(self, key: tuple[Hashable, ...], group: dist.ProcessGroup) -> None:
        """Post on ``group`` (same ranks) from now on wherever ``key`` was used."""
        ...

    def describe(self) -> SyncInfo:
        """The sync's identity (mode, sizes, groups, divisor)."""
        ...


@runtime_checkable
class RetakesParameters(Protocol):
    """An optimizer that keeps its own copy of parameters (ZeRO-1 shards) and re-takes it after a restore."""

    def refresh_shards(self) -> None:
        """Copy this rank's shards again from the (restored) parameters."""
        ...


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


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The sorted global ranks of ``group`` (None: the default group)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))
