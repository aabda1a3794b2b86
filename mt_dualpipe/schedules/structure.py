"""The shape of a schedule: every op exactly once, on the rank its placement names (no dependency walk).

``check_structure`` is what ``validate`` checks before it walks the dependencies, and what the
simulator asks when a malformed schedule makes it fail, to name the offending op. It has its own
module so that both build on it: ``validate`` needs the simulator's walk, the simulator needs this.
"""

from __future__ import annotations

from . import ops as K
from .data_parallel import last_weight_grads
from .errors import ScheduleError
from .ir import FB, Op, Schedule
from .ops import BACKWARD_KINDS, COMPLETE_SETS, COMPUTE_KINDS, STAGE_KINDS


def _check_header(schedule: Schedule) -> None:
    P = schedule.num_ranks
    placement = schedule.placement
    if not placement or any(len(c) == 0 for c in placement):
        raise ScheduleError("placement must list at least one stage for every chain")
    if len({len(c) for c in placement}) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages")
    for c, chain in enumerate(placement):
        for s, r in enumerate(chain):
            if not 0 <= r < P:
                raise ScheduleError(f"placement of chain {c} stage {s} is rank {r}; ranks are 0..{P - 1}")
    for m, c in enumerate(schedule.microbatch_chain):
        if not 0 <= c < len(placement):
            raise ScheduleError(f"micro-batch {m} is on chain {c}; chains are 0..{len(placement) - 1}")


def check_structure(schedule: Schedule) -> None:
    """Exactly-once ops on the placement's ranks, well-formed FB pairs (no dependency check).

    Public so that lowering, simulation and users can check a hand-made schedule's shape without
    walking its dependencies. A tight loop marks the ops of a well-formed schedule; the first
    anomaly sends the check down the detailed path that names the offending op.
    """
    _check_header(schedule)
    placement = schedule.placement
    n = len(placement) * len(placement[0]) * schedule.num_microbatches
    seen = {k: bytearray(n) for k in COMPUTE_KINDS}
    if not _mark_all(schedule, seen):
        seen = {k: bytearray(n) for k in COMPUTE_KINDS}
        stage_ops: list[tuple[int, int, Op]] = []
        for r, ops in enumerate(schedule.ranks):
            for i, item in enumerate(ops):
                for op in _item_parts(r, i, item):
                    if not _mark(schedule, seen, r, i, op):
                        stage_ops.append((r, i, op))
        if stage_ops:
            _check_reductions(schedule, stage_ops)
    _check_complete(schedule, seen)


def _mark_all(schedule: Schedule, seen: dict[str, bytearray]) -> bool:
    """Mark every op of a well-formed schedule; False at the first thing that needs a closer look."""
    placement, chain_of, M = schedule.placement, schedule.microbatch_chain, schedule.num_microbatches
    C, S = len(placement), len(placement[0])
    rank_of = [r for chain in placement for r in chain]
    F, backward = K.F, BACKWARD_KINDS
    for r, ops in enumerate(schedule.ranks):
        for item in ops:
            if type(item) is FB:
                f, b = item
                if type(f) is not Op or type(b) is not Op or f.kind != F or b.kind not in backward or f.mb == b.mb:
                    return False
            elif type(item) is not Op:
                return False
            for kind, c, s, m in (item if type(item) is FB else (item,)):
                arr = seen.get(kind)
                if arr is None or not (0 <= c < C and 0 <= s < S and 0 <= m < M) or chain_of[m] != c:
                    return False
                cs = c * S + s
                u = cs * M + m
                if rank_of[cs] != r or arr[u]:
                    return False
                arr[u] = 1
    return True


def _item_parts(r: int, i: int, item: object) -> tuple[Op, ...]:
    """The plain ops of a schedule entry, or ScheduleError for anything that is not an op or FB."""
    t = type(item)
    if t is Op:
        return (item,)
    if t is not FB:
        raise ScheduleError(f"rank {r} op {i}: expected an Op or FB, got {item!r}")
    f, b = item.f, item.b
    if type(f) is not Op or type(b) is not Op or f.kind != K.F or b.kind not in BACKWARD_KINDS:
        raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs an F with a B or BW")
    if f.mb == b.mb:
        raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs two different micro-batches")
    return (f, b)


