"""Zero Bubble schedules (Qi et al., ICLR 2024): the backward split into B and W.

B (the input gradient) is on the critical path: the previous stage waits for it. W (the weight
gradient) is needed only by the optimizer step, so it may run any time later on the same rank and
fill what would otherwise be a bubble. Its activations stay alive until it runs.

ZB-H1 and ZB-H2 are one order with two pairs of numbers. Rank r runs ``warmup`` forwards, then
for every micro-batch k: B(k), the W ``delay`` micro-batches behind (W(k-delay)), the next F;
the W's still owed end the step. The delay is what lets the last ranks send their B's early and
finish their W's in the shadow of the earlier ranks' tail.

- ZB-H1: warmup P-r, delay r. Peak P activations on every rank (1F1B's memory), makespan bubble
  (P-1)(F+B-W) on every rank when W <= F, B.
- ZB-H2: warmup 2(P-r)-1, delay 2r: enough forwards to fill the wait for the first B, peak 2P-1,
  span bubble (P-1)(F+B-2W) on rank 0 (the most) when W <= F, B: none at all when F = B = W.

ZB-V puts two half-size chunks on each rank in a V (rank r runs stages r and 2P-1-r, every
micro-batch enters and leaves at rank 0), reaching zero span bubble at 2P chunk activations
(1F1B's memory in full-stage units). Per rank, with chunk 0 = stage r and chunk 1 = stage 2P-1-r:

==================  ===========  ==========================================
phase               repeats      ops per repeat
warm-up 1           2(P-r)-1     F0
warm-up 2           r            F1, F0
warm-up 3           P-r          F1, B1, W1
steady              until done   F0 (while any left), B0, W0, F1, B1, W1
cool-down 1         r            B0, B1 (their W deferred)
cool-down 2         P-r          B0 (W deferred), W
tail                             the remaining deferred W's
==================  ===========  ==========================================

F0/B0/W0 are chunk 0's ops, F1/B1/W1 chunk 1's, each taking its chunk's micro-batches in order.
Every W here runs the oldest deferred B's weight gradient, so on every rank of every ZB schedule
the W's come in the order of their B's: ``WeightGradStore.run_oldest`` serves them. (torch's
ScheduleZBVZeroBubble runs chunk 0's oldest in cool-down 2 and then chunk 1's before chunk 0's;
nothing depends on a W, so the choice changes no start time, only which activations are freed.)
"""

from __future__ import annotations

from collections import deque

from . import ops as K
from . import placements
from .errors import ScheduleError
from .info import ScheduleInfo
from .ir import Op, Schedule


def zero_bubble_order(rank: int, M: int, warmup: int, delay: int) -> list[Op]:
    """One rank's single-chain ZB order: ``warmup`` forwards, then B(k), W(k-delay), F(next)."""
    warmup = min(warmup, M)
    ops = [Op(K.F, 0, rank, m) for m in range(warmup)]
    for k in range(M):
        ops.append(Op(K.B, 0, rank, k))
        if k >= delay:
            ops.append(Op(K.W, 0, rank, k - delay))
        if warmup + k < M:
            ops.append(Op(K.F, 0, rank, warmup + k))
    ops += [Op(K.W, 0, rank, m) for m in range(max(0, M - delay), M)]
    return ops


def build_zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    ranks = [zero_bubble_order(r, M, warmup=P - r, delay=r) for r in range(P)]
    return Schedule("zb-h1", P, M, placements.linear(P), [0] * M, ranks)


def build_zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    ranks = [zero_bubble_order(r, M, warmup=2 * (P - r) - 1, delay=2 * r) for r in range(P)]
    return Schedule("zb-h2", P, M, placements.linear(P), [0] * M, ranks)


def zbv_order(rank: int, P: int, M: int) -> list[Op]:
    """One rank's ZB-V order (see the module docstring's table)."""
    stage = (rank, 2 * P - 1 - rank)  # chunk 0 on the way down, chunk 1 on the way back
    nf, nb = [0, 0], [0, 0]  # next forward / backward micro-batch of each chunk
    deferred: deque[Op] = deque()
    ops: list[Op] = []

    def f(c: int) -> None:
        ops.append(Op(K.F, 0, stage[c], nf[c]))
        nf[c] += 1

    def b(c: int, defer: bool = False) -> None:
        ops.append(Op(K.B, 0, stage[c], nb[c]))
        (deferred.append if defer else ops.append)(Op(K.W, 0, stage[c], nb[c]))
        nb[c] += 1

    for _ in range(2 * (P - rank) - 1):
        f(0)
    for _ in range(rank):
        f(1)
        f(0)
    for _ in range(P - rank):
        f(1)
        b(1)
    while nf[1] < M:
        if nf[0] < M:
            f(0)
        b(0)
        f(1)
        b(1)
    for _ in range(rank):
        b(0, defer=True)
        b(1, defer=True)
    for _ in range(P - rank):
        b(0, defer=True)
        ops.append(deferred.popleft())
    ops += deferred
    return ops


def build_zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    if M < 2 * P - 1:
        raise ScheduleError(f"zbv needs at least 2*num_ranks-1 = {2 * P - 1} micro-batches, got {M}")
    placement = placements.v_shape(P)
    return Schedule("zbv", P, M, placement, [0] * M, [zbv_order(r, P, M) for r in range(P)])


SCHEDULES = (
    ScheduleInfo("zb-h1", "Zero Bubble H1: B/W split, W fills the bubbles at 1F1B's memory (peak P)",
                 "any P >= 1, M >= 1",
                 build=build_zb_h1),
    ScheduleInfo("zb-h2", "Zero Bubble H2: more warm-up forwards, zero span bubble when F=B=W (peak 2P-1)",
                 "any P >= 1, M >= 1",
                 build=build_zb_h2),
    ScheduleInfo("zbv", "Zero Bubble V: two chunks per rank in a V, B/W split, zero span bubble at peak 2P chunks",
                 "M >= 2P-1", placement="v",
                 build=build_zbv),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
