"""1F1B: warm up, then alternate one forward and one full backward, then drain.

Rank r runs stage r. It starts with P-1-r warm-up forwards (just enough that the last stage's
first backward reaches it when it has nothing else to do), then alternates F and BW, then runs
the backwards still owed. A rank never holds more than P-r micro-batches' activations (P on
rank 0), instead of GPipe's M; the bubble is the same (P-1)(F+B+W).
"""

from __future__ import annotations

from . import ops as K
from . import placements
from .info import ScheduleInfo
from .ir import Op, Schedule


def one_f_one_b_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Op]:
    """The 1F1B order of one rank of a single chain of ``num_ranks`` stages (stage = rank)."""
    M = num_microbatches
    warmup = min(num_ranks - 1 - rank, M)
    ops = [Op(K.F, 0, rank, m) for m in range(warmup)]
    for m in range(M - warmup):  # steady: F of the next micro-batch, BW of the oldest
        ops += [Op(K.F, 0, rank, warmup + m), Op(K.BW, 0, rank, m)]
    ops += [Op(K.BW, 0, rank, m) for m in range(M - warmup, M)]  # drain
    return ops


def build_1f1b(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    ranks = [one_f_one_b_order(r, P, M) for r in range(P)]
    return Schedule("1f1b", P, M, placements.linear(P), [0] * M, ranks)


SCHEDULES = (
    ScheduleInfo("1f1b", "1F1B: P-1-r warm-up forwards, then one forward / one full backward (peak P)",
                 "any P >= 1, M >= 1",
                 build=build_1f1b),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