def _mark(schedule: Schedule, seen: dict[str, bytearray], r: int, i: int, op: Op) -> bool:
    """Record ``op`` as present, checking its kind, its rank and that it is not a duplicate.

    False for a stage-level op (``ops.STAGE_KINDS``), which ``_check_reductions`` checks instead.
    """
    kind, c, s, m = op
    arr = seen.get(kind)
    if arr is None:
        if kind in STAGE_KINDS:
            return False
        raise ScheduleError(f"rank {r} op {i} {op}: unknown kind {kind!r}; allowed F, B, W, BW, FB")
    placement, M = schedule.placement, schedule.num_microbatches
    C, S = len(placement), len(placement[0])
    if not (0 <= c < C and 0 <= s < S and 0 <= m < M) or schedule.microbatch_chain[m] != c \
            or placement[c][s] != r:
        raise ScheduleError(_misplaced(r, i, op, schedule))
    u = (c * S + s) * M + m
    if arr[u]:
        raise ScheduleError(f"rank {r} op {i} {op}: duplicate, {_where(schedule, op)}")
    arr[u] = 1
    return True


def _check_reductions(schedule: Schedule, stage_ops: list[tuple[int, int, Op]]) -> None:
    """``REDUCE_GRAD``: exactly one per local stage on every rank, after that stage's last W/BW."""
    found: dict[tuple[int, int], tuple[int, int]] = {}
    for r, i, op in stage_ops:
        c, s = op.chain, op.stage
        if not (0 <= c < len(schedule.placement) and 0 <= s < len(schedule.placement[c])) \
                or schedule.placement[c][s] != r:
            raise ScheduleError(f"rank {r} op {i} {op}: rank {r} does not run chain {c} stage {s}")
        if (c, s) in found:
            raise ScheduleError(f"rank {r} op {i} {op}: duplicate, already at rank {r} op {found[(c, s)][1]}")
        found[(c, s)] = (r, i)
    for r, ops in enumerate(schedule.ranks):
        last = last_weight_grads(ops)
        for cs in schedule.local_stages(r):
            if cs not in found:
                raise ScheduleError(f"rank {r}: stage (c{cs[0]},s{cs[1]}) has no REDUCE_GRAD; a data-parallel "
                                    "schedule reduces every stage once (see data_parallel.add_grad_reduction)")
            if found[cs][1] < last.get(cs, -1):
                raise ScheduleError(f"rank {r} op {found[cs][1]} REDUCE_GRAD(c{cs[0]},s{cs[1]}) comes before "
                                    f"that stage's last weight-gradient op (op {last[cs]}): its gradient is not final")


def _check_complete(schedule: Schedule, seen: dict[str, bytearray]) -> None:
    """Every (chain, stage, micro-batch) runs one of ``ops.COMPLETE_SETS`` of kinds, exactly."""
    placement, M = schedule.placement, schedule.num_microbatches
    S = len(placement[0])
    sf, sb, sw, sbw = seen[K.F], seen[K.B], seen[K.W], seen[K.BW]
    bit = {K.F: 1, K.B: 2, K.W: 4, K.BW: 8}
    complete = {sum(bit[k] for k in kinds) for kinds in COMPLETE_SETS}
    for m, c in enumerate(schedule.microbatch_chain):
        for s in range(S):
            u = (c * S + s) * M + m
            if sf[u] | sb[u] << 1 | sw[u] << 2 | sbw[u] << 3 in complete:
                continue
            r = placement[c][s]
            if not sf[u]:
                raise ScheduleError(f"rank {r}: F(c{c},s{s},m{m}) is missing")
            if sbw[u]:
                raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) has both a BW and a split B/W")
            missing = "a BW, or a B and a W" if not (sb[u] or sw[u]) else ("W" if sb[u] else "B")
            raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) lacks {missing}")


def _misplaced(r: int, i: int, op: Op, schedule: Schedule) -> str:
    where = f"rank {r} op {i} {op}"
    placement, M = schedule.placement, schedule.num_microbatches
    if not 0 <= op.chain < len(placement) or not 0 <= op.stage < len(placement[op.chain]):
        return f"{where}: no such chain/stage in the placement"
    if not 0 <= op.mb < M:
        return f"{where}: micro-batch {op.mb} out of range 0..{M - 1}"
    if schedule.microbatch_chain[op.mb] != op.chain:
        return f"{where}: micro-batch {op.mb} belongs to chain {schedule.microbatch_chain[op.mb]}"
    owner = placement[op.chain][op.stage]
    return f"{where}: the placement puts chain {op.chain} stage {op.stage} on rank {owner}"


def _where(schedule: Schedule, op: Op) -> str:
    for r, ops in enumerate(schedule.ranks):
        for i, item in enumerate(ops):
            if op in ((item.f, item.b) if type(item) is FB else (item,)):
                return f"already at rank {r} op {i}"
    return "already present"
