"""Fresh process groups for a pipeline on a mesh: bounded data-parallel waits, and a rebuild after a failed step.

When one data-parallel replica's step raises (an op fails, its pipeline peer times out), the other
replicas finish their pipelines and wait at the stage's reduction for ranks that never post it.
Two things make that recoverable:

* every reduction's group is bounded: ``refresh_sync_groups`` gives each sync object of the
  pipeline (``GradSync``, the parts of a ``StageSync``, a tie's ``GradSync``, ``FSDPStageSync``) a
  fresh group over the same ranks created with a timeout, so the wait fails after ``timeout``
  instead of hanging (gloo fails a collective that outlives its group's timeout);
* ``rebuild_on_mesh`` replaces the pipeline group of every pipeline line (``Pipeline.rebuilt``
  creates all of them on every rank in the same order: ``new_group`` is collective over the world)
  and the sync groups,
  and keeps the sync objects themselves, so optimizers built on them (``ZeroOptimizer``,
  ``Pipeline.build_optimizer``) keep working; a reduction left pending by the failed step is
  dropped at the next step's ``begin_step``.

The groups are matched across ranks by (stage, part, ranks): every rank gathers every rank's keys
(one ``all_gather_object`` on the default group, which the pipeline never uses for its own
traffic), and creates one group per key in sorted order. FSDP2's own all-gathers run on the mesh
FSDP was given and are not replaced (a limit).
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Hashable
from typing import Any

import torch.distributed as dist


def _ranks(obj: Any) -> tuple[int, ...]:
    group = getattr(obj, "group", None)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


def sync_parts(pipeline: Any) -> list[tuple[Hashable, Any]]:
    """``(key, object with a .group)`` for every reduction the pipeline runs on this rank, each object once."""
    out: list[tuple[Hashable, Any]] = []
    seen: set[int] = set()

    def add(key: tuple, obj: Any) -> None:
        if obj is not None and id(obj) not in seen and hasattr(obj, "group"):
            seen.add(id(obj))
            out.append(((*key, _ranks(obj)), obj))

    for (_, stage), sync in sorted((getattr(pipeline, "grad_syncs", None) or {}).items()):
        parts = getattr(sync, "parts", None)
        for i, part in enumerate(parts if parts is not None else [sync]):
            add(("stage", stage, i), part)
        for tie in getattr(sync, "ties", []):
            add(("tie", tuple(getattr(tie, "names", ()))), getattr(tie, "sync", None))
    return out


def refresh_sync_groups(pipeline: Any, timeout: float) -> int:
    """Give every reduction of ``pipeline`` a fresh group (same ranks) bounded by ``timeout`` seconds.

    Collective over the world (every rank calls it, with its own pipeline); returns the number of
    groups created."""
    mine = sync_parts(pipeline)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [key for key, _ in mine])
    keys = sorted(set(itertools.chain.from_iterable(gathered)))
    span = datetime.timedelta(seconds=timeout)
    groups = {key: dist.new_group(list(key[-1]), timeout=span) for key in keys}
    for key, obj in mine:
        obj.group = groups[key]
    return len(keys)


def rebuild_on_mesh(old: Any, group: dist.ProcessGroup | None, timeout: float) -> Any:
    """``old.rebuilt(group)`` (which, on a mesh, creates every pipeline line's group on every rank) with
    ``old``'s sync objects kept, on fresh groups (collective over the world)."""
    new = old.rebuilt(group)
    # optimizers hold these objects; no executor is built yet, so the next step lowers with them
    new.reductions, new.grad_syncs = old.reductions, old.grad_syncs
    refresh_sync_groups(new, timeout)
    return new
