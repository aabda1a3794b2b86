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
  and the sync groups, and keeps the sync objects themselves (``rebuilt(keep_syncs=True)``), so
  optimizers built on them (``ZeroOptimizer``, ``Pipeline.build_optimizer``) keep working; a
  reduction left pending by the failed step is dropped at the next step's ``begin_step``.

The groups are matched across ranks by each sync's ``GroupUse`` (key, ranks; ``parallel.stage_sync``,
listed by ``Pipeline.sync_groups``): every rank gathers every rank's keys (one ``all_gather_object``
on the default group, which the pipeline never uses for its own traffic), and creates one group
per key in sorted order. FSDP2's own all-gathers run on the mesh
FSDP was given and are not replaced (a limit).
"""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist

from ..runtime.modules import Pipeline


def refresh_sync_groups(pipeline: Pipeline, timeout: float) -> int:
    """Give every reduction of ``pipeline`` a fresh group (same ranks) bounded by ``timeout`` seconds.

    Collective over the world (every rank calls it, with its own pipeline); returns the number of
    groups created."""
    mine = pipeline.sync_groups()
    gathered: list[list[tuple] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(u.key, u.ranks) for u in mine])
    keys = sorted(set(itertools.chain.from_iterable(g or [] for g in gathered)), key=repr)
    span = datetime.timedelta(seconds=timeout)
    groups = {key: dist.new_group(list(key[1]), timeout=span) for key in keys}
    for use in mine:
        pipeline.replace_sync_group(use, groups[(use.key, use.ranks)])
    return len(keys)


def rebuild_on_mesh(old: Pipeline, group: dist.ProcessGroup | None, timeout: float) -> Pipeline:
    """``old.rebuilt(group, keep_syncs=True)`` (which, on a mesh, creates every pipeline line's group on every
    rank) with ``old``'s sync objects on fresh groups (collective over the world)."""
    new = old.rebuilt(group, keep_syncs=True)  # optimizers hold these sync objects
    refresh_sync_groups(new, timeout)
    return new
