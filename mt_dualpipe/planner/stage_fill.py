"""Whether a DeepSeek-V3-style model's layers fill a pipeline: the stages its balanced cut leaves without a
block, the fewest layers that give every stage one, and the deepest pipeline a layer count fills.

The first stage of a chain holds the embedding and the last the final norm, the head, the MTP
modules (each with a block of its own) and the losses, so they have parameters even without a
block; a stage between them that ``stage_cut.balance`` gives no block holds nothing. The runtime
runs such a stage as a pass-through (``runtime/data_parallel.py``), but a model cut that way trains
fewer layers than it has ranks to spare: it is what asking a 4-layer model for DualPipe at pp 8
gives. The DeepSeek-V3 demo refuses it with these numbers, and the planner's miniature at the plan's
own pp (``runnable.miniature``) asks for the layers that avoid it.

With a recompute policy the first stage needs a block too (``first=True``): the DeepSeek-V3 stages
apply the policy to every stage, and ``models.recompute.apply_recompute`` refuses a stage with no
layer that declares recompute regions, which an embedding-only first stage is.

The count is the balanced cut's, not the bound ``stages - 2``: the cut minimises the heaviest rank's
modelled cost, and on some placements it leaves a stage empty by choice (interleaved 1F1B at pp 8,
16 layers: the rank that holds the last stage takes no block on its first; ZB-V's rank 0, which
holds the last stage, keeps its first stage to the embedding until 22 layers at pp 8), so the
fewest layers are searched, not computed. Torch-free, like ``stage_cut``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..schedules.errors import ScheduleError
from ..schedules.registry import build_schedule, has_fb_units, schedule_info
from .model import ModelSpec
from .stage_cut import balanced_counts, empty_stages

SEARCH_LAYERS = 128
"""How many layer counts above the first candidate ``layers_to_fill`` tries before it gives up (None)."""


def placement_of(schedule: str, pp: int, options: dict | None = None) -> tuple[tuple[int, ...], ...] | None:
    """``schedule``'s placement on ``pp`` ranks (``ScheduleInfo.layout``: no order is built), or None for a
    schedule or option the registry does not know."""
    try:
        return tuple(schedule_info(schedule).layout(pp, **(options or {})).ranks)
    except ScheduleError:
        return None


def runs_at(schedule: str, pp: int, options: dict | None = None, num_microbatches: int | None = None) -> bool:
    """Whether ``schedule`` builds on ``pp`` ranks (DualPipe does not at an odd pp) with ``num_microbatches``
    (default: two per stage of a chain, the demo's default)."""
    placement = placement_of(schedule, pp, options)
    if placement is None:
        return False
    try:
        build_schedule(schedule, pp, num_microbatches or 2 * len(placement[0]), **(options or {}))
    except ScheduleError:
        return False
    return True


def layers_to_fill(spec_for: Callable[[int], ModelSpec], placement: Sequence[Sequence[int]], seq_len: int,
                   least: int = 1, first: bool = False, fb_units: bool = False) -> int | None:
    """The fewest layers, at least ``least``, whose balanced cut on ``placement`` leaves no stage empty
    (``empty_stages``; ``spec_for(layers)``: the model with that many), or None within ``SEARCH_LAYERS`` more.
    ``fb_units``: the schedule's (``registry.has_fb_units``), which the cut depends on."""
    start = max(least, len(placement[0]) - (1 if first else 2), 1)
    for layers in range(start, start + SEARCH_LAYERS):
        if not empty_stages(balanced_counts(spec_for(layers), placement, seq_len, fb_units), first):
            return layers
    return None


def deepest_filled_pp(spec: ModelSpec, schedule: str, seq_len: int, below: int, options: dict | None = None,
                      first: bool = False) -> int | None:
    """The largest pp under ``below`` at which ``schedule``'s balanced cut of ``spec`` leaves no stage empty
    (``empty_stages``), or None when none does (a pp the schedule cannot run on is skipped)."""
    for pp in range(below - 1, 0, -1):
        placement = placement_of(schedule, pp, options)
        if placement is not None and \
                not empty_stages(balanced_counts(spec, placement, seq_len, has_fb_units(schedule)), first) and \
                runs_at(schedule, pp, options):
            return pp
    return None
