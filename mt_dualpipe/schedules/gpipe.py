"""GPipe: every rank runs all its forwards, then all its full backwards.

The simplest correct pipeline: rank r runs stage r; micro-batches flow down the chain, then their
gradients flow back up. Every rank keeps all M micro-batches' activations alive before its first
backward, which is what 1F1B fixes.
"""

from __future__ import annotations

from . import ops as K
from . import placements
from .info import ScheduleInfo
from .ir import Op, Schedule


def build_gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    ranks = [[Op(K.F, 0, r, m) for m in range(M)] + [Op(K.BW, 0, r, m) for m in range(M)] for r in range(P)]
    return Schedule("gpipe", P, M, placements.linear(P), [0] * M, ranks)


SCHEDULES = (
    ScheduleInfo("gpipe", "GPipe: all forwards, then all full backwards (peak activations M)", "any P >= 1, M >= 1",
                 build=build_gpipe),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
