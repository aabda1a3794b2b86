"""DualPipe (two mirrored chains) and DualPipeV (one chain in a V) — one ordering, two placements.

Both follow the eight-step order of docs/schedules.md ("The DualPipe order, step by step"). A rank sees two
stage-streams, "own" (the one that enters nearer to it) and "other"; the steps only say which
stream's next F, B or W comes next, so one function serves both placements:

==== ========== ============================================
step repeats    ops per repeat
1    2(n-h-1)   F own
2    h+1        F own, F other
3    n-h-1      B* other, W, F other
4    C-P'+h+1   FB(F own + BW other), FB(F other + BW own)
5    n-h-1      BW other, FB(F other + BW own)
6    h+1        B other, B own (first half BW, second half B*)
7    n-h-1      W, B* own
8    h+1        W
==== ========== ============================================

B* is an input-gradient backward whose W is deferred; a W always takes the oldest deferred one.
"""

from __future__ import annotations

from collections import deque

from . import ops as K
from . import placements
from .errors import ScheduleError
from .info import ScheduleInfo
from .ir import FB, ComputeItem, Op, Schedule


class _Stream:
    """One stage of one chain on this rank: hands out its micro-batches in order."""

    def __init__(self, chain: int, stage: int, mbs: list[int]):
        self.chain, self.stage, self.mbs = chain, stage, mbs
        self.next_f = 0
        self.next_b = 0

    def f(self) -> Op:
        op = Op(K.F, self.chain, self.stage, self.mbs[self.next_f])
        self.next_f += 1
        return op

    def b(self, kind: str) -> Op:
        op = Op(kind, self.chain, self.stage, self.mbs[self.next_b])
        self.next_b += 1
        return op


def bidirectional_order(own: _Stream, other: _Stream, h: int, n: int, per_stream: int,
                        steady_offset: int) -> list[ComputeItem]:
    """The eight-step order for one rank (see the module docstring)."""
    out: list[ComputeItem] = []
    deferred: deque[Op] = deque()

    def b_star(stream: _Stream) -> Op:
        op = stream.b(K.B)
        deferred.append(Op(K.W, op.chain, op.stage, op.mb))
        return op

    for _ in range(2 * (n - h - 1)):  # 1
        out.append(own.f())
    for _ in range(h + 1):  # 2
        out += [own.f(), other.f()]
    for _ in range(n - h - 1):  # 3
        out.append(b_star(other))
        out.append(deferred.popleft())
        out.append(other.f())
    steady = per_stream - steady_offset + h + 1
    for i in range(steady):  # 4
        if i == 0 and h == n - 1:  # the middle ranks cannot overlap their first pair
            out += [own.f(), other.b(K.BW)]
        else:
            out.append(FB(own.f(), other.b(K.BW)))
        out.append(FB(other.f(), own.b(K.BW)))
    for _ in range(n - h - 1):  # 5
        out.append(other.b(K.BW))
        out.append(FB(other.f(), own.b(K.BW)))
    tail = [other, own] * (h + 1)  # 6
    for j, stream in enumerate(tail):
        out.append(stream.b(K.BW) if j < h + 1 else b_star(stream))
    for _ in range(n - h - 1):  # 7
        out.append(deferred.popleft())
        out.append(b_star(own))
    while deferred:  # 8
        out.append(deferred.popleft())
    return out


def build_dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    if P % 2:
        raise ScheduleError(f"dualpipe needs an even number of ranks, got {P}")
    if M % 2:
        raise ScheduleError(f"dualpipe needs an even number of micro-batches (half enter at each end), got {M}")
    if M < 2 * P:
        raise ScheduleError(f"dualpipe needs at least 2*num_ranks = {2 * P} micro-batches, got {M}")
    C, n = M // 2, P // 2
    chains = [list(range(C)), list(range(C, M))]
    placement = placements.dual(P)
    ranks = []
    for r in range(P):
        h = min(r, P - 1 - r)
        s0 = _Stream(0, r, chains[0])
        s1 = _Stream(1, P - 1 - r, chains[1])
        own, other = (s0, s1) if r < n else (s1, s0)
        ranks.append(bidirectional_order(own, other, h, n, C, P))
    return Schedule("dualpipe", P, M, placement, placements.dual_chains(M), ranks)


def build_dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    if M < 2 * P:
        raise ScheduleError(f"dualpipev needs at least 2*num_ranks = {2 * P} micro-batches, got {M}")
    mbs = list(range(M))
    placement = placements.v_shape(P)
    ranks = [bidirectional_order(_Stream(0, r, mbs), _Stream(0, 2 * P - 1 - r, mbs), r, P, M, 2 * P)
             for r in range(P)]
    return Schedule("dualpipev", P, M, placement, [0] * M, ranks)


SCHEDULES = (
    ScheduleInfo("dualpipe", "DeepSeek-V3's bidirectional pipeline: two mirrored chains overlapped F&B",
                 "even P >= 2, even M >= 2P; 2x parameters per rank", param_copies=2, placement="dual",
                 fb_units=True, build=build_dualpipe),
    ScheduleInfo("dualpipev", "DualPipe cut in half: one chain of 2P stages in a V, overlapped F&B",
                 "M >= 2P", placement="v", fb_units=True,
                 build=build_dualpipev),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
